"""End-to-end training of one preset under each data-parallel engine: tokens/s, MFU, peak memory, final loss.

    python -m hybridtron.bench.bench_train --append                      # dense_1b: DDP, FSDP2 ZeRO-2/3, DeepSpeed ZeRO-1/2/3
    python -m hybridtron.bench.bench_train --preset hybrid_1b --variants ddp fsdp2_zero3 --append
    python -m hybridtron.bench.bench_train --variants ddp ddp_compile:train.compile=true --extra train.activation_checkpointing=false
    python -m hybridtron.bench.bench_train --prepare-only                # only tokenizer + shards (one ~30 s step)

Variants (``--variants``, default all six of ``VARIANTS``): ``ddp`` (torch engine, ZeRO 0), ``fsdp2_zero2`` and
``fsdp2_zero3`` (torch engine, FSDP2), ``ds_zero1``, ``ds_zero2`` and ``ds_zero3`` (DeepSpeed); ``ds_zero0`` on
request; or ``NAME:KEY=VALUE[,KEY=VALUE]`` for a variant of your own (the preset plus those overrides, the syntax of
``hybridtron ablate --variant``).

What runs: each variant is the real command line in its own process, ``torchrun --standalone --nproc-per-node N -m
hybridtron.cli train --config PRESET --run-dir DIR`` with ``--warmup`` + ``--steps`` optimizer steps, no
periodic evaluation (the trainer always evaluates once after the last step, on ``train.eval_batches`` = 1 batch,
after that step's time was taken), no checkpoint, the learning-rate warm-up cut to the bench's warm-up steps, and
``--extra KEY=VALUE`` overrides on top. A variant that fails or outlives ``--timeout`` becomes a row saying why
(its error line, from the end of its stderr); the others still run. ``--budget-s`` caps the whole bench, prepare
included (a command's time limit): a variant is given what is left, and those with nothing left are listed as not
run, so the table is always printed (and appended) in time.

Data: the variants share one prepared directory under ``--work-dir``, made once by ``hybridtron prepare`` (the
project's own pipeline) from this interpreter's standard library with the preset's tokenizer settings (a 32000-id
byte-level BPE trains on it: ~1.8 k files, 7.9 M tokens), and reused by later runs with the same data settings.

Measured, from the run directory's ``metrics.jsonl`` (rank 0, one line per step):

- tokens/s: the median of ``tokens_per_s`` over the timed steps (those after ``--warmup``): global tokens of a step
  (micro-batch x sequence x accumulation x processes) over its wall time, synchronised on CUDA;
- MFU: the median of the trainer's ``mfu`` over the same steps, per GPU (the trainer divides the global token rate
  by the peak of all its devices together); its FLOPs count the model's forward and
  backward once (no recomputation for activation checkpointing) against ``train.peak_flops`` or the trainer's table
  of bf16 peaks (an H100 SXM: 989 TFLOP/s); "-" where the trainer reports none (the CPU, an unknown GPU);
- peak GPU memory: rank 0's ``torch.cuda.max_memory_allocated`` over the whole run (``peak_mem_gib``); "-" on the
  CPU (the trainer's figure there is the process's peak RSS, not comparable);
- final loss: the training loss of the last step.

One process (``--nproc 1``, the default): the torch engine wraps nothing when there is a single data-parallel rank
(no DDP, no FSDP2: ``apply_data_parallel`` returns the model), so ``ddp``, ``fsdp2_zero2`` and ``fsdp2_zero3`` then
time the same plain model; DeepSpeed runs its ZeRO engine (partitioning, hooks, its optimizer wrapper) even on one
rank. The table says so under it.

On the CPU (``--device cpu``, or auto without CUDA) the script runs for its test at tiny sizes on gloo; the numbers
mean nothing there and the header says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybridtron.bench.report import RESULTS, append_results, device_name

# name -> overrides: the data-parallel engines the trainer offers
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "ddp": [("parallel.engine", "torch"), ("parallel.zero_stage", "0")],
    "fsdp2_zero2": [("parallel.engine", "torch"), ("parallel.zero_stage", "2")],
    "fsdp2_zero3": [("parallel.engine", "torch"), ("parallel.zero_stage", "3")],
    "ds_zero0": [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "0"), ("train.compile", "false")],
    "ds_zero1": [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "1"), ("train.compile", "false")],
    "ds_zero2": [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "2"), ("train.compile", "false")],
    "ds_zero3": [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "3"), ("train.compile", "false")],
}
DEFAULT_VARIANTS = ["ddp", "fsdp2_zero2", "fsdp2_zero3", "ds_zero1", "ds_zero2", "ds_zero3"]
_KILL_GRACE_S = 10.0


@dataclass
class Row:
    variant: str
    engine: str
    zero: str
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    final_loss: float | None = None
    wall_s: float | None = None
    note: str = ""
    checkpointing: str = ""  # the variant's train.activation_checkpointing ("" where its config did not load)

    @property
    def ok(self) -> bool:
        return self.tokens_per_s is not None


# ---- variants and overrides -------------------------------------------------------------------------------------
def parse_variants(specs: list[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """Names of ``VARIANTS`` or ``NAME:KEY=VALUE[,KEY=VALUE]`` -> [(name, overrides)]."""
    from hybridtron.train.ablate import NAME_RE, parse_variant

    out = []
    for spec in specs:
        if ":" in spec:
            name, pairs = parse_variant(spec)
        elif spec in VARIANTS:
            name, pairs = spec, VARIANTS[spec]
        else:
            raise SystemExit(f"bench_train: unknown variant {spec!r}; use one of {', '.join(VARIANTS)} "
                             f"or NAME:KEY=VALUE[,KEY=VALUE]")
        if not NAME_RE.match(name) or name in [n for n, _ in out]:
            raise SystemExit(f"bench_train: variant name {name!r} is not a fresh name of letters, digits, '_.+-'")
        out.append((name, pairs))
    return out


def parse_extra(items: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"bench_train: --extra {item!r} is not KEY=VALUE")
        pairs.append((key.strip().removeprefix("--"), val))
    return pairs


def run_overrides(args, device: str) -> list[tuple[str, str]]:
    """The overrides every variant (and prepare) gets: steps, no periodic eval, no checkpoint, sizes, device."""
    steps = args.warmup + args.steps
    over = [("train.max_steps", str(steps)), ("train.warmup_steps", str(args.warmup)),
            ("train.eval_every", "0"), ("train.eval_batches", "1"), ("train.log_every", "1"),
            ("train.progress_bar", "false"), ("checkpoint.every", "0"), ("checkpoint.at_exit", "false"),
            ("train.device", device)]
    if args.seq:
        over += [("data.seq_len", str(args.seq))]
    if args.micro_batch:
        over += [("train.micro_batch_size", str(args.micro_batch))]
    if args.accum:
        over += [("train.grad_accum_steps", str(args.accum))]
    if args.vocab:
        over += [("data.tokenizer.vocab_size", str(args.vocab))]
    if args.device_peak_flops:
        over += [("train.peak_flops", str(args.device_peak_flops))]
    return over + parse_extra(args.extra)


def with_rotary_room(preset: str, overrides: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A ``--seq`` above the preset's rotary table raises model.max_seq_len with it (unless an override sets it)."""
    from hybridtron.configs import load_config

    seq = next((int(v) for k, v in reversed(overrides) if k == "data.seq_len"), 0)
    if not seq or any(k == "model.max_seq_len" for k, _ in overrides):
        return overrides
    table = load_config(preset, [o for o in overrides if o[0] != "data.seq_len"]).model.max_seq_len
    return overrides + [("model.max_seq_len", str(seq))] if seq > table else overrides


