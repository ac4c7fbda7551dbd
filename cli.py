"""``hybridtron`` command line: prepare, train, ablate, plan, export, eval, sample, kernels; submit and status (SLURM).

Each subcommand takes ``--config PRESET_OR_YAML`` and dotted overrides (``--train.max_steps 200``). This module
only parses and reports: ``train`` runs the recipe in train/recipe.py, ``submit`` and ``status`` slurm/; neither
folder imports this one.

Nothing here imports torch before a command needs it: the parser, --help, a usage error, the config and its layout
are answered from torch-free modules (configs/, train/run_dir.py, train/parallel/layout.py, kernels/rules.py), and
each command imports its heavy modules (torch, the trainer, the data pipeline) once its input is checked. Importing
them at the top cost every invocation ~4.5 s of CPU on a 2-core VM, --help and a mistyped flag included
(bench/RESULTS.md); tests/test_cli_import_cost.py keeps torch out of those paths.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import json
import math
import os
import sys
from pathlib import Path

from hybridtron.configs import ConfigError, check_overrides, parse_overrides
from hybridtron.data_pipeline.errors import DataError
from hybridtron.quiet import quiet_dependencies
from hybridtron.train.errors import CheckpointError, DiskFullError, NonFiniteLossError
from hybridtron.train.launcher_watch import launched, tell_launcher, watch_parent
from hybridtron.train.parallel.layout import check_plan_engine, check_plan_layout, check_run, launch_world
from hybridtron.train.run_dir import DEFAULT_PRESET, check_output_dir, default_run_dir, resolve_data_dir, resolve_job

EXIT_CODES = (
    "exit codes: 0 done; 2 bad input or state (a config, data, a checkpoint or run directory that is missing, "
    "damaged or does not match; permission denied), one line on stderr naming the file and what to do; "
    "3 training diverged (non-finite loss); 4 no space left on device (the line names the path); 5 another "
    "process of a multi-process job stopped (its own line and the launcher's summary say why); 6 a hang "
    "(train.hang_timeout_s: the line names the ranks that did not arrive; a SLURM job restarts). --debug or "
    "HYBRIDTRON_DEBUG=1 re-raises instead, with the traceback; a bug always shows its traceback."
)


# ---- subcommands --------------------------------------------------------------------------------
def _log(msg: str) -> None:
    """The trainer's progress line (tagged with the rank), imported when a command first logs."""
    from hybridtron.train.rank_log import rank_log

    rank_log(msg)


def cmd_prepare(args) -> int:
    cfg, run_dir = resolve_job(args)
    resolve_data_dir(cfg, run_dir)  # the directory `train` with these arguments would use
    check_output_dir(Path(cfg.data.out_dir).expanduser(), f"data.out_dir={cfg.data.out_dir}")
    if args.stage is not None:  # the jobs of `hybridtron submit prepare` (data_pipeline/prepare_tasks.py)
        from hybridtron.data_pipeline import prepare_tasks

        if args.stage == "plan":
            prepare_tasks.plan_stage(cfg.data, log=_log)
        else:
            if args.task is None or args.tasks is None:
                raise ConfigError("--stage task needs --task K and --tasks N (this is task K of N, K from 0)")
            prepare_tasks.task_stage(cfg.data, args.task, args.tasks, log=_log)
        return 0
    from hybridtron.data_pipeline import prepare_data  # (numpy, the tokenizer trainers: after the checks)

    prepared = prepare_data(cfg.data, log=_log)  # on bad input, it removes the directories it made
    _log(f"prepared data in {prepared.out_dir} (tokenizer: {prepared.tokenizer_dir})")
    _log(json.dumps(prepared.stats))
    return 0


def cmd_train(args) -> int:
    cfg, run_dir = resolve_job(args)  # 1. config, validated before any heavy work
    init_from = None
    if args.init_from:
        from hybridtron.train.hf.load import apply_init_from

        init_from = apply_init_from(cfg, args.init_from)  # model section + tokenizer from the HF directory
    check_run(cfg, launch_world()[2])  # its layout and kernels, torch-free where the device does not decide
    from hybridtron.train.recipe import train_run

    train_run(cfg, run_dir, init_from=init_from)
    return 0


