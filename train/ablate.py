"""``hybridtron ablate``: several variants of one preset, trained on the same data for the same steps.

    hybridtron ablate --config tiny_hybrid --run-dir runs/neg_eigval \\
        --variant base: --variant neg:model.deltanet.neg_eigval=true --train.max_steps 200

Each variant is the preset plus the overrides shared by all (``--train.max_steps 200``) plus its own;
it trains in ``<run-dir>/<name>/`` like ``hybridtron train`` (so a stopped ablation resumes variant by
variant when run again). Every config is built and validated before the first step, and overrides
of ``data.*``, ``train.max_steps`` or ``train.seed`` inside a variant are refused: they would compare
runs on different data or budgets. The results go to ``<run-dir>/ablation.{md,json}`` (final train and
validation loss, tokens/s, parameters, active parameters) and ``<run-dir>/loss.png`` (the curves).

A finished variant keeps only its final checkpoint (``--keep-checkpoints`` keeps them all): an ablation of many
variants otherwise left ``checkpoint.keep_last`` full checkpoints of each, weights and optimizer state, forever.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

import yaml

from hybridtron.atomic import remove_entry, scratch_name, write_text_atomic
from hybridtron.configs import ConfigError, JobConfig, load_config, parse_overrides
from hybridtron.train import checkpoint_names
from hybridtron.train.checkpoint_pins import checkpoints_locked, pinned_steps
from hybridtron.train.parallel.layout import Layout, check_run, launch_world
from hybridtron.train.run_lock import hold_run_dir

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
SHARED_ONLY = ("data.", "train.max_steps", "train.seed")
TAIL = 10  # final train loss: mean of the last TAIL logged steps (one step's loss is noisy)
AUX_DOC = {"moe_aux_loss": "the MoE load-balance and router z-losses, with their coefficients",
           "hax_ranking_loss": "HAX's key-ranking loss, with its weight"}
WARMUP = 3  # tokens/s: median over logged steps after the first WARMUP (compilation, allocator)


def parse_variant(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``'moe:model.moe.n_experts=8,model.moe.every=2'`` -> ('moe', [('model.moe.n_experts', '8'), ...])."""
    name, sep, rest = text.partition(":")
    if not sep:
        raise ConfigError(f"--variant {text!r}: write NAME:KEY=VALUE[,KEY=VALUE...] (or NAME: for the preset as is)")
    pairs = []
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ConfigError(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        pairs.append((key.strip().removeprefix("--"), val.strip()))
    return name.strip(), pairs


def load_variants(args) -> list[tuple[str, list[tuple[str, str]]]]:
    variants = [parse_variant(v) for v in args.variant]
    if args.variants:
        path = Path(args.variants)
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--variants {path}: cannot read it as YAML ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--variants {path} must map variant names to {{key: value}} overrides")
        for name, overrides in raw.items():
            if overrides is not None and not isinstance(overrides, dict):
                raise ConfigError(f"--variants {path}: variant {name!r} must map keys to values, e.g. model.n_layers: 8")
            variants.append((str(name), [(k, v if isinstance(v, str) else json.dumps(v))
                                         for k, v in (overrides or {}).items()]))
    if len(variants) < 2:
        raise ConfigError("ablate compares variants: give at least two (--variant NAME:KEY=VALUE ... or --variants FILE)")
    names = [n for n, _ in variants]
    for name in names:
        if not NAME_RE.match(name):
            raise ConfigError(f"variant name {name!r} must be letters, digits, '_', '.', '+' or '-' (it names a directory)")
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ConfigError(f"variant name {dup!r} is used twice; each variant needs its own name")
    for name, pairs in variants:
        for key, _ in pairs:
            if key.startswith(SHARED_ONLY):
                raise ConfigError(
                    f"variant {name!r} overrides {key}: ablation variants share data, steps and seed; pass "
                    f"--{key} outside the variants to change it for all of them"
                )
    return variants


def summarize(run_dir: Path, model) -> dict:
    """The numbers of one finished variant, read from its metrics.jsonl."""
    from hybridtron.train.step import AUX_NAMES  # (imports torch: after the runs)

    by_step: dict[int, dict] = {}
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if "step" in rec:
                by_step.setdefault(rec["step"], {}).update(rec)  # a resumed run repeats steps: last wins
    steps = [by_step[s] for s in sorted(by_step)]
    losses = [(r["step"], r["loss"]) for r in steps if "loss" in r]
    vals = [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    # the training loss in its parts: the language-model loss and each auxiliary loss (train/step.py's aux_terms)
    parts = {k: [r[k] for r in steps if k in r][-TAIL:] for k in dict.fromkeys(
        k for r in steps for k in r if k == "lm_loss" or k in AUX_NAMES.values())}
    return {
        **{f"final_{k}": statistics.fmean(v) for k, v in parts.items() if v},
        "final_train_loss": statistics.fmean(v for _, v in losses[-TAIL:]) if losses else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "tokens_per_s": statistics.median(rates[WARMUP:] or rates) if rates else None,
        "params": model.num_params(),
        "active_params": model.num_active_params(),
        "steps": steps[-1]["step"] if steps else 0,
        "train_curve": losses,
        "val_curve": vals,
    }


def _tree_bytes(path: Path) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)


def keep_final_checkpoint(run: Path, log) -> None:
    """Remove a finished run's checkpoints but its final one (``latest``), which a rerun of the ablation resumes
    from to read the run back, and which `eval`, `export` or training on start from, and but one an export is
    reading (pinned: train/checkpoint_pins.py; it stays, said in the line). Each goes by a rename to a scratch
    name first: a removal cut short leaves scratch, reclaimed by the next run in that directory, never a partial
    directory that looks like a checkpoint. One that cannot be removed is named in a warning; the ablation goes on."""
    ckpts = run / "checkpoints"
    final = checkpoint_names.latest(ckpts)[0]
    if final is None:
        return
    removed, freed, pinned = 0, 0, []
    with checkpoints_locked(ckpts):  # pins are taken under it: none can appear on a checkpoint being removed
        live = pinned_steps(ckpts)
        for old in checkpoint_names.complete(ckpts):
            if old == final or old.name in live:
                pinned += [old.name] * (old != final)
                continue
            try:
                size = _tree_bytes(old)
                tmp = scratch_name(old)
                os.rename(old, tmp)
            except OSError as e:
                log(f"ablate: warning: could not remove checkpoint {old} ({(e.strerror or str(e)).lower()}); "
                    f"remove it by hand")
                continue
            if not remove_entry(tmp):
                log(f"ablate: warning: could not remove all of {tmp} (an earlier checkpoint of {run}); remove it "
                    f"by hand")
                continue
            removed, freed = removed + 1, freed + size
    if removed or pinned:
        log(f"ablate: removed {removed} earlier checkpoint{'' if removed == 1 else 's'} of {run} "
            f"({freed / 2**20:,.1f} MiB); kept the final one, {final.name}"
            + (f", and {', '.join(pinned)}, which an export is reading" if pinned else "")
            + " (--keep-checkpoints keeps them all)")


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _loss(r: dict, key: str) -> str:
    """A final loss; over several seeds its mean +- standard deviation."""
    if r.get("n_seeds", 1) > 1 and r.get(key) is not None:
        return f"{r[key]:.4f} ± {r[f'{key}_sd']:.4f}"
    return _fmt(r.get(key), ".4f")


def write_table(out: Path, preset: str, shared: list[tuple[str, str]], results: dict[str, dict],
                overrides: dict[str, list]) -> None:
    from hybridtron.train.step import AUX_NAMES  # (imports torch: after the runs)

    aux = [k for k in AUX_NAMES.values() if any(f"final_{k}" in r for r in results.values())]
    aux_note = "".join(f"{k}: {AUX_DOC[k]}; " for k in aux)
    lines = [
        f"# Ablation of `{preset}`" + (f" with {' '.join(f'--{k} {v}' for k, v in shared)}" if shared else ""),
        "",
        f"Final train losses: mean over the last {TAIL} logged steps; LM loss: the language-model "
        f"(cross-entropy) loss; {aux_note}total: what was minimised, LM plus the auxiliary losses; tokens/s: "
        f"median over logged steps after the first {WARMUP}."
        + (f" Over {next(iter(results.values()))['n_seeds']} seeds (train.seed): mean ± standard deviation."
           if any(r.get("n_seeds", 1) > 1 for r in results.values()) else ""),
        "",
        "| variant | overrides | steps | train LM loss | " + "".join(f"{k} | " for k in aux)
        + "train total | val loss | tokens/s | params | active params |",
        "|---|---|---:|---:|" + "---:|" * len(aux) + "---:|---:|---:|---:|---:|",
    ]
    acc = any("accuracy" in r for r in results.values())  # synthetic tasks: accuracy at each evaluated length
    if acc:
        lines[-2:] = [lines[-2] + " accuracy (length: acc) |", lines[-1] + "---|"]
    sink = any(r.get("attention_sink") for r in results.values())  # attention layers: mean prob. on first token
    if sink:
        lines[-2:] = [lines[-2] + " attention sink (layer: prob) |", lines[-1] + "---|"]
    for name, r in results.items():
        ov = ", ".join(f"{k}={v}" for k, v in overrides[name]) or "(preset)"
        lines.append(
            f"| {name} | {ov} | {r['steps']} | {_loss(r, 'final_lm_loss')} | "
            + "".join(f"{_loss(r, f'final_{k}')} | " for k in aux)
            + f"{_loss(r, 'final_train_loss')} | {_loss(r, 'final_val_loss')} "
            f"| {_fmt(r['tokens_per_s'], ',.0f')} | {r['params'] / 1e6:.3f}M | {r['active_params'] / 1e6:.3f}M |"
            + (" " + ", ".join(f"{a['length']}: {_fmt(a['accuracy'], '.3f')}" for a in r.get("accuracy", [])) + " |"
               if acc else "")
            + (" " + ", ".join(f"{k.removeprefix('layers.')}: {v:.3f}" for k, v in (r.get("attention_sink") or {}).items())
               + " |" if sink else "")
        )
    write_text_atomic(out / "ablation.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "ablation.json", json.dumps(
        {"preset": preset, "shared_overrides": shared,
         "variants": {n: {"overrides": overrides[n], **r} for n, r in results.items()}}, indent=1))