def data_dir(work_dir: Path, cfg) -> Path:
    """The corpus's own directory (data_pipeline/data_dir.py), under the work directory."""
    from hybridtron.data_pipeline.data_dir import default_data_dir

    return default_data_dir(cfg.data, root=work_dir / "data")


def as_flags(overrides: list[tuple[str, str]]) -> list[str]:
    return [f"--{k}={v}" for k, v in overrides]


# ---- processes --------------------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc; torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process it started (a worker left behind would hold the GPU)."""
    for pid in [*_children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def run_logged(cmd: list[str], log_stem: Path, timeout: float) -> tuple[int | None, float]:
    """Run ``cmd`` with stdout/stderr to ``log_stem``.out/.err; (exit code or None if it timed out, wall seconds)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)  # a bench started under torchrun must not hand its rendezvous to the variants
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(f"{log_stem}.out", "w") as out, open(f"{log_stem}.err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = None
    return rc, time.perf_counter() - t0


_ERROR_LINE = re.compile(r"^hybridtron \S.*?: (error|training diverged)\b|^[\w.]*(Error|Exception)\b(:|$)")
_NOISE = re.compile(r"ChildFailedError|^[\s=\-_*#]*$|^\s*(warnings\.warn|File \")")


def failure_reason(stderr: str, limit: int = 300) -> str:
    """The line that says why a run failed: the trainer's one-line error or a traceback's last line (not the
    launcher's summary after it), else the last few lines of stderr."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not _NOISE.search(ln)]
    hits = [ln for ln in lines if _ERROR_LINE.search(ln)]
    text = hits[-1] if hits else " / ".join(lines[-3:])
    return text[:limit] + ("..." if len(text) > limit else "")


def tail(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")[-20000:]
    except OSError:
        return ""


# ---- one variant ------------------------------------------------------------------------------------------------
def engine_of(pairs: list[tuple[str, str]]) -> tuple[str, str]:
    d = dict(pairs)
    return d.get("parallel.engine", "torch"), d.get("parallel.zero_stage", "0")


def summarize(records: list[dict], warmup: int, steps: int, device: str) -> dict:
    """Medians over the timed steps of ``metrics.jsonl``'s records; raises ValueError when some are missing."""
    by_step = {r["step"]: r for r in records if isinstance(r.get("step"), int)}
    timed = [by_step[s] for s in range(warmup + 1, warmup + steps + 1) if s in by_step]
    if len(timed) < steps:
        raise ValueError(f"metrics.jsonl has {len(timed)} of the {steps} timed steps")
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    last = by_step[max(by_step)]
    peaks = [r["peak_mem_gib"] for r in by_step.values() if r.get("peak_mem_gib") is not None]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(mfus) if len(mfus) == len(timed) else None,
        "peak_gib": max(peaks) if peaks and device == "cuda" else None,
        "final_loss": last["loss"] if last.get("loss") is not None else float("nan"),
    }


def deepspeed_missing(pairs: list[tuple[str, str]]) -> bool:
    return engine_of(pairs)[0] == "deepspeed" and importlib.util.find_spec("deepspeed") is None


def run_variant(name: str, pairs: list[tuple[str, str]], args, shared: list[tuple[str, str]], root: Path,
                device: str, timeout: float) -> Row:
    """One variant under torchrun in ``root/name``, read back from its metrics.jsonl; a failure is a row too."""
    row = Row(name, *engine_of(shared + pairs))
    if deepspeed_missing(shared + pairs):
        row.note = "not run: deepspeed is not installed"
        return row
    run_dir = root / name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run: never resume an earlier bench's state
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "hybridtron.cli", "train", "--config", args.preset, "--run-dir", str(run_dir),
           *as_flags(shared + pairs)]
    print(f"[bench_train] {name}: {shlex.join(cmd)}", flush=True)
    rc, row.wall_s = run_logged(cmd, root / name, timeout)
    stats, why = None, ""
    try:
        from hybridtron.train.metrics import read_metrics

        stats = summarize(read_metrics(run_dir), args.warmup, args.steps, device)
    except (OSError, ValueError, KeyError) as e:
        why = f"{type(e).__name__}: {e}" if not isinstance(e, FileNotFoundError) else "no metrics.jsonl"
    if rc is None:
        row.note = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        row.note = f"exit {rc}: {failure_reason(tail(Path(f'{root / name}.err')))}"
    if stats is not None and rc is not None:  # numbers, even with a crash after the last step (noted)
        for k, v in stats.items():
            setattr(row, k, v)
        if not math.isfinite(row.final_loss):
            row.note = (row.note + "; " if row.note else "") + "non-finite final loss"
    elif not row.note:
        row.note = f"no result: {why}"
    return row


# ---- data -------------------------------------------------------------------------------------------------------
def prepare(args, shared: list[tuple[str, str]], work_dir: Path, timeout: float) -> None:
    """``hybridtron prepare`` with the variants' own settings (idempotent: a prepared directory is only checked)."""
    cmd = [sys.executable, "-m", "hybridtron.cli", "prepare", "--config", args.preset, *as_flags(shared)]
    print(f"[bench_train] prepare: {shlex.join(cmd)}", flush=True)
    rc, wall = run_logged(cmd, work_dir / "logs" / "prepare", timeout)
    if rc != 0:
        why = "timed out" if rc is None else failure_reason(tail(work_dir / "logs" / "prepare.err"))
        raise SystemExit(f"bench_train: prepare failed ({why}); log: {work_dir / 'logs' / 'prepare.err'}")
    print(f"[bench_train] data ready in {wall:.0f} s", flush=True)


# ---- report -----------------------------------------------------------------------------------------------------
def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row]) -> str:
    lines = ["| variant | engine | ZeRO | tokens/s | MFU | peak GPU memory (GiB) | final loss | wall s | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "-"
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "-"
        peak = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "-"
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
        wall = f"{r.wall_s:.0f}" if r.wall_s is not None else "-"
        lines.append(f"| {r.variant} | {r.engine} | {r.zero} | {tps} | {mfu} | {peak} | {loss} | {wall} | "
                     f"{_md(r.note)} |")
    return "\n".join(lines)


# The MFU targets of the issues that own the presets, by activation checkpointing: (off, on); None: no target.
# dense_1b as configured (issue 22), hybrid_1b without recompute (issue 20), hybrid_moe without and with (issue 21).
PRESET_TARGETS = {"dense_1b": (0.55, None), "hybrid_1b": (0.40, None), "hybrid_moe": (0.30, 0.25)}


def target_for(preset: str, checkpointing: str, target_mfu: float | None) -> float | None:
    """--target-mfu where given, else the preset's target for the row's checkpointing mode (none or another)."""
    if target_mfu:
        return target_mfu
    off, on = PRESET_TARGETS.get(Path(preset).stem, (None, None))
    return off if checkpointing == "none" else on if checkpointing else None


def notes(rows: list[Row], nproc: int, target_mfu: float | None, preset: str = "") -> list[str]:
    out = []
    if nproc == 1 and sum(r.engine == "torch" for r in rows) > 1:
        out.append("- One process: the torch engine wraps neither DDP nor FSDP2 with a single data-parallel rank, so "
                   "its rows time the same plain model (their spread is run-to-run noise); DeepSpeed runs its ZeRO "
                   "engine even on one rank.")
    for r in rows:
        target = target_for(preset, r.checkpointing, target_mfu)
        if r.mfu is None or target is None:
            continue
        met = "met" if r.mfu >= target else "NOT met"
        out.append(f"- {r.variant} (activation checkpointing {r.checkpointing or '?'}): MFU {100 * r.mfu:.1f}%; "
                   f"target >= {100 * target:.0f}%: {met}.")
    return out


def header(args, cfg, device: str) -> str:
    import torch

    t, d = cfg.train, cfg.data
    tokens = t.micro_batch_size * t.grad_accum_steps * d.seq_len * args.nproc
    ds = importlib.util.find_spec("deepspeed") is not None
    versions = f"torch {torch.__version__}" + (f", deepspeed {_version('deepspeed')}" if ds else ", no deepspeed")
    vocab = f"{d.tokenizer.kind} {d.tokenizer.vocab_size} ids" + (" (--vocab: not the preset's)" if args.vocab else "")
    src = "this Python's stdlib" if [s.path for s in d.sources] == ["stdlib"] else "data.sources as overridden"
    return (f"End-to-end training, {args.preset}, {device_name(device)}, {time.strftime('%Y-%m-%d')} ({versions}; "
            f"{args.nproc} process{'es' if args.nproc > 1 else ''}; seq {d.seq_len} x micro-batch "
            f"{t.micro_batch_size} x accumulation {t.grad_accum_steps} = {tokens:,} tokens/step; "
            f"{args.warmup} warm-up + {args.steps} timed steps; {vocab} on {src}; "
            f"activation checkpointing {t.activation_checkpointing}, "
            f"compile {'on' if t.compile else 'off'})")


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "?"


# ---- main -------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dense_1b", help="config preset or YAML (default dense_1b)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    help=f"any of {', '.join(VARIANTS)}, or NAME:KEY=VALUE[,KEY=VALUE] (default: "
                         f"{' '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per variant (default 1)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--seq", type=int, default=0, help="data.seq_len (default: the preset's)")
    ap.add_argument("--micro-batch", type=int, default=0, help="train.micro_batch_size (default: the preset's)")
    ap.add_argument("--accum", type=int, default=0, help="train.grad_accum_steps (default: the preset's)")
    ap.add_argument("--vocab", type=int, default=0, help="data.tokenizer.vocab_size (default: the preset's)")
    ap.add_argument("--device-peak-flops", type=float, default=0.0,
                    help="train.peak_flops: the per-device peak for MFU (default: the trainer's table)")
    ap.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every variant")
    ap.add_argument("--work-dir", default="runs/bench_train", help="data and run directories (default runs/bench_train)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per variant (default 600)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="seconds for the whole bench, prepare included (0: no limit): each variant gets at most "
                         "what is left, and one with under 30 s left is listed as not run")
    ap.add_argument("--target-mfu", type=float, default=None,
                    help="MFU to report met / not met for every variant (default: the preset's issue targets: "
                         "dense_1b 0.55; hybrid_1b 0.40 without activation checkpointing; hybrid_moe 0.30 "
                         "without, 0.25 with it)")
    ap.add_argument("--prepare-only", action="store_true", help="prepare the data and stop")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write the rows, and each run's kernel choices (its kernels.json), to FILE")
    ap.add_argument("--append", nargs="?", const=str(RESULTS), default=None, metavar="PATH",
                    help=f"append the table to PATH (default {RESULTS})")
    return ap