CHECKPOINT_HOLDS = "a checkpoint directory (RUN_DIR/checkpoints/step_N) holds config.yaml, tokenizer/ and the weights"


def _checkpoint_for_inference(args) -> Path:
    """--checkpoint, or --run-dir's latest checkpoint; CheckpointError saying which is missing and what was
    expected there."""
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        if not ckpt.exists():
            raise CheckpointError(f"--checkpoint {ckpt} does not exist; pass a checkpoint directory "
                                  f"(RUN_DIR/checkpoints/step_N), or --run-dir RUN_DIR for a run's latest")
        if (ckpt / "checkpoints").is_dir():
            raise CheckpointError(f"--checkpoint {ckpt} is a run directory, not a checkpoint; pass --run-dir {ckpt} "
                                  f"for its latest checkpoint, or --checkpoint {ckpt}/checkpoints/step_N")
        absent = [name for name in ("config.yaml", "tokenizer/") if not (ckpt / name).exists()]
        if absent:
            raise CheckpointError(f"--checkpoint {ckpt} is not a checkpoint: it has no {' and no '.join(absent)} "
                                  f"({CHECKPOINT_HOLDS})")
        return ckpt
    from hybridtron.train.checkpoint import CheckpointManager

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(None)
    flag = f"--run-dir {run_dir}" if args.run_dir else f"the default run directory {run_dir}"
    if not run_dir.is_dir():
        raise CheckpointError(f"{flag} does not exist; pass --run-dir RUN_DIR (a `hybridtron train` run) or "
                              f"--checkpoint DIR")
    ckpt = CheckpointManager(run_dir).latest()
    if ckpt is None:
        raise CheckpointError(f"{flag} has no checkpoint ({run_dir / 'checkpoints'} holds no step_N directory); "
                              f"train it first, or pass --checkpoint DIR")
    return ckpt


@contextlib.contextmanager
def _logs_to_stderr():
    """Every line printed inside (progress, warnings) goes to stderr; yields the real stdout, for the result alone,
    so that `hybridtron eval ... | jq .` reads nothing else."""
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        yield out


def cmd_eval(args) -> int:
    check_overrides(parse_overrides(args.overrides))  # before the checkpoint's config is read, and torch imported
    with _logs_to_stderr() as out:
        result = _evaluate(args)
        print(json.dumps(result), file=out, flush=True)
    return 0


def _evaluate(args) -> dict:
    from hybridtron.data_pipeline import build_dataset, prepare_data
    from hybridtron.train.build import load_for_inference
    from hybridtron.train.device import autocast_dtype
    from hybridtron.train.probes import attention_sink
    from hybridtron.train.recipe import val_loader_factory
    from hybridtron.train.trainer import evaluate

    ckpt = _checkpoint_for_inference(args)
    cfg, model, _tok, device = load_for_inference(ckpt, parse_overrides(args.overrides))
    prepare_data(cfg.data, log=_log)
    val_ds = build_dataset(cfg.data, "val")
    n = args.batches or cfg.train.eval_batches
    loss = evaluate(model, val_loader_factory(val_ds, cfg), n, device, autocast_dtype(cfg.train, device),
                    doc_mask=cfg.model.doc_mask)
    result = {"checkpoint": str(ckpt), "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
              "batches": n, "tokens": n * cfg.train.micro_batch_size * cfg.data.seq_len}
    sink = attention_sink(model, val_loader_factory(val_ds, cfg), n, device, autocast_dtype(cfg.train, device),
                          doc_mask=cfg.model.doc_mask)
    if sink:  # attention layers: mean probability on each document's first token (train/probes.py)
        result["attention_sink"] = sink
    if cfg.data.synthetic.task:  # a generated task: accuracy at the training length and at longer ones
        from hybridtron.data_pipeline.synthetic import length_accuracy

        result["accuracy"] = length_accuracy(model, cfg, n * cfg.train.micro_batch_size, device)
    return result


