"""Gated attention, forward + backward: our Triton kernel against SDPA's flash backend + a separate gate, the
model's reference path today (SDPA with a dense document mask + gate) and flash-attn's (varlen) kernel + gate
where installed. GPU only for numbers (the target: Triton >= 1.1x SDPA-flash + gate at head dims 128 and 256,
sequences 4k-8k, with and without documents); ``--device cpu`` under TRITON_INTERPRET=1 only smoke-tests it.

Each configuration checks that every candidate's output agrees with the Triton kernel's first, then times
forward + backward (CUDA events, median of ``--repeats``, candidates alternating within each repeat so clock
drift hits all alike). With documents, SDPA's flash backend runs on a nested (jagged) tensor: its varlen path,
the only way SDPA gets documents without a mask; it has no grouped-query support there, so K/V are repeated
per query head first and that copy is timed as part of it.

    python -m hybridtron.bench.kernels_attention [--seq 4096 8192] [--head-dim 128 256] [--heads 16]
        [--kv-heads 4] [--docs none many] [--doc-len 512] [--dtype bfloat16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hybridtron.kernels import backend
from hybridtron.kernels.gated_attention import cu_seqlens_from_bounds, doc_bounds, gated_attention
from hybridtron.model.attention import doc_causal_mask


def make_inputs(T: int, H: int, KV: int, D: int, dtype, device, seed: int = 0):
    """One packed row (B = 1) of T tokens: q, k, v, elementwise gate, each requiring grad, and a dout."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    xs = [rand(1, T, H, D), rand(1, T, KV, D), rand(1, T, KV, D), rand(1, T, H, D)]
    return [x.requires_grad_() for x in xs], rand(1, T, H, D)


def make_doc_ids(T: int, mean_len: int, device, seed: int = 0) -> torch.Tensor:
    """(1, T) ids of documents with lengths uniform in [1, 2 * mean_len)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(1, 2 * mean_len, (T,), generator=g)
    return torch.repeat_interleave(torch.arange(T), lengths)[:T].unsqueeze(0).to(device)


def _sdpa_flash(q, k, v, gate, doc_ids):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, KV = q.shape[2], k.shape[2]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if doc_ids is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=H != KV,
            ).transpose(1, 2)
            return out * torch.sigmoid(gate)
        T = q.shape[1]
        start, _ = doc_bounds(1, T, doc_ids=doc_ids)
        offsets = cu_seqlens_from_bounds(start).long()
        k, v = (t.repeat_interleave(H // KV, dim=2) for t in (k, v))

        def jag(t):  # (1, T, h, D) -> nested (n_docs, h, j, D)
            return torch.nested.nested_tensor_from_jagged(t[0], offsets).transpose(1, 2)

        out = F.scaled_dot_product_attention(jag(q), jag(k), jag(v), is_causal=True)
        return out.transpose(1, 2).values().unsqueeze(0) * torch.sigmoid(gate)


def _sdpa_mask(q, k, v, gate, doc_ids):
    """The model's reference path: SDPA (whatever backend takes a mask) with the dense document mask."""
    mask = doc_causal_mask(doc_ids) if doc_ids is not None else None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        enable_gqa=q.shape[2] != k.shape[2],
    ).transpose(1, 2)
    return out * torch.sigmoid(gate)


def candidates(device: torch.device) -> dict:
    cands = {
        "triton": lambda q, k, v, g, d: gated_attention(q, k, v, g, doc_ids=d, backend="triton"),
        "sdpa-flash+gate": _sdpa_flash,
        "sdpa-mask+gate": _sdpa_mask,
    }
    if backend.flash_attn_unavailable_reason(device) is None:
        cands["flash-attn+gate"] = lambda q, k, v, g, d: gated_attention(q, k, v, g, doc_ids=d, backend="flash-attn")
    return cands


