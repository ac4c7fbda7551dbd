"""Training throughput of our model against transformers' Qwen3.5 at the same configuration, side by side.

    python -m hybridtron.bench.bench_hf --append          # hybrid_1b on the GPU, appended to RESULTS.md
    python -m hybridtron.bench.bench_hf --layers 4 --seq 2048 --batch 2 --steps 5 --repeats 2
    python -m hybridtron.bench.bench_hf --device cpu --set model.d_model=64 ...   # the tests' tiny run

The target (the issue): the ``hybrid_1b`` preset at least 2x the tokens/s of transformers' Qwen3.5 text
model, with flash-linear-attention's kernels installed, training the same configuration.

The two models:

- ours: ``GatedLM`` built as ``hybridtron train`` builds it (``train/build.build_model``, then ``parallelize``: activation
  checkpointing and ``torch.compile`` of each block as asked, the preset's ``model.kernels``, i.e. ``auto``:
  our Triton kernels and flash-attn where they run, the torch references elsewhere);
- transformers': the class ``hybridtron export`` writes for the preset (``Qwen3_5ForCausalLM`` for a dense
  hybrid), its config made by the export's own mapping (``train/hf/export.hf_config``) and its weights copied
  from ours (``load_state_dict(strict=True)``: every tensor has the same shape, so the two parameter counts
  must be equal; both are printed). Attention is ``--attn`` (SDPA by default); the delta rule and the short
  convolution are whatever transformers picked when its modeling module was imported: flash-linear-attention
  (``fla-core``) and causal-conv1d where installed, its torch fallback otherwise. The table says which.

Each model trains with AdamW (``train/optim.build_optimizer``: the preset's lr, betas and weight-decay
groups), gradient clipping at ``train.grad_clip`` and bf16 autocast on the GPU (fp32 on the CPU), on the
same random token batches (``--batch`` x ``--seq``, a pool of four cycled by step, one document per row:
transformers' SDPA path has no document mask, so neither side masks), with the same activation
checkpointing choice (one checkpoint per layer on both sides) and, with ``--compile``, each layer compiled
on both sides. After ``--warmup`` steps each (compilation, autotuning, optimizer state), the two models
alternate over ``--repeats`` rounds of ``--steps`` steps (the order flips every round) and the median
tokens/s of each is reported. Peak memory is that of one model alone: its resident weights and AdamW state
plus the allocator's peak during its steps above what was resident at their start (the other model's
tensors excluded). The first losses of the two agree (same weights, same batch), which is printed too.

Carrying the packages to a GPU machine without internet (pure-Python wheels; the image's torch, triton and
einops serve them):

    pip download --no-deps -d .whl transformers==5.23.0 fla-core
    pip install --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site python -m hybridtron.bench.bench_hf

On the CPU (``--device cpu``) the script only exercises itself at a tiny size for its test: the numbers
mean nothing there and the output says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridtron.bench.report import RESULTS, append_results, device_name
from hybridtron.configs import JobConfig, load_config
from hybridtron.kernels import backend
from hybridtron.train.parallel.parallelize import checkpointing_mode

TARGET = 2.0  # ours / transformers' tokens/s
BATCH_POOL = 4  # distinct random batches, cycled by step
NO_SPECIAL_TOKENS = SimpleNamespace(bos_id=None, eos_id=None, pad_id=None)  # no padding_idx row in the embedding


@dataclass
class Side:
    """One model under test: how to compute its loss on (inputs, labels), its optimizer, what it runs on."""

    name: str
    model: torch.nn.Module
    loss: object  # (x, y) -> scalar loss tensor
    opt: torch.optim.Optimizer
    kernels: str
    rates: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_peak: int = 0  # bytes above resident during its steps (CUDA only)

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def resident(self) -> int:
        """Bytes of its weights and optimizer state (what stays allocated between steps)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        state = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values()
                    if torch.is_tensor(t))
        return weights + state