def cmd_sample(args) -> int:
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature:g} must be >= 0 (0 = greedy decoding)")
    bad = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("top_k", "max_new_tokens")
           if getattr(args, name) < 0]
    if bad:  # only the flags that are wrong: naming a good one beside them sent users to fix it too
        raise ConfigError(f"{' and '.join(bad)} must be >= 0")
    check_overrides(parse_overrides(args.overrides))  # before the checkpoint's config is read, and torch imported
    import torch

    from hybridtron.train.build import load_for_inference
    from hybridtron.train.sample import generate

    with _logs_to_stderr() as stdout:  # stdout: the generated text alone
        cfg, model, tok, device = load_for_inference(_checkpoint_for_inference(args),
                                                     parse_overrides(args.overrides))
        gen = torch.Generator(device=device).manual_seed(args.seed)
        # In the packed training stream every document follows the previous one's EOS, so EOS (not BOS, which
        # training never shows) is the context the model knows as "a document starts here".
        prompt = [tok.eos_id] + tok.encode(args.prompt)
        out = generate(model, prompt, args.max_new_tokens, max_seq_len=cfg.model.max_seq_len,
                       temperature=args.temperature, top_k=args.top_k, eos_id=tok.eos_id, generator=gen,
                       device=device)
        print(tok.decode(out[1:]), file=stdout, flush=True)
    return 0


def cmd_export(args) -> int:
    from hybridtron.train.checkpoint_pins import pinned
    from hybridtron.train.hf.export import export, resolve_checkpoint

    check_output_dir(Path(args.out), f"--out {args.out}", empty=True)  # first: a mistyped --out costs nothing
    if not Path(args.path).exists():
        raise CheckpointError(f"{args.path} does not exist; pass a run directory (its latest checkpoint is exported) "
                              f"or a checkpoint directory RUN_DIR/checkpoints/step_N")
    # Pinned while read: a run still training prunes its old checkpoints (checkpoint.keep_last), not this one.
    with pinned(lambda: resolve_checkpoint(Path(args.path))) as ckpt:
        _log(f"exporting {ckpt} -> {args.out}")
        export(ckpt, Path(args.out), max_shard_size=args.max_shard_size, check=not args.no_check, log=_log)
    _log(f"Hugging Face model: {Path(args.out).resolve()} (AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_plan(args) -> int:
    with _logs_to_stderr() as out:  # stdout: the tables, or with --json the JSON alone
        result = _plan(args)
        if result is not None:  # None: a rank of a measured job other than the first, which prints nothing
            text, data = result
            print(json.dumps(data) if args.json else text, file=out, flush=True)
    return 0


def _plan(args) -> tuple[str, object] | None:
    """plan's (text, JSON-able data)."""
    cfg, _ = resolve_job(args)
    check_plan_engine(cfg)
    if not args.measure:  # the cluster is --nodes x --gpus-per-node (under --measure: torchrun's processes)
        bad = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("nodes", "gpus_per_node")
               if getattr(args, name) < 1]
        if bad:
            raise ConfigError(f"{' and '.join(bad)} must be >= 1 (plan models a cluster of --nodes x "
                              f"--gpus-per-node GPUs)")
    if args.suggest or args.fit:
        return _suggest(cfg, args)
    if not args.measure:
        world = args.nodes * args.gpus_per_node
        if args.jobs < 0:
            raise ConfigError(f"--jobs {args.jobs} must be >= 0 (0: one process per core)")
        for name in ("peak_tflops", "mfu", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(args, name) > 0 or (name == "mfu" and args.mfu > 1):
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0"
                                  + (" and <= 1" if name == "mfu" else ""))
        check_plan_layout(cfg, world)  # plan_table's refusal, before train.plan (and torch) is imported
        from hybridtron.data_pipeline.prepare_tasks import node_cores
        from hybridtron.train.plan import Hardware, format_table, plan_table

        hw = Hardware(args.peak_tflops, args.mfu, args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node)
        rows = plan_table(cfg, world, args.gpu_memory_gib, hw=hw, jobs=args.jobs or node_cores())
        return format_table(cfg, rows, world, args.gpu_memory_gib), rows
    if cfg.parallel.pp > 1 and cfg.parallel.pp_schedule == "zero_bubble":
        raise ConfigError("hybridtron plan --measure cannot follow parallel.pp_schedule=zero_bubble: torch's memory "
                          "tracker fails on its split backward (autograd.grad of the inputs, then of the weights); plan "
                          "it without --measure, or measure parallel.pp_schedule=interleaved_1f1b (the same stages)")
    check_run(cfg, launch_world()[2])
    from hybridtron.train.build import select_rank_device
    from hybridtron.train.parallel.mesh import Mesh
    from hybridtron.train.plan import (
        compare,
        format_comparison,
        gather_measurements,
        measure,
        release_distributed_state,
    )

    device = select_rank_device(cfg)
    with Mesh.setup(cfg, device) as mesh:
        measured = gather_measurements(mesh, measure(cfg, mesh, device))
    release_distributed_state()
    if not mesh.is_main:
        return None
    # the prediction for this very layout, simulated in this process once the real group is gone
    result = compare(cfg, mesh.world_size, measured)
    return format_comparison(result), result