def plot(out: Path, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, r) in enumerate(results.items()):
        color = f"C{i}"
        if r["train_curve"]:
            s, v = zip(*r["train_curve"], strict=True)
            ax.plot(s, v, color=color, alpha=0.8, label=f"{name} train" + (" (mean)" if r.get("n_seeds", 1) > 1 else ""))
            if r.get("n_seeds", 1) > 1 and r.get("train_band"):  # the seeds' spread
                s, lo, hi = zip(*r["train_band"], strict=True)
                ax.fill_between(s, lo, hi, color=color, alpha=0.2)
        if r["val_curve"]:
            s, v = zip(*r["val_curve"], strict=True)
            ax.plot(s, v, "o--", color=color, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out / ".loss.png.tmp"
    fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    os.replace(tmp, out / "loss.png")


def _mean_sd(values: list) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def _mean_curve(curves: list[list]) -> tuple[list, list]:
    """Steps every seed logged -> (step, mean) and (step, min, max) over the seeds."""
    by_step: dict[int, list[float]] = {}
    for c in curves:
        for s, v in c:
            by_step.setdefault(s, []).append(v)
    steps = [s for s in sorted(by_step) if len(by_step[s]) == len(curves)]
    return ([(s, statistics.fmean(by_step[s])) for s in steps],
            [(s, min(by_step[s]), max(by_step[s])) for s in steps])


def aggregate(per_seed: dict[int, dict]) -> dict:
    """One variant's runs over seeds: means (and standard deviations) of the final numbers, mean curves with
    the seeds' min-max band, mean accuracy per length and attention sink per layer; each seed's own results."""
    from hybridtron.train.step import AUX_NAMES  # (imports torch: after the runs)

    runs = list(per_seed.values())
    first = runs[0]
    out = {"seeds": {str(k): {key: v for key, v in r.items() if not key.endswith("_curve")}
                     for k, r in per_seed.items()},
           "n_seeds": len(runs), "steps": first["steps"], "params": first["params"],
           "active_params": first["active_params"]}
    parts = [f"final_{k}" for k in ("lm_loss", *AUX_NAMES.values()) if any(f"final_{k}" in r for r in runs)]
    for key in (*parts, "final_train_loss", "final_val_loss", "tokens_per_s"):
        out[key], out[f"{key}_sd"] = _mean_sd([r.get(key) for r in runs])
    out["train_curve"], out["train_band"] = _mean_curve([r["train_curve"] for r in runs])
    out["val_curve"], out["val_band"] = _mean_curve([r["val_curve"] for r in runs])
    if all("accuracy" in r for r in runs):
        out["accuracy"] = [{"length": a["length"], "accuracy": statistics.fmean(r["accuracy"][i]["accuracy"]
                                                                               for r in runs)}
                           for i, a in enumerate(first["accuracy"])]
    if all(r.get("attention_sink") for r in runs):
        out["attention_sink"] = {layer: statistics.fmean(r["attention_sink"][layer] for r in runs)
                                 for layer in first["attention_sink"]}
    return out


def run_ablation(args, log, probe=None) -> dict[str, dict] | None:
    """Every variant (for every seed of ``--seeds``) trained in turn, then the table and the plot. A run that
    stops early (SIGTERM, SLURM's preemption or time-limit warning, train.exit_interval) stops the whole
    ablation after its checkpoint; the same command resumes it: finished runs are read back, the stopped one
    continues. ``probe(cfg, model)``: extra evaluation numbers of a finished run (the attention sink)."""
    preset = args.config or "tiny"
    shared = parse_overrides(args.overrides)
    variants = load_variants(args)
    seeds = list(getattr(args, "seeds", None) or [])
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))} repeats a seed; give distinct seeds")
    if seeds and any(k == "train.seed" for k, _ in shared):
        raise ConfigError("--seeds and --train.seed both set the seed; give one of them")
    configs: dict[str, dict[int | None, JobConfig]] = {}
    world = launch_world()[2]
    # Every config and its layout checked before the first step of the first variant: torch-free first (check_run,
    # where the device does not decide), then with the device in hand (what each variant's run checks again), so
    # that a refusal only this machine's GPU can give (its FP8 support) does not wait for an earlier variant's run.
    for check in (check_run, Layout.from_config):
        for name, pairs in variants:
            try:
                configs[name] = configs.get(name) or {
                    s: load_config(preset, shared + pairs + ([("train.seed", str(s))] if s is not None else []))
                    for s in (seeds or [None])}
                for cfg in configs[name].values():
                    check(cfg, world)
            except ConfigError as e:
                raise ConfigError(f"variant {name!r}: {e}") from None
    out = Path(args.run_dir) if args.run_dir else Path("runs") / f"ablate_{Path(preset).stem}"
    # The ablation directory's own lock: a second ablation into it is refused at once, not after it has resumed
    # the variants the first one finished. Each variant's train_run locks its own directory besides. Under
    # torchrun only rank 0 locks here; if it is refused, torchrun stops the other ranks. The lock creates the
    # directory, and removes it again if it ends holding nothing (an ablation stopped on bad input).
    from hybridtron.train.recipe import train_run  # (torch and the trainer: the configs are good)

    is_main = os.environ.get("RANK", "0") == "0"
    with hold_run_dir(out, is_main=is_main, what=f"--run-dir {out} (an ablation)"):
        out.mkdir(parents=True, exist_ok=True)  # the other ranks of a multi-process ablation
        results = {}
        total, done = len(configs) * max(1, len(seeds)), 0
        for name, by_seed in configs.items():
            per_seed = {}
            for seed, cfg in by_seed.items():
                done += 1
                run = out / name if seed is None else out / name / f"seed{seed}"
                log(f"ablate: variant {name}" + (f", seed {seed}" if seed is not None else "") + f" ({done}/{total})")
                result, model = train_run(cfg, run, log=log)
                if result.stopped_by != "max_steps":
                    write_text_atomic(out / "last_stop.json", json.dumps(
                        {"stopped_by": result.stopped_by, "variant": name, "seed": seed, "step": result.state.step}))
                    log(f"ablate: stopped during variant {name}" + (f", seed {seed}" if seed is not None else "") +
                        f" at step {result.state.step} ({result.stopped_by}); run the same command again to resume "
                        f"the ablation")
                    return None
                if is_main and not getattr(args, "keep_checkpoints", False):
                    keep_final_checkpoint(run, log)
                r = summarize(run, model)
                if cfg.data.synthetic.task:  # a generated task: accuracy by length (data_pipeline/synthetic.py)
                    from hybridtron.data_pipeline.synthetic import length_accuracy

                    r["accuracy"] = length_accuracy(model, cfg, cfg.train.eval_batches * cfg.train.micro_batch_size,
                                                    next(model.parameters()).device)
                if probe is not None:
                    r.update(probe(cfg, model))
                per_seed[seed] = r
            results[name] = aggregate(per_seed) if seeds else per_seed[None]
        overrides = dict(variants)
        write_table(out, preset, shared, results, overrides)
        plot(out, results)
        write_text_atomic(out / "last_stop.json", json.dumps({"stopped_by": "max_steps", "variants": len(configs)}))
        log(f"ablation table: {(out / 'ablation.md').resolve()}")
        log(f"loss curves:    {(out / 'loss.png').resolve()}")
        print((out / "ablation.md").read_text())
        return results