def main(argv: list[str] | None = None) -> list[Row]:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1:
        ap.error("--steps must be >= 1, --warmup >= 0 and --nproc >= 1")
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device is visible; use --device cpu (which only exercises the script)")
    work_dir = Path(args.work_dir).resolve()
    from hybridtron.configs import ConfigError, load_config

    try:
        variants = parse_variants(args.variants)
        overrides = with_rotary_room(args.preset, run_overrides(args, device))
        overrides.append(("data.out_dir", str(data_dir(work_dir, load_config(args.preset, overrides)))))
        cfg = load_config(args.preset, overrides)
    except ConfigError as e:
        raise SystemExit(f"bench_train: {e}") from None
    t0 = time.perf_counter()
    prepare(args, overrides, work_dir, min(args.timeout, args.budget_s or args.timeout))
    if args.prepare_only:
        return []
    root = work_dir / "runs" / Path(args.preset).stem
    rows = []
    for name, pairs in variants:
        left = args.budget_s - (time.perf_counter() - t0) if args.budget_s else args.timeout
        if args.budget_s and left < 30:
            rows.append(Row(name, *engine_of(overrides + pairs), note="not run: --budget-s spent"))
            continue
        row = run_variant(name, pairs, args, overrides, root, device, min(args.timeout, left))
        try:
            row.checkpointing = load_config(args.preset, overrides + pairs).train.activation_checkpointing
        except ConfigError:
            pass  # its run failed on it too: the row says why
        rows.append(row)
        print(f"[bench_train] {name}: " + (f"{row.tokens_per_s:,.0f} tokens/s" if row.ok else "failed")
              + (f" ({row.note})" if row.note else "") + f", {row.wall_s or 0:.0f} s", flush=True)
    head = header(args, cfg, device)
    lines = notes(rows, args.nproc, args.target_mfu, args.preset)
    body = table(rows) + ("\n\n" + "\n".join(lines) if lines else "")
    print(head)
    print(body)
    if args.json:
        choices = {}
        for name, _ in variants:
            f = root / name / "kernels.json"
            if f.is_file():
                choices[name] = {k: d["chosen"] for k, d in json.loads(f.read_text())["decisions"].items()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"preset": args.preset, "device": device, "rows": [
            dataclasses.asdict(r) for r in rows], "kernel_choices": choices}, indent=1) + "\n")
    if args.append:
        cmd = "python -m hybridtron.bench.bench_train " + shlex.join(sys.argv[1:] if argv is None else argv)
        append_results(Path(args.append), head, cmd, body)
        print(f"appended to {args.append}")
    return rows


if __name__ == "__main__":
    main()
