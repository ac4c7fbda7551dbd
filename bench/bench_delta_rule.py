"""Speed of the chunked (WY / UT) delta-rule reference against the token-by-token recurrence.

Both run forward + backward on the same inputs (fp32, Qwen3.5-like heads scaled down for a CPU), in
alternating repeats so a noisy VM's drift hits both alike; prints the median seconds of each and the
ratio, and checks the two agree on the outputs first.

    python -m hybridtron.bench.bench_delta_rule [--seq 2048] [--heads 4] [--dim 64] [--chunk 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hybridtron.model.delta_rule import delta_rule_chunked, delta_rule_recurrent


def make_inputs(B: int, T: int, H: int, D: int, n_h: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, n_h, H, D, generator=g)
    v = torch.randn(B, T, n_h, H, D, generator=g)
    gate = -F.softplus(torch.randn(B, T, H, generator=g)) * 0.1
    beta = torch.rand(B, T, n_h, H, generator=g)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def timed(fn, inputs) -> float:
    for t in inputs:
        t.grad = None
    t0 = time.perf_counter()
    o, _ = fn(*inputs)
    o.pow(2).sum().backward()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--householder", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    inputs = make_inputs(args.batch, args.seq, args.heads, args.dim, args.householder)
    chunked = lambda *x: delta_rule_chunked(*x, chunk_size=args.chunk)  # noqa: E731
    with torch.no_grad():
        a, _ = chunked(*inputs)
        b, _ = delta_rule_recurrent(*inputs)
    err = (a - b).abs().max().item()
    times = {"recurrent": [], "chunked": []}
    for _ in range(args.repeats):
        times["recurrent"].append(timed(delta_rule_recurrent, inputs))
        times["chunked"].append(timed(chunked, inputs))
    rec, chk = statistics.median(times["recurrent"]), statistics.median(times["chunked"])
    print(f"threads {torch.get_num_threads()}, B={args.batch} T={args.seq} H={args.heads} D={args.dim} "
          f"n_h={args.householder} chunk={args.chunk}, fp32 forward+backward, max |chunked - recurrent| = {err:.2e}")
    print("| form | median s | per-repeat s |")
    print("| --- | --- | --- |")
    for name, med in (("recurrent", rec), ("chunked", chk)):
        print(f"| {name} | {med:.3f} | {', '.join(f'{t:.3f}' for t in times[name])} |")
    print(f"chunked speed-up over the recurrence: {rec / chk:.1f}x")


if __name__ == "__main__":
    main()