# ---- configuration ---------------------------------------------------------------------------------
def load(preset: str, seq: int, batch: int, layers: int, ckpt: str, compile_: bool, sets: list[str]) -> JobConfig:
    """The preset with the command line's sizes (0: the preset's) and ``--set KEY=VALUE`` overrides."""
    overrides = [tuple(s.split("=", 1)) for s in sets]
    if seq:
        overrides += [("data.seq_len", str(seq)), ("model.max_seq_len", str(seq))]
    if batch:
        overrides.append(("train.micro_batch_size", str(batch)))
    if layers:
        overrides.append(("model.n_layers", str(layers)))
    if ckpt != "preset":
        overrides.append(("train.activation_checkpointing", {"on": "full", "off": "none"}.get(ckpt, ckpt)))
    overrides.append(("train.compile", str(compile_).lower()))
    return load_config(preset, overrides)


# ---- the two models --------------------------------------------------------------------------------
def build_ours(cfg: JobConfig, vocab: int, device: torch.device) -> torch.nn.Module:
    from hybridtron.train.build import build_model
    from hybridtron.train.parallel.mesh import Mesh
    from hybridtron.train.parallel.parallelize import parallelize

    model = build_model(cfg, vocab, device)
    parallelize(model, cfg, Mesh())  # one process: recomputation and compile as the run applies them
    return model.train()


def build_hf(ours: torch.nn.Module, cfg: JobConfig, vocab: int, device: torch.device, attn: str) -> torch.nn.Module:
    """transformers' model for ``ours`` as the export maps it, holding ``ours``' weights."""
    from transformers import AutoModelForCausalLM

    from hybridtron.train.hf.export import CUSTOM_TARGETS, choose_target, hf_config, plain_state, to_hf_names

    target = choose_target(cfg.model)
    if target in CUSTOM_TARGETS:
        raise SystemExit(f"this model exports only as our custom code (target {target}: Gated DeltaNet options Qwen3.5 "
                         f"lacks); transformers has no class of its own to compare it with")
    state, plain_cfg, _folded = plain_state(ours, target)
    hf_cfg = hf_config(plain_cfg, vocab, target, NO_SPECIAL_TOKENS)
    if device.type == "cpu":  # fla's and causal-conv1d's kernels need a GPU: transformers' torch paths here
        from hybridtron.train.hf.torch_paths import import_with_torch_paths

        import_with_torch_paths()
    with device:
        hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn).to(device)
    state = to_hf_names(state, plain_cfg, target)
    if plain_cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    # transformers checkpoints whole decoder layers: it gets that whenever ours recomputes anything (full or
    # selective), one checkpoint per layer, as ours (no RNG state: no dropout)
    if checkpointing_mode(cfg.train) != "none":
        kwargs = {"use_reentrant": False, "preserve_rng_state": False}
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if cfg.train.compile:
        for layer in hf.model.layers:
            layer.compile()
    return hf.train()


def _origin(fn) -> str:
    """The module of the implementation behind a transformers kernel function (its hub-with-fallback wrapper
    keeps the choice in its closure as ``implementation``)."""
    if fn is None:
        return ""
    try:
        fn = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
    except TypeError:
        pass
    return getattr(fn, "__module__", "") or ""