def _suggest(cfg, args) -> tuple[str, dict]:
    """plan --suggest: hyperparameters for the budget from the scaling laws (train/suggest.py)."""
    from hybridtron.train.suggest import (
        describe_fit,
        fits_from_sweeps,
        format_suggestion,
        read_sweeps,
        reference_batch,
        suggest,
    )

    p = cfg.parallel
    dp = max(1, args.nodes * args.gpus_per_node // (p.tp * p.pp * p.cp))  # only how the batch is cut
    tokens = args.tokens or cfg.train.max_steps * reference_batch(cfg)  # the config's budget, on any cluster
    if tokens <= 0:
        raise ConfigError(f"--tokens {args.tokens:g} must be > 0")
    tau_fit = routed = None
    if args.fit:
        tau_fit, routed = fits_from_sweeps(read_sweeps([Path(d) for d in args.fit]))
    import torch  # the input is checked: now the model's parameters are counted

    from hybridtron.model.lm import GatedLM

    with torch.device("meta"):  # counting only: no memory
        model = GatedLM(cfg.model, cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size))
    s = suggest(cfg, model.num_params(), model.num_active_params(), tokens, dp, tau_fit=tau_fit, tau_c=args.tau_c,
                routed=routed)
    text = format_suggestion(s)
    return (describe_fit(tau_fit, routed) + "\n" + text if args.fit else text), s


def cmd_ablate(args) -> int:
    from hybridtron.train.ablate import run_ablation  # torch-free until its configs are checked

    def probe(cfg, model):  # a finished run's attention sink, on its evaluation batches
        from hybridtron.data_pipeline import build_dataset
        from hybridtron.train.device import autocast_dtype
        from hybridtron.train.probes import attention_sink
        from hybridtron.train.recipe import val_loader_factory

        device = next(model.parameters()).device
        sink = attention_sink(model, val_loader_factory(build_dataset(cfg.data, "val"), cfg), cfg.train.eval_batches,
                              device, autocast_dtype(cfg.train, device), doc_mask=cfg.model.doc_mask)
        return {"attention_sink": sink} if sink else {}

    run_ablation(args, log=_log, probe=probe)
    return 0


def cmd_kernels(args) -> int:
    """Measure ``auto``'s choices at a preset's shapes on this GPU and print the table (kernels/tune_report.py)."""
    from hybridtron.configs import load_config

    cfg = load_config(args.config or DEFAULT_PRESET, parse_overrides(args.overrides))
    from hybridtron.atomic import write_text_atomic
    from hybridtron.kernels import tune
    from hybridtron.kernels.tune_report import markdown, measure_peaks, rows
    from hybridtron.train.device import select_device
    from hybridtron.train.kernel_choice import measure_preset

    device = select_device(cfg.train)
    if device.type != "cuda" and not args.measure_on_cpu:
        print("hybridtron kernels: auto runs the pure-torch reference on the CPU, so nothing is measured here; on a "
              "CUDA GPU this command measures attention, the delta rule and the short convolution at the preset's "
              "shapes, ours against the installed peers (sdpa, flex, flash-attn, fla, causal-conv1d)")
        return 0
    tune.configure(refresh=args.retune, devices=("cuda", "cpu") if args.measure_on_cpu else ("cuda",))
    measure_preset(cfg, device, log=_log)
    peaks = measure_peaks(device) if device.type == "cuda" else None
    table = rows(tune.decisions(), tune.shapes(), peaks)
    print(markdown(table, peaks))
    print(f"\ncache: {tune.cache_path()} (reused by every run on this machine; --retune measures again)")
    if args.json:
        write_text_atomic(Path(args.json), json.dumps({"machine": tune.fingerprint(device.type), "rows": table},
                                                      indent=1) + "\n")
    return 0


