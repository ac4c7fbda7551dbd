"""Training-step throughput of the architecture presets side by side, on this machine.

Each preset's model (its vocabulary resolved from the preset's tokenizer size) trains on the same
random token batches (micro-batch x seq_len of the preset, doc ids with several documents per row);
the presets alternate over ``--repeats`` rounds of ``--steps`` steps so drift of a noisy VM hits all
of them alike, and the median tokens/s per preset is printed as a Markdown table.

    python -m hybridtron.bench.bench_arch [--presets tiny tiny_hybrid tiny_moe] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridtron.configs import load_config
from hybridtron.model import GatedLM
from hybridtron.train.model_hooks import after_step, before_step
from hybridtron.train.optim import build_optimizer


def _setup(preset: str, seq: int = 0, batch: int = 0):
    overrides = [("data.seq_len", str(seq)), ("model.max_seq_len", str(seq))] if seq else []
    overrides += [("train.micro_batch_size", str(batch))] if batch else []
    cfg = load_config(preset, overrides)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    torch.manual_seed(0)
    model = GatedLM(cfg.model, vocab)
    model.init_weights()
    opt = build_optimizer(model, cfg.train)
    g = torch.Generator().manual_seed(1)
    B, T = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, vocab, (B, T + 1), generator=g)
    doc_ids = (torch.rand(B, T, generator=g) < 0.02).cumsum(1) if cfg.model.doc_mask else None
    return cfg, model, opt, (ids[:, :-1], ids[:, 1:], doc_ids)


def _steps(cfg, model, opt, batch, n: int, step0: int) -> float:
    x, y, doc = batch
    t0 = time.perf_counter()
    for i in range(n):
        before_step(model, opt, cfg, step0 + i)
        model(x, doc, labels=y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step(model)
    return n * x.numel() / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "tiny_hybrid", "tiny_moe"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=0, help="override data.seq_len and model.max_seq_len (0: the preset's)")
    ap.add_argument("--batch", type=int, default=0, help="override train.micro_batch_size (0: the preset's)")
    args = ap.parse_args(argv)
    runs = {p: _setup(p, args.seq, args.batch) for p in args.presets}
    for cfg, model, opt, batch in runs.values():  # warm-up: optimizer state, allocator
        _steps(cfg, model, opt, batch, 2, 0)
    rates: dict[str, list[float]] = {p: [] for p in runs}
    for r in range(args.repeats):
        for p, (cfg, model, opt, batch) in runs.items():
            rates[p].append(_steps(cfg, model, opt, batch, args.steps, 2 + r * args.steps))
    print(f"threads: {torch.get_num_threads()}, {args.steps} steps x {args.repeats} alternating repeats")
    print("| preset | layers | params | active params | tokens/s (median) | per-repeat tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p, (cfg, model, _opt, _b) in runs.items():
        print(f"| {p} | {''.join(cfg.model.layer_types())} | {model.num_params() / 1e6:.2f}M | "
              f"{model.num_active_params() / 1e6:.2f}M | {statistics.median(rates[p]):,.0f} | "
              f"{', '.join(f'{x:,.0f}' for x in rates[p])} |")


if __name__ == "__main__":
    main()
