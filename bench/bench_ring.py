"""Ring attention's block kernels on one GPU (issue 43): what a context-parallel rank's attention costs and whether
its kernels agree with whole attention.

On one device the cp ranks are simulated one after another: each rank's ring steps (its own zig-zag block causal,
then the other ranks' blocks as the unmasked rectangles ring attention cuts) run through the block backend
(kernels/gated_attention/blocks.py) with the blocks handed over directly instead of sent, merged by log-sum-exp
(`context_parallel._merge`), and the backward's block gradients summed where the ring would carry them.

- **check** (small: 2 x 2,048 tokens, bf16): every rank's merged output and the q, k, v gradients against torch's
  SDPA over the whole sequence (math backend, float32): the relative max error per tensor.
- **time** (2 x ``--tokens`` per rank, default 32,768): one rank's forward + backward block work (the slower
  rank's), against SDPA's causal attention over the rank's own tokens alone (cp 1 at the same tokens per rank),
  and both peak memories. A rank of cp 2 attends over twice the pairs of that causal attention, so 2.0 is the
  time ratio of equally fast kernels; memory should stay at about 1x (nothing of size sequence x sequence).

    python -m hybridtron.bench.bench_ring [--backends sdpa,triton] [--tokens 32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hybridtron.kernels.gated_attention import blocks
from hybridtron.train.parallel.context_parallel import _merge, ring_rectangle, ring_steps, zigzag


def _segments(r: int, n: int, t: int):
    """(src, its rectangle) of each of rank r's ring steps after its own block, without documents."""
    return [(src, ring_rectangle(r, src, t)) for _, src in ring_steps(n, r, fake=False)]


def rank_forward(backend, r, n, q, k, v):
    """Rank r's merged (out, lse) and the blocks it used, blocks taken from the other simulated ranks directly."""
    B, t, H, D = q[r].shape
    acc = torch.zeros(B, t, H, D, dtype=torch.float32, device=q[r].device)
    lse = torch.full((B, H, t), float("-inf"), dtype=torch.float32, device=q[r].device)
    o, l_ = blocks.forward(backend, q[r], k[r], v[r], causal=True, scale=D ** -0.5)
    _merge(acc, lse, o, l_, slice(None), 0, t)
    for src, (q0, q1, k0, k1) in _segments(r, n, t):
        o, l_ = blocks.forward(backend, q[r][:, q0:q1], k[src][:, k0:k1], v[src][:, k0:k1], causal=False,
                               scale=D ** -0.5)
        _merge(acc, lse, o, l_, slice(None), q0, q1)
    return acc.to(q[r].dtype), lse


def rank_backward(backend, r, n, q, k, v, out, lse, dout, dk, dv):
    """Rank r's dq; its shares of every block's dk, dv are added into ``dk``, ``dv`` (float32)."""
    D = q[r].shape[-1]
    dq, gk, gv = blocks.backward(backend, dout, q[r], k[r], v[r], out, lse, causal=True, scale=D ** -0.5)
    dq = dq.float()
    dk[r] += gk
    dv[r] += gv
    for src, (q0, q1, k0, k1) in _segments(r, n, q[r].shape[1]):
        gq, gk, gv = blocks.backward(backend, dout[:, q0:q1], q[r][:, q0:q1], k[src][:, k0:k1], v[src][:, k0:k1],
                                     out[:, q0:q1], lse[:, :, q0:q1], causal=False, scale=D ** -0.5)
        dq[:, q0:q1] += gq
        dk[src][:, k0:k1] += gk
        dv[src][:, k0:k1] += gv
    return dq


def check(backend: str, n: int, tokens: int, H: int, KV: int, D: int, device) -> list[float]:
    """Relative max errors of (out, dq, dk, dv) of the simulated ring against whole SDPA attention (float32)."""
    g = torch.Generator(device=device).manual_seed(0)
    T = n * tokens
    qf, kf, vf = (torch.randn(1, T, h, D, generator=g, device=device) for h in (H, KV, KV))
    dof = torch.randn(1, T, H, D, generator=g, device=device)
    qr, kr, vr = (x.clone().requires_grad_() for x in (qf, kf, vf))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                             is_causal=True, enable_gqa=True).transpose(1, 2)
    (ref * dof).sum().backward()
    dt = torch.bfloat16 if device.type == "cuda" else torch.float64
    q, k, v, do = ([zigzag(x, n, r).to(dt) for r in range(n)] for x in (qf, kf, vf, dof))
    dk = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in k]
    dv = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in v]
    outs, dqs = [], []
    for r in range(n):
        out, lse = rank_forward(backend, r, n, q, k, v)
        outs.append(out)
        dqs.append(rank_backward(backend, r, n, q, k, v, out, lse, do[r], dk, dv))
    errs = []
    for got, want in ((outs, ref.detach()), (dqs, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        whole = [zigzag(want, n, r) for r in range(n)]
        errs.append(max(float((a.float() - b).abs().max()) for a, b in zip(got, whole, strict=True))
                    / float(want.abs().max()))
    return errs


def _timed(fn, device, repeats: int = 3) -> tuple[float, float]:
    """(median seconds, peak MiB above the start) of ``fn``."""
    fn()  # warm-up (and autotuning)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], peak


def timing(backend: str, n: int, tokens: int, H: int, KV: int, D: int, device) -> dict:
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = ([torch.randn(1, tokens, h, D, generator=g, device=device, dtype=dt) for _ in range(n)]
               for h in (H, KV, KV))
    dout = torch.randn_like(q[0])

    def rank_work(r):
        dk = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in k]
        dv = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in v]
        out, lse = rank_forward(backend, r, n, q, k, v)
        rank_backward(backend, r, n, q, k, v, out, lse, dout, dk, dv)

    ranks = [_timed(lambda r=r: rank_work(r), device) for r in range(n)]
    qs, ks, vs = (x[0].detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def cp1():
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        o.backward(dout.transpose(1, 2))

    base = _timed(cp1, device)
    slow = max(ranks)
    return {"backend": backend, "cp": n, "tokens_per_rank": tokens, "rank_s": slow[0], "rank_peak_mib": slow[1],
            "sdpa_cp1_s": base[0], "sdpa_cp1_peak_mib": base[1], "time_ratio": slow[0] / base[0],
            "memory_ratio": slow[1] / base[1] if base[1] else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sdpa,triton")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per rank for the timing (cp 2)")
    ap.add_argument("--check-tokens", type=int, default=2048)
    ap.add_argument("--heads", default="32,8,128", help="H,KV,D (Llama 3.1 8B's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    H, KV, D = (int(x) for x in args.heads.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for backend in args.backends.split(","):
        row = {"backend": backend}
        try:
            row["rel_err"] = check(backend, 2, args.check_tokens, H, KV, D, device)
            row.update(timing(backend, 2, args.tokens, H, KV, D, device))
        except Exception as e:  # noqa: BLE001  (a backend's failure is a result: the next one still runs)
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