def hf_paths(hf: torch.nn.Module) -> str:
    """Which delta-rule and convolution code transformers' model runs, and its attention implementation."""
    attn = f"attention {hf.config._attn_implementation}"
    gdn = next((m for m in hf.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if gdn is None:
        return attn
    mod = sys.modules[type(gdn).__module__]
    rule = getattr(gdn, "chunk_gated_delta_rule", None) or getattr(mod, "torch_chunk_gated_delta_rule", None)
    conv = getattr(gdn, "causal_conv1d_fn", None) if hasattr(gdn, "causal_conv1d_fn") else getattr(
        mod, "causal_conv1d_fn", None)
    rule_at, conv_at = _origin(rule), _origin(conv)
    rule_s = f"delta rule: fla kernels ({rule_at})" if rule_at.startswith("fla") else (
        "delta rule: torch fallback" + _fla_problem())
    conv_s = ("conv: causal-conv1d" if conv_at.startswith("causal_conv1d") else
              "conv: torch conv1d (causal-conv1d " + ("installed but unused)" if _installed("causal_conv1d")
                                                     else "not installed)"))
    return f"{rule_s}; {conv_s}; {attn}"


def _fla_problem() -> str:
    """Why transformers did not take fla's kernel although fla is installed ("" when it is not installed)."""
    if not _installed("fla"):
        return " (fla not installed)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # what transformers swallowed when it chose its fallback
        return f" (fla installed, its import fails: {type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return " (fla installed and importable: imported after transformers' modeling module?)"


def ours_paths(cfg: JobConfig, device: torch.device) -> str:
    """Each op's backend: for ``auto`` on a measured device what the tuner chose (after the warm-up steps met the
    shape classes), else what the switch resolves to."""
    from hybridtron.kernels import tune

    measured: dict[str, set[str]] = {}
    for key, d in tune.decisions().items():
        measured.setdefault(key.split("[")[0], set()).add(d.chosen)
    ops = ("attention", "delta_rule", "conv", "norm", "rotary", "swiglu", "cross_entropy")
    out = []
    for op in ops:
        req = getattr(cfg.model.kernels, op)
        out.append(f"{op} {'/'.join(sorted(measured[op]))} (auto, measured)" if req == "auto" and op in measured
                   else f"{op} {backend.resolve(op, req, device)}")
    return "; ".join(out)


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ---- timing ----------------------------------------------------------------------------------------
def make_batches(vocab: int, batch: int, seq: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(BATCH_POOL):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(side: Side, batches, step0: int, n: int, cfg: JobConfig, device: torch.device) -> float:
    """``n`` training steps of ``side`` from step ``step0``; records the losses and the step peak, returns tokens/s."""
    from hybridtron.train.device import autocast_context, autocast_dtype

    amp = autocast_dtype(cfg.train, device)
    params = [p for p in side.model.parameters() if p.requires_grad]
    losses = []
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    for i in range(step0, step0 + n):
        x, y = batches[i % len(batches)]
        with autocast_context(device, amp):
            loss = side.loss(x, y)
        loss.backward()
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        side.opt.step()
        side.opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    _sync(device)
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        side.step_peak = max(side.step_peak, torch.cuda.max_memory_allocated(device) - start_bytes)
    side.losses += [float(v) for v in losses]
    return n * batches[0][0].numel() / seconds


def measure(sides: list[Side], batches, cfg: JobConfig, device: torch.device, warmup: int, steps: int,
            repeats: int) -> None:
    for side in sides:
        run_steps(side, batches, 0, warmup, cfg, device)
    for r in range(repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            side.rates.append(run_steps(side, batches, warmup + r * steps, steps, cfg, device))


# ---- report ----------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(sides: list[Side], cfg: JobConfig, device: torch.device, args) -> str:
    ours, hf = sides
    cuda = device.type == "cuda"
    lines = ["| model | params | runs on | tokens/s (median) | per-repeat tokens/s | loss first -> last | peak memory |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in sides:
        peak = f"{_gib(s.resident() + s.step_peak)} ({_gib(s.resident())} resident)" if cuda else "n/a (CPU)"
        lines.append(f"| {s.name} | {s.params():,} | {s.kernels} | {statistics.median(s.rates):,.0f} | "
                     f"{', '.join(f'{r:,.0f}' for r in s.rates)} | {s.losses[0]:.4f} -> {s.losses[-1]:.4f} | {peak} |")
    m, t = cfg.model, cfg.train
    diff = abs(ours.params() - hf.params()) / hf.params()
    ratio = statistics.median(ours.rates) / statistics.median(hf.rates)
    if not cuda:
        verdict = "no verdict: CPU numbers mean nothing"
    elif "fla kernels" not in hf.kernels:  # the target is against transformers with fla's kernels
        verdict = "no verdict: transformers ran without fla's kernels (install fla-core)"
    else:
        verdict = "met" if ratio >= TARGET else "NOT met"
    lines += [
        "",
        f"- configuration: {args.preset}, {m.n_layers} layers {''.join(m.layer_types())}, d_model {m.d_model}, "
        f"vocab {ours.model.vocab_size}, {t.micro_batch_size} x {cfg.data.seq_len} tokens per step, activation "
        f"checkpointing {checkpointing_mode(t)}, torch.compile {'on' if t.compile else 'off'}, "
        f"{'bf16 autocast' if cuda else 'fp32'}, AdamW lr {t.lr:g}, {args.warmup} warm-up + {args.steps} steps x "
        f"{args.repeats} alternating repeats",
        f"- parameters: ours {ours.params():,}, transformers {hf.params():,} (difference {100 * diff:.2f}%; "
        f"{'same configuration' if diff <= 0.01 else 'NOT the same configuration'})",
        f"- first-step loss (same weights, same batch): ours {ours.losses[0]:.4f}, transformers {hf.losses[0]:.4f}",
        f"- **ours / transformers: {ratio:.2f}x tokens/s** (target >= {TARGET:g}x: {verdict})",
    ]
    if not cuda:
        lines.append("- CPU run: a test of the script at a tiny size; the timings mean nothing")
    return "\n".join(lines)


def versions() -> str:
    import transformers

    out = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for name, dist in (("fla", "fla-core"), ("causal_conv1d", "causal-conv1d"), ("flash_attn", "flash-attn")):
        out.append(f"{dist} {_dist_version(dist, name)}")
    return ", ".join(out)


def _dist_version(dist: str, module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for d in (dist, module, "flash-linear-attention" if module == "fla" else dist):
        try:
            return version(d)
        except PackageNotFoundError:
            continue
    return "installed" if _installed(module) else "not installed"


# ---- command line ----------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="hybrid_1b")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (0: the preset's data.seq_len)")
    ap.add_argument("--batch", type=int, default=0, help="micro-batch (0: the preset's train.micro_batch_size)")
    ap.add_argument("--layers", type=int, default=0, help="override model.n_layers (0: the preset's), for quick runs")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2", "eager"],
                    help="transformers' attention implementation")
    ap.add_argument("--activation-checkpointing", choices=["preset", "none", "full", "selective", "on", "off"],
                    default="preset",
                    help="for both models (preset: train.activation_checkpointing)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer of both models")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--append", nargs="?", const=str(RESULTS), default=None, metavar="PATH",
                    help="append the table to PATH (default bench/RESULTS.md)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write both sides' figures and the ratio to FILE")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--steps and --repeats must be >= 1, --warmup >= 0")
    if args.attn == "flash_attention_2" and not _installed("flash_attn"):
        ap.error("--attn flash_attention_2 needs the flash-attn package; it is not installed")
    return args


def main(argv: list[str] | None = None) -> str:
    from hybridtron.train.optim import build_optimizer

    args = parse(argv)
    device = torch.device(args.device)
    cfg = load(args.preset, args.seq, args.batch, args.layers, args.activation_checkpointing, args.compile, args.set)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    ours = build_ours(cfg, vocab, device)
    hf = build_hf(ours, cfg, vocab, device, args.attn)
    sides = [
        Side(f"hybridtron {type(ours).__name__}", ours, lambda x, y: ours(x, labels=y),
             build_optimizer(ours, cfg.train), ours_paths(cfg, device)),
        Side(f"transformers {type(hf).__name__}", hf,
             lambda x, y: hf(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss,
             build_optimizer(hf, cfg.train), hf_paths(hf)),
    ]
    batches = make_batches(vocab, cfg.train.micro_batch_size, cfg.data.seq_len, device)
    measure(sides, batches, cfg, device, args.warmup, args.steps, args.repeats)
    sides[0].kernels = ours_paths(cfg, device)  # what auto measured and chose in the warm-up steps
    if not all(math.isfinite(v) for s in sides for v in s.losses):
        print("warning: a loss is not finite", file=sys.stderr)
    body = report(sides, cfg, device, args)
    header = (f"Ours against transformers' Qwen3.5: `python -m hybridtron.bench.bench_hf` ({device_name(device)}, "
              f"{time.strftime('%Y-%m-%d')}; {versions()})")
    print(header)
    print(body)
    if args.json:
        ours, hf = sides
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "preset": args.preset, "device": str(device), "versions": versions(),
            "sides": [{"name": s.name, "kernels": s.kernels, "tokens_per_s": statistics.median(s.rates),
                       "rates": s.rates, "losses": s.losses} for s in sides],
            "ratio": statistics.median(ours.rates) / statistics.median(hf.rates), "target": TARGET,
            "hf_has_fla": "fla kernels" in hf.kernels}, indent=1) + "\n")
    if args.append:
        cmd = " ".join(["python -m hybridtron.bench.bench_hf", *(sys.argv[1:] if argv is None else argv)])
        append_results(args.append, header, cmd, body)
        print(f"appended to {args.append}")
    return body


if __name__ == "__main__":
    main()