# ---- argument parsing ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "invalid choice" (a mistyped command) also names the closest choice (Python 3.14's
    suggest_on_error does the same; this runs on 3.10 and up). Subcommand parsers are of this class too."""

    def _check_value(self, action, value):
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices or ()], n=1, cutoff=0.6)
            if not close:
                raise
            raise argparse.ArgumentError(action, f"{e.message}; did you mean {close[0]!r}?") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hybridtron", description=__doc__.splitlines()[0], epilog=EXIT_CODES)
    sub = p.add_subparsers(dest="command", required=True, metavar="{prepare,train,ablate,plan,export,eval,sample,kernels,submit,status}")

    def add_subcommand(name, **kw):  # every subcommand: --debug, and the exit codes in its --help
        sp = sub.add_parser(name, epilog=EXIT_CODES, **kw)
        sp.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of one line (or HYBRIDTRON_DEBUG=1)")
        return sp

    def common(sp, with_config=True):
        if with_config:
            sp.add_argument("--config", default=None, help=f"preset name or YAML path (default: {DEFAULT_PRESET}, "
                            "or the run directory's saved config when resuming)")
        sp.add_argument("--run-dir", default=None, help="run directory (default: runs/<preset>)")

    sp = add_subcommand("prepare", help="build the tokenizer and token shards")
    common(sp)
    g = sp.add_argument_group("stages of `hybridtron submit prepare` (its jobs run these; docs/data.md)")
    g.add_argument("--stage", choices=("plan", "task"), default=None,
                   help="plan: the tokenizer and the parts' plan only; task: tokenize task K's parts of N only (the "
                        "merge is a plain prepare)")
    g.add_argument("--task", type=int, default=None, metavar="K", help="--stage task: this task's number, from 0")
    g.add_argument("--tasks", type=int, default=None, metavar="N", help="--stage task: the number of tasks")
    sp.set_defaults(func=cmd_prepare)
    sp = add_subcommand("train", help="train (resumes from the run directory's latest checkpoint)")
    common(sp)
    sp.add_argument("--init-from", default=None, metavar="hf:DIR",
                    help="start from a local Hugging Face model (Qwen3.5, Qwen3.5-MoE, Qwen3, Llama) and its tokenizer")
    sp.set_defaults(func=cmd_train)
    sp = add_subcommand("ablate", help="train variants of one preset on the same data; table + loss plot")
    common(sp)
    sp.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                    help="one variant: a name, then its overrides (repeat; 'base:' for none)")
    sp.add_argument("--variants", default=None, metavar="YAML", help="a file mapping variant names to overrides")
    sp.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                    help="train every variant once per seed (train.seed), in DIR/<variant>/seed<SEED>; the table "
                         "and plot show the mean and spread")
    sp.add_argument("--keep-checkpoints", action="store_true",
                    help="keep every checkpoint of each finished variant (default: its final one only)")
    sp.set_defaults(func=cmd_ablate)
    sp = add_subcommand("plan", help="per-GPU memory and communication of a config on a cluster shape")
    common(sp)
    sp.add_argument("--nodes", type=int, default=1)
    sp.add_argument("--gpus-per-node", type=int, default=8)
    sp.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)")
    sp.add_argument("--peak-tflops", type=float, default=989.0, help="a GPU's dense peak (default 989: H100 bf16)")
    sp.add_argument("--mfu", type=float, default=0.40, help="model-FLOPs utilization of the compute without "
                    "activation checkpointing (default 0.40, dense_1b on one H100)")
    sp.add_argument("--intra-node-gbps", type=float, default=360.0, help="GB/s a GPU sends within a node (360)")
    sp.add_argument("--inter-node-gbps", type=float, default=45.0, help="GB/s a GPU sends to other nodes (45)")
    sp.add_argument("--measure", action="store_true",
                    help="run the planned steps for real in this job's layout (under torchrun) and print the measured "
                         "peak of the rank planned heaviest beside its prediction")
    sp.add_argument("--json", action="store_true", help="print the result as one JSON object instead of tables "
                    "(stdout holds the JSON alone; log lines go to stderr)")
    sp.add_argument("--jobs", type=int, default=0, metavar="N",
                    help="processes tracing ranks at once (default 0: one per core this process may use; 1: none "
                         "forked). The same plan either way")
    sp.add_argument("--suggest", action="store_true",
                    help="learning rate, weight decay, batch size and steps for the token budget from scaling laws "
                         "(Power Lines' AdamW timescale; the routed-model law for the expert count)")
    sp.add_argument("--tokens", type=float, default=0, help="--suggest: token budget (default: the config's)")
    sp.add_argument("--tau-c", type=float, default=None, metavar="C",
                    help="--suggest: the constant c of tau_opt = c * TPP^-0.53 (default: the config as reference)")
    sp.add_argument("--fit", nargs="+", default=None, metavar="RUN_DIR",
                    help="--suggest: fit the laws' constants to these `hybridtron ablate` sweeps, and report the fit")
    sp.set_defaults(func=cmd_plan)
    sp = add_subcommand("export", help="write a Hugging Face model directory from a checkpoint")
    sp.add_argument("path", help="run directory (its latest checkpoint) or a checkpoint directory")
    sp.add_argument("--out", required=True, help="new directory for the Hugging Face model")
    sp.add_argument("--max-shard-size", default="5GB", help="safetensors shard size limit (default 5GB)")
    sp.add_argument("--no-check", action="store_true", help="skip the logit parity check against transformers")
    sp.set_defaults(func=cmd_export)
    sp = add_subcommand("eval", help="validation loss and perplexity of a checkpoint")
    common(sp, with_config=False)
    sp.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the run's latest)")
    sp.add_argument("--batches", type=int, default=0, help="validation micro-batches (default: train.eval_batches)")
    sp.set_defaults(func=cmd_eval)
    sp = add_subcommand("kernels", help="measure which kernel auto runs for each op at a preset's shapes on this GPU")
    sp.add_argument("--config", default=None, help=f"preset name or YAML path (default: {DEFAULT_PRESET})")
    sp.add_argument("--retune", action="store_true", help="measure again what the tuner's cache already knows")
    sp.add_argument("--json", default=None, metavar="FILE", help="also write the table's rows to FILE")
    sp.add_argument("--measure-on-cpu", action="store_true",
                    help="measure on the CPU too (tests; ours there runs under TRITON_INTERPRET=1, numbers mean nothing)")
    sp.set_defaults(func=cmd_kernels)
    sp = add_subcommand("sample", help="generate text from a checkpoint")
    common(sp, with_config=False)
    sp.add_argument("--checkpoint", default=None)
    sp.add_argument("--prompt", default="def ")
    sp.add_argument("--max-new-tokens", type=int, default=200)
    sp.add_argument("--temperature", type=float, default=0.8)
    sp.add_argument("--top-k", type=int, default=50)
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=cmd_sample)
    from hybridtron.slurm import status as slurm_status
    from hybridtron.slurm import submit as slurm_submit

    sp = add_subcommand("submit", help="submit a training job to SLURM (sbatch): multi-node, requeued at its time "
                        "limit; `submit prepare` tokenizes the data as SLURM tasks across nodes",
                        usage="hybridtron submit [prepare] [options] [--section.field VALUE ...]")
    common(sp)
    sp.add_argument("--what", choices=("train", "prepare"), default="train", help=argparse.SUPPRESS)
    slurm_submit.add_arguments(sp)
    sp.set_defaults(func=slurm_submit.cmd_submit)
    sp = add_subcommand("status", help="a SLURM run: job state, last step and loss, latest checkpoint, logs; or a "
                        "data directory: parts done, rates, time left")
    slurm_status.add_arguments(sp)
    sp.set_defaults(func=slurm_status.cmd_status)
    for name, sp in sub.choices.items():
        # main() tells a mistyped flag from a dotted override by these (argparse keeps no public list of them)
        sp.set_defaults(subparser=sp, flags=sorted(sp._option_string_actions),
                        takes_overrides=name not in ("export", "status"))
    return p


def _check_flags(args) -> None:
    """What parse_known_args leaves over is taken for dotted overrides; a leftover that is more likely a mistyped
    flag says so, naming the subcommand's closest flag: argparse's own error (usage, then one line) where the
    subcommand takes no overrides (`export` and `status` used to ignore an unknown flag), a ConfigError where a
    section-less ``--run-dri`` is close to a flag and is no config section."""
    from hybridtron.configs import JobConfig
    from hybridtron.configs.base import config_keys

    flags = {f.lstrip("-"): f for f in args.flags}  # compared without the dashes every flag shares
    names = [a.split("=", 1)[0] for a in args.overrides if a.startswith("-")]
    near = {n: [flags[c] for c in difflib.get_close_matches(n.lstrip("-"), flags, n=1, cutoff=0.6)] for n in names}
    if args.overrides and not args.takes_overrides:
        hint = next((f"; did you mean {c[0]}?" for c in near.values() if c), "")
        args.subparser.error(f"unrecognized arguments: {' '.join(args.overrides)}{hint}")
    for n, close in near.items():
        if close and "." not in n and n.lstrip("-") not in config_keys(JobConfig):
            raise ConfigError(f"unknown option {n}; did you mean {close[0]}? (a config override is --section.field "
                              f"VALUE)")


def _one_line(e: BaseException) -> str:
    """An error message on one line: a multi-line one (a YAML parser's, with its caret drawing) is joined."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    return "; ".join(ln.rstrip(":") for ln in lines if ln.strip("^ ")) or type(e).__name__


PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket timeout",
             "connection refused", "nccl communicator was aborted", "remote worker")


