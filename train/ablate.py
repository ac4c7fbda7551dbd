"""``hybridtron ablate``: several variants of one preset, trained on the same data for the same steps.

    hybridtron ablate --config tiny_hybrid --run-dir runs/neg_eigval \\
        --variant base: --variant neg:model.deltanet.neg_eigval=true --train.max_steps 200

Each variant is the preset plus the overrides shared by all (``--train.max_steps 200``) plus its own;
it trains in ``<run-dir>/<name>/`` like ``hybridtron train`` (so a stopped ablation resumes variant by
variant when run again). Every config is built and validated before the first step, and overrides
of ``data.*``, ``train.max_steps`` or ``train.seed`` inside a variant are refused: they would compare
runs on different data or budgets. The results go to ``<run-dir>/ablation.{md,json}`` (final train and
validation loss, tokens/s, parameters, active parameters) and ``<run-dir>/loss.png`` (the curves).
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

import yaml

from hybridtron.configs import ConfigError, JobConfig, load_config, parse_overrides
from hybridtron.data_pipeline.atomic import write_text_atomic

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
SHARED_ONLY = ("data.", "train.max_steps", "train.seed")
TAIL = 10  # final train loss: mean of the last TAIL logged steps (one step's loss is noisy)
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
    return {
        "final_train_loss": statistics.fmean(v for _, v in losses[-TAIL:]) if losses else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "tokens_per_s": statistics.median(rates[WARMUP:] or rates) if rates else None,
        "params": model.num_params(),
        "active_params": model.num_active_params(),
        "steps": steps[-1]["step"] if steps else 0,
        "train_curve": losses,
        "val_curve": vals,
    }


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def write_table(out: Path, preset: str, shared: list[tuple[str, str]], results: dict[str, dict],
                overrides: dict[str, list]) -> None:
    lines = [
        f"# Ablation of `{preset}`" + (f" with {' '.join(f'--{k} {v}' for k, v in shared)}" if shared else ""),
        "",
        f"Final train loss: mean over the last {TAIL} logged steps; tokens/s: median over logged steps after "
        f"the first {WARMUP}.",
        "",
        "| variant | overrides | steps | train loss | val loss | tokens/s | params | active params |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    acc = any("accuracy" in r for r in results.values())  # synthetic tasks: accuracy at each evaluated length
    if acc:
        lines[-2:] = [lines[-2] + " accuracy (length: acc) |", lines[-1] + "---|"]
    for name, r in results.items():
        ov = ", ".join(f"{k}={v}" for k, v in overrides[name]) or "(preset)"
        lines.append(
            f"| {name} | {ov} | {r['steps']} | {_fmt(r['final_train_loss'], '.4f')} | {_fmt(r['final_val_loss'], '.4f')} "
            f"| {_fmt(r['tokens_per_s'], ',.0f')} | {r['params'] / 1e6:.3f}M | {r['active_params'] / 1e6:.3f}M |"
            + (" " + ", ".join(f"{a['length']}: {_fmt(a['accuracy'], '.3f')}" for a in r.get("accuracy", [])) + " |"
               if acc else "")
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
            ax.plot(s, v, color=color, alpha=0.8, label=f"{name} train")
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


def run_ablation(args, train_run, log) -> dict[str, dict]:
    preset = args.config or "tiny"
    shared = parse_overrides(args.overrides)
    variants = load_variants(args)
    configs: dict[str, JobConfig] = {}
    for name, pairs in variants:  # every config validated before the first step of the first variant
        try:
            configs[name] = load_config(preset, shared + pairs)
        except ConfigError as e:
            raise ConfigError(f"variant {name!r}: {e}") from None
    out = Path(args.run_dir) if args.run_dir else Path("runs") / f"ablate_{Path(preset).stem}"
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, cfg in configs.items():
        log(f"ablate: variant {name} ({len(results) + 1}/{len(configs)})")
        _result, model = train_run(cfg, out / name, log=log)
        results[name] = summarize(out / name, model)
        if cfg.data.synthetic.task:  # a generated task: accuracy by length (data_pipeline/synthetic.py)
            from hybridtron.data_pipeline.synthetic import length_accuracy

            results[name]["accuracy"] = length_accuracy(model, cfg, cfg.train.eval_batches * cfg.train.micro_batch_size,
                                                        next(model.parameters()).device)
    overrides = dict(variants)
    write_table(out, preset, shared, results, overrides)
    plot(out, results)
    log(f"ablation table: {(out / 'ablation.md').resolve()}")
    log(f"loss curves:    {(out / 'loss.png').resolve()}")
    print((out / "ablation.md").read_text())
    return results