def _timed(fn, inputs, dout, doc_ids) -> float:
    for t in inputs:
        t.grad = None
    if dout.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs, doc_ids).backward(dout)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(*inputs, doc_ids).backward(dout)
    return time.perf_counter() - t0


def bench_attention(seqs, head_dims, H: int, KV: int, docs, doc_len: int, dtype, repeats: int,
                    device: torch.device, warmup: int = 3, tolerance: float = 0.1) -> list[dict]:
    """Rows {seq, head_dim, docs, candidate, seconds, max_diff} for every configuration and candidate; a
    candidate that cannot run there gets seconds None and its error."""
    rows = []
    for T in seqs:
        for D in head_dims:
            for doc_mode in docs:
                inputs, dout = make_inputs(T, H, KV, D, dtype, device)
                doc_ids = make_doc_ids(T, doc_len, device) if doc_mode == "many" else None
                cands = candidates(device)
                diffs = {}
                with torch.no_grad():
                    ref = cands["triton"](*inputs, doc_ids).float()
                    for n, f in list(cands.items()):
                        try:
                            diffs[n] = (f(*inputs, doc_ids).float() - ref).abs().max().item()
                        except RuntimeError as e:  # e.g. SDPA on nested tensors has no causal CPU path
                            rows.append(dict(seq=T, head_dim=D, docs=doc_mode, candidate=n, seconds=None,
                                             max_diff=None, error=str(e).splitlines()[0]))
                            del cands[n]
                bad = {n: d for n, d in diffs.items() if d > tolerance}
                if bad:
                    raise SystemExit(f"seq {T}, head dim {D}, docs {doc_mode}: outputs disagree with the Triton "
                                     f"kernel by {bad} (> {tolerance}); not timing candidates that compute "
                                     f"different things")
                for _ in range(warmup):
                    for f in cands.values():
                        _timed(f, inputs, dout, doc_ids)
                times = {n: [] for n in cands}
                for _ in range(repeats):
                    for n, f in cands.items():
                        times[n].append(_timed(f, inputs, dout, doc_ids))
                for n in cands:
                    rows.append(dict(seq=T, head_dim=D, docs=doc_mode, candidate=n,
                                     seconds=statistics.median(times[n]), max_diff=diffs[n]))
                del inputs, dout
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| seq | head dim | docs | candidate | fwd+bwd ms | triton speed-up | max diff vs triton |",
             "| ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    ours = {(r["seq"], r["head_dim"], r["docs"]): r["seconds"] for r in rows if r["candidate"] == "triton"}
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"| {r['seq']} | {r['head_dim']} | {r['docs']} | {r['candidate']} | unavailable: "
                         f"{r['error']} | | |")
            continue
        speedup = r["seconds"] / ours[(r["seq"], r["head_dim"], r["docs"])]
        lines.append(f"| {r['seq']} | {r['head_dim']} | {r['docs']} | {r['candidate']} | {r['seconds'] * 1e3:.3f} | "
                     f"{speedup:.2f}x | {r['max_diff']:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--docs", nargs="+", choices=["none", "many"], default=["none", "many"])
    ap.add_argument("--doc-len", type=int, default=512, help="mean document length with --docs many")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    why = backend.triton_unavailable_reason(device)
    if why is not None:
        ap.error(f"the Triton kernel cannot run on {device}: {why}. Timings need a CUDA GPU; --device cpu with "
                 f"TRITON_INTERPRET=1 only smoke-tests this script at tiny sizes")
    rows = bench_attention(args.seq, args.head_dim, args.heads, args.kv_heads, args.docs, args.doc_len,
                           getattr(torch, args.dtype), args.repeats, device, warmup=0 if device.type == "cpu" else 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter: not a timing)"
    print(f"gated attention fwd+bwd, {args.dtype}, {args.heads} query / {args.kv_heads} kv heads, one packed row, "
          f"on {name}, {time.strftime('%Y-%m-%d')}")
    print(report(rows))


if __name__ == "__main__":
    main()