def _peer_lost(e: BaseException) -> bool:
    """Whether a collective failed because another rank is gone (gloo and NCCL say so in their messages)."""
    import torch.distributed as dist

    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistNetworkError", ())) or any(s in text for s in PEER_LOST)


# Where a process of a multi-process job that stops on its own error (a full disk, a bad input) leaves its line, in
# the job's rendezvous store: the others then fail in a collective, knowing only that the connection is gone.
FAILURE_KEY = "hybridtron/failure"
STORE_TIMEOUT_S = 5.0  # a store that no longer answers (its host is gone) costs at most this


def _default_store():
    """The process group's store while the group exists (a failed run leaves it up: Mesh.close), else None."""
    dist = sys.modules.get("torch.distributed")  # never imported here: a process that has none has no group
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    import datetime

    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return store


def _leave_for_the_others(text: str) -> None:
    """Record this process's cause for the others; the first process to stop keeps its line. Best effort: the
    process is ending on its own error, and a store that is gone changes nothing about that."""
    try:
        store = _default_store()
        if store is not None:
            store.compare_set(FAILURE_KEY, "", text)
    except Exception:  # noqa: BLE001 (any failure of a dying job's store: the line printed already says it all)
        pass


def _left_by_another() -> str | None:
    """What another process recorded before it stopped, or None. Not waited for: it records before it exits, and
    its exit is what broke this process's collective; torchrun stops this process moments later."""
    try:
        store = _default_store()
        if store is not None and store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 (the store went with the process that hosted it: the generic line then)
        pass
    return None


