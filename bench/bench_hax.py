"""Speed of HAX's parts (model/hax.py) on one device: the key choice (LSH + key selection, index bookkeeping in
torch) and the gathered sparse attention forward + backward (kernels/hax_attention, each backend asked for),
at one layer's shapes. Prints one JSON line of median milliseconds per part.

    python -m hybridtron.bench.bench_hax                                  # CUDA: hybrid_1b-like widths, T 4096
    python -m hybridtron.bench.bench_hax --device cpu --seq 256 --value-dim 256 --backends reference

The key choice sorts the keys by (bucket, position) and carries a running top-k from chunk to chunk of queries
(O(T log T + T S)); the attention reads S (D + E) gathered values per query (memory-bound, no tensor cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybridtron.kernels.hax_attention import hax_attention
from hybridtron.model.hax import select_keys


def _clock(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(batch: int, seq: int, keys: int, dim: int, value_dim: int, bits: int, backends: list[str], device: str,
        dtype: torch.dtype, repeats: int) -> dict:
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    doc = torch.zeros(batch, seq, dtype=torch.long, device=dev)
    bucket = torch.randint(0, 2 ** bits, (batch, seq), generator=g, device=dev)
    score = torch.randn(batch, seq, generator=g, device=dev)
    out = {"batch": batch, "seq": seq, "keys": keys, "dim": dim, "value_dim": value_dim, "dtype": str(dtype),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    n = keys // 2
    idx = select_keys(("lsh", "key_selection"), n, doc, doc, bucket, bucket, score)
    out["select_ms"] = _clock(lambda: select_keys(("lsh", "key_selection"), n, doc, doc, bucket, bucket, score), dev,
                              repeats)
    q = torch.randn(batch, seq, dim, generator=g, device=dev).to(dtype).requires_grad_()
    k = torch.randn(batch, seq, dim, generator=g, device=dev).to(dtype).requires_grad_()
    v = torch.randn(batch, seq, value_dim, generator=g, device=dev).to(dtype).requires_grad_()
    do = torch.randn(batch, seq, value_dim, generator=g, device=dev).to(dtype)
    for backend in backends:
        def fwd(backend=backend):
            with torch.no_grad():
                hax_attention(q, k, v, idx, backend=backend)

        def fwd_bwd(backend=backend):
            hax_attention(q, k, v, idx, backend=backend).backward(do)

        out[f"{backend}_fwd_ms"] = _clock(fwd, dev, repeats)
        out[f"{backend}_fwd_bwd_ms"] = _clock(fwd_bwd, dev, repeats)
    gathered = batch * seq * keys * (dim + value_dim) * torch.finfo(dtype).bits // 8
    out["gathered_gb_fwd"] = gathered / 1e9  # bytes the forward gathers if no key is reused from cache
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128, help="q/k width of the branch (model.deltanet.sparse_dim)")
    ap.add_argument("--value-dim", type=int, default=2048, help="the mixer's value width (n_v_heads x v_head_dim)")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--backends", nargs="+", default=["triton", "reference"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args(argv)
    if a.keys < 2 or a.seq < 1:
        ap.error(f"--keys {a.keys} must be >= 2 (half LSH, half key selection) and --seq {a.seq} >= 1")
    res = run(a.batch, a.seq, a.keys, a.dim, a.value_dim, a.bits, a.backends, a.device,
              torch.bfloat16 if a.dtype == "bf16" else torch.float32, a.repeats)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