def whole_lines() -> None:
    """Each line leaves in one write. Under PYTHONUNBUFFERED=1 (set by many job scripts and images, and on CI's
    machine) Python writes a print's pieces separately, so the lines of ranks sharing one log or terminal could
    cut into each other (seen: rank 1's refusal inside rank 0's line). Line buffering keeps what the variable
    asks for, output at once, a line at a time."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=False, line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand and return its exit code:

    0 done; 2 bad input or state: a config, data, checkpoint or run directory that is missing, damaged or does
    not match (ConfigError, DataError, CheckpointError), or a permission denied; 3 training diverged
    (NonFiniteLossError); 4 no space left on device (DiskFullError, or ENOSPC/EDQUOT from any write); 5 a
    multi-process job lost another of its processes (a collective failed on a closed connection); 6 a hang
    (train/watchdog.py ends the process from its watch thread after naming the ranks that did not arrive); 130
    interrupted by Ctrl-C (SIGINT; ``train`` takes a first one as a request to save and stop after the step, a
    second as this).

    Those end in one line on stderr naming the file and what to do; ``--debug`` (any subcommand) or
    ``HYBRIDTRON_DEBUG=1`` re-raises them with their traceback instead. Any other exception is a bug and
    propagates with its traceback.
    """
    quiet_dependencies()  # first: before torch loads (quiet.py lists what it drops and why)
    whole_lines()
    if launched():  # a worker of torchrun: ends when its launcher dies, instead of training on as an orphan
        watch_parent()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["submit"] and argv[1:2] in (["prepare"], ["train"]):
        # `submit prepare`: a word after the subcommand, which an optional positional would take from the dotted
        # overrides' values (argparse gives it the first leftover word), so it becomes the hidden --what
        argv = ["submit", "--what", argv[1], *argv[2:]]
    args, rest = parser.parse_known_args(argv)
    debug = bool(getattr(args, "debug", False)) or "--debug" in rest or \
        os.environ.get("HYBRIDTRON_DEBUG", "").strip().lower() not in ("", "0", "false", "no")
    args.overrides = [a for a in rest if a != "--debug"]
    try:
        rank, _local, world = launch_world()
    except ConfigError:
        rank, world = 0, 1  # reported by the subcommand itself
    if world > 1:
        args.command = f"{args.command} (rank {rank}/{world})"

    def fail(code: int, text: str, cause: bool = True) -> int:
        """Print our one line; in a multi-process job, also leave it for the other processes and the launcher.
        ``cause``: the line says why the job stops, rather than pointing at another process's line."""
        line = f"hybridtron {args.command}: {text}"
        print(line, file=sys.stderr)
        if cause and world > 1:
            _leave_for_the_others(f"rank {rank} stopped: {text.removeprefix('error: ')}")
        tell_launcher(line, cause)
        return code

    try:
        _check_flags(args)
        return args.func(args)
    except DiskFullError as e:
        if debug:
            raise
        return fail(4, f"error: {_one_line(e)}")
    except (ConfigError, DataError, CheckpointError) as e:
        if debug:
            raise
        return fail(2, f"error: {_one_line(e)}", cause=not getattr(e, "relayed", False))
    except NonFiniteLossError as e:
        if debug:
            raise
        return fail(3, f"training diverged: {_one_line(e)}")
    except KeyboardInterrupt:
        if debug:
            raise
        return fail(130, "interrupted (Ctrl-C)", cause=False)
    except RuntimeError as e:
        if debug or world == 1 or not _peer_lost(e):
            raise
        first = _left_by_another()
        if first:  # that process's own line: the cause, where "lost the connection" only says it is gone
            return fail(5, f"error: {first}", cause=False)
        return fail(5, f"error: lost the connection to another process of the job ({_one_line(e)[:160]}); that "
                    f"process stopped first (the launcher's summary names it and its exit code): fix its cause, "
                    f"then run the same command to resume from the last complete checkpoint", cause=False)
    except OSError as e:
        if debug:
            raise
        where = e.filename or "a file"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            # a copy's error (shutil's sendfile) names its source first and the file it was writing second
            written = next((os.fsdecode(n) for n in (e.filename2, e.filename)
                            if isinstance(n, (str, bytes, os.PathLike)) and os.fspath(n)), None)
            return fail(4, f"error: no space left on device writing {written or 'a file'}; free space "
                        f"{f'in {Path(written).parent}' if written else 'there'}, then run the same command again")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return fail(2, f"error: {(e.strerror or 'permission denied').lower()}: {where}; fix its permissions or "
                        f"choose another path")
        raise


if __name__ == "__main__":
    sys.exit(main())
