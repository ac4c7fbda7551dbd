"""Gated attention, forward + backward: our Triton kernel against every SDPA backend with the gate as a separate
op (flash, cuDNN, efficient: each forced with ``sdpa_kernel``), SDPA's own choice with the model's dense document
mask (the model's reference path), and flash-attn's (varlen) kernel + gate where installed. GPU only for numbers
(the target: Triton >= 1.1x the fastest SDPA backend + gate at head dims 128 and 256, sequences 4k-16k, with and
without documents; with 512-token documents <= 0.3x our own time without them); ``--device cpu`` under
TRITON_INTERPRET=1 only smoke-tests it.

Each configuration first runs the pure-torch reference (kernels/gated_attention/reference.py) in float32 on
the same inputs, forward + backward, and compares every candidate's output and its gradients of q, k, v and
the gate with it (max |x - ref| / max |ref| per tensor); a candidate off by more than the dtype's tolerance
is reported, not timed. Then forward + backward is timed (CUDA events, median of ``--repeats``, candidates
alternating within each repeat so clock drift hits all alike) and its allocator peak taken (CUDA only).

With documents, SDPA's flash backend refuses a mask, so it runs on a nested (jagged) tensor instead: its
varlen path, the only way SDPA's flash kernel sees documents; it has no grouped-query support there, so K/V
are repeated per query head first and that copy is timed as part of it. The cuDNN and efficient backends get
the dense (T x T) document mask. A backend that refuses ``enable_gqa`` gets K/V repeated per query head (timed,
and said under the table).

FLOPs (the FlashAttention papers' convention): the forward is two matmuls, S = q k^T and O = P v, of 2 D
FLOPs per head and unmasked (query, key) pair, 4 D H pairs; the backward five (S recomputed, dV, dP, dQ,
dK), 2.5x the forward. Pairs are those the causal document mask keeps: sum over documents of L (L + 1) / 2.
Softmax and gate are not counted, so a rate is comparable across document layouts.

    python -m hybridtron.bench.kernels_attention [--seq 4096 8192 16384] [--head-dim 128 256] [--heads 16]
        [--kv-heads 4] [--docs none many] [--doc-len 512] [--dtype bfloat16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hybridtron.bench.report import device_name
from hybridtron.bench.timing import (
    ATT_OURS,
    ATT_SDPA_FLASH,
    ATT_TARGET,
    Row,
    _fwd_bwd,
    _peak_mib,
    _timed,
    attention_verdicts,
)
from hybridtron.kernels import backend
from hybridtron.kernels.gated_attention import (
    cu_seqlens_from_bounds,
    doc_bounds,
    gated_attention,
    gated_attention_reference,
)
from hybridtron.model.attention import doc_causal_mask

TENSORS = ("out", "dq", "dk", "dv", "dgate")
# max |x - ref| / max |ref| a candidate may reach against the float32 reference: 16-bit inputs, 16-bit P and
# dS in the matmuls give errors of ~1e-2 of the largest entry; a wrong mask, gate or GQA reduction gives O(1)
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-2, torch.float32: 1e-3}
ATT_SDPA_CUDNN, ATT_SDPA_EFFICIENT, ATT_SDPA_MASK = "sdpa-cudnn+gate", "sdpa-efficient+gate", "sdpa-mask+gate"
SDPA_PEERS = (ATT_SDPA_FLASH, ATT_SDPA_CUDNN, ATT_SDPA_EFFICIENT, ATT_SDPA_MASK)  # the fastest is the target's
DOCS_TARGET = 0.3  # our time with --doc-len 512 documents over our time without, at most


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


def causal_pairs(T: int, doc_ids: torch.Tensor | None = None) -> int:
    """Unmasked (query, key) pairs of one row: sum over its documents of L (L + 1) / 2."""
    if doc_ids is None:
        lengths = [T]
    else:
        cu = cu_seqlens_from_bounds(doc_bounds(1, T, doc_ids=doc_ids)[0])
        lengths = (cu[1:] - cu[:-1]).tolist()
    return sum(n * (n + 1) // 2 for n in lengths)


def attention_flops(T: int, H: int, D: int, doc_ids: torch.Tensor | None = None) -> float:
    """Forward + backward: 4 D H pairs forward, 2.5x that backward (module docstring)."""
    return 3.5 * 4 * D * H * causal_pairs(T, doc_ids)


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


class _SdpaForced:
    """SDPA with one backend forced (cuDNN or efficient), causal, or with the dense document mask, then the gate.
    Grouped-query attention through ``enable_gqa``; where the backend refuses it, K/V repeated per query head
    (``repeated`` says so; the copy is timed)."""

    def __init__(self, backend_name: str):
        self.backend_name = backend_name
        self.repeated = False

    def __call__(self, q, k, v, gate, doc_ids):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        H, KV = q.shape[2], k.shape[2]
        if self.repeated:
            k, v = (t.repeat_interleave(H // KV, dim=2) for t in (k, v))
        mask = doc_causal_mask(doc_ids) if doc_ids is not None else None
        with sdpa_kernel(getattr(SDPBackend, self.backend_name)):
            try:
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
                    enable_gqa=k.shape[2] != H,
                )
            except RuntimeError:
                if self.repeated or H == KV:
                    raise
                self.repeated = True  # retried once; the next calls repeat K/V up front
                return self(q, k, v, gate, doc_ids)
        return out.transpose(1, 2) * torch.sigmoid(gate)


def _sdpa_mask(q, k, v, gate, doc_ids):
    """The model's reference path: SDPA (whatever backend takes a mask) with the dense document mask."""
    mask = doc_causal_mask(doc_ids) if doc_ids is not None else None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        enable_gqa=q.shape[2] != k.shape[2],
    ).transpose(1, 2)
    return out * torch.sigmoid(gate)


def candidates(device: torch.device) -> dict:
    """name -> fn(q, k, v, gate, doc_ids), or a str saying why it cannot run here."""
    why = backend.flash_attn_unavailable_reason(device)
    return {
        ATT_OURS: lambda q, k, v, g, d: gated_attention(q, k, v, g, doc_ids=d, backend="triton"),
        ATT_SDPA_FLASH: _sdpa_flash,
        ATT_SDPA_CUDNN: _SdpaForced("CUDNN_ATTENTION"),
        ATT_SDPA_EFFICIENT: _SdpaForced("EFFICIENT_ATTENTION"),
        ATT_SDPA_MASK: _sdpa_mask,
        "flash-attn+gate": why or (lambda q, k, v, g, d: gated_attention(q, k, v, g, doc_ids=d, backend="flash-attn")),
    }


def _errors(got, ref) -> dict[str, float]:
    """Per tensor max |x - ref| / max |ref|; a gradient the candidate never produced counts as zeros (1.0)."""
    out = {}
    for name, a, r in zip(TENSORS, got, ref, strict=True):
        a = torch.zeros_like(r) if a is None else a.float()
        out[name] = ((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
    return out


def bench_attention(seqs, head_dims, H: int, KV: int, docs, doc_len: int, dtype, repeats: int,
                    device: torch.device, warmup: int = 3) -> list[Row]:
    """A `Row` (op "attention") per configuration and candidate: time, TFLOP/s, peak MiB, max_err the worst
    relative error vs the reference (extra: seq, head_dim, docs, flops, tflops, errors per tensor). A candidate
    that cannot run, or disagrees with the reference, gets seconds None and says why in its note."""
    rows = []
    for T in seqs:
        for D in head_dims:
            for doc_mode in docs:
                rows += bench_config(T, D, H, KV, doc_mode, doc_len, dtype, repeats, device, warmup)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def bench_config(T: int, D: int, H: int, KV: int, doc_mode: str, doc_len: int, dtype, repeats: int,
                 device: torch.device, warmup: int) -> list[Row]:
    inputs, dout = make_inputs(T, H, KV, D, dtype, device)
    doc_ids = make_doc_ids(T, doc_len, device) if doc_mode == "many" else None
    flops, tol, cot = attention_flops(T, H, D, doc_ids), TOLERANCE[dtype], [dout]
    ref32 = [t.detach().float().requires_grad_() for t in inputs]
    ref_out, ref_grads = _fwd_bwd(lambda *x: gated_attention_reference(*x, doc_ids=doc_ids), ref32, [dout.float()])
    ref = ref_out + ref_grads
    rows, live = [], {}
    for name, fn in candidates(device).items():
        row = Row("attention", f"T{T} D{D} H{H}/{KV} docs {doc_mode}", name,
                  extra=dict(seq=T, head_dim=D, docs=doc_mode, flops=flops))
        rows.append(row)
        if not callable(fn):
            row.note = f"unavailable: {fn}"
            continue
        bound = lambda *x, f=fn: f(*x, doc_ids)  # noqa: E731
        try:
            out, grads = _fwd_bwd(bound, inputs, cot)
        except Exception as e:  # e.g. SDPA on nested tensors has no causal CPU path
            row.note = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
            continue
        errs = row.extra["errors"] = _errors(out + grads, ref)
        row.max_err = max(errs.values())
        bad = ", ".join(f"{n} {e:.1e}" for n, e in errs.items() if not e <= tol)
        if bad:  # timing something that computes another function would be meaningless
            row.note = f"not timed: disagrees with the reference ({bad} > {tol:g})"
            continue
        live[name] = bound
        if getattr(fn, "repeated", False):
            row.extra["kv_repeated"] = True
    for _ in range(warmup):
        for f in live.values():
            _timed(f, inputs, cot, device)
    times = {n: [] for n in live}
    for _ in range(repeats):
        for n, f in live.items():
            times[n].append(_timed(f, inputs, cot, device))
    for row in rows:
        if row.impl in live:
            row.seconds = statistics.median(times[row.impl])
            row.extra["tflops"] = flops / row.seconds / 1e12
            row.rate = f"{row.extra['tflops']:.3g} TFLOP/s"
            row.peak_mib = _peak_mib(live[row.impl], inputs, cot, device)
    return rows


def report(rows: list[Row]) -> str:
    tol = ", ".join(f"{str(d).removeprefix('torch.')} {t:g}" for d, t in TOLERANCE.items())
    lines = [
        "TFLOP/s: forward 4·D·H·pairs (q k^T and P v over the unmasked causal pairs, sum of L(L+1)/2 over "
        "documents), backward 2.5x forward. Peak: allocator peak of one fwd+bwd above the inputs (CUDA only). "
        "Error: max |x - ref| / max |ref| vs the float32 reference for out, dq, dk, dv, dgate (tolerance "
        f"{tol}). With documents, sdpa-flash+gate is SDPA's flash backend on jagged nested tensors (its "
        "varlen path; no mask), K/V repeated per query head (timed).",
        "",
        "| seq | head dim | docs | candidate | fwd+bwd ms | TFLOP/s (fwd 4·D·H·pairs + bwd 2.5x fwd) | peak MiB "
        "| triton speed-up | max rel. err (out, dq, dk, dv, dgate) |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    ours = {r.shape: r.seconds for r in rows if r.impl == ATT_OURS}
    for r in rows:
        x = r.extra
        errs = x.get("errors")
        err = f"{r.max_err:.1e} (" + ", ".join(f"{e:.0e}" for e in errs.values()) + ")" if errs else ""
        head = f"| {x['seq']} | {x['head_dim']} | {x['docs']} | {r.impl} |"
        if r.seconds is None:
            lines.append(f"{head} {r.note} | | | | {err} |")
            continue
        peak = f"{r.peak_mib:,.0f}" if r.peak_mib is not None else "-"
        base = ours.get(r.shape)
        speedup = f"{r.seconds / base:.2f}x" if base else "n/a"
        lines.append(f"{head} {r.seconds * 1e3:.3f} | {x['tflops']:.3g} | {peak} | {speedup} | {err} |")
    repeated = sorted({r.impl for r in rows if r.extra.get("kv_repeated")})
    if repeated:
        lines += ["", f"K/V repeated per query head (timed) for {', '.join(repeated)}: the backend refused enable_gqa."]
    return "\n".join(lines + [""] + fastest_verdicts(rows))


def fastest_verdicts(rows: list[Row]) -> list[str]:
    """Per shape: ours against the fastest timed SDPA backend + gate (target >= 1.1x its speed); per sequence
    and head dim with both document layouts: our time with documents over ours without (target <= 0.3)."""
    shapes: dict[tuple, list[Row]] = {}
    for r in rows:
        shapes.setdefault((r.extra["seq"], r.extra["head_dim"], r.extra["docs"]), []).append(r)
    out = []
    for (T, D, docs), rs in shapes.items():
        where = f"- attention T{T} D{D} {'no documents' if docs == 'none' else 'documents'}"
        ours = next((r for r in rs if r.impl == ATT_OURS and r.seconds), None)
        peers = [r for r in rs if r.impl in SDPA_PEERS and r.seconds]
        if ours is None or not peers:
            out.append(f"{where}: vs the fastest SDPA backend + gate not measured (ours or every SDPA backend "
                       f"has no time)")
            continue
        best = min(peers, key=lambda r: r.seconds)
        s = best.seconds / ours.seconds
        out.append(f"{where}: {s:.2f}x the fastest SDPA backend + gate ({best.impl}, {best.seconds * 1e3:.3f} ms; "
                   f"target >= {ATT_TARGET}: {'met' if s >= ATT_TARGET else 'NOT met'})")
    for (T, D, docs), rs in shapes.items():
        if docs != "many" or (T, D, "none") not in shapes:
            continue
        with_docs = next((r.seconds for r in rs if r.impl == ATT_OURS), None)
        without = next((r.seconds for r in shapes[(T, D, "none")] if r.impl == ATT_OURS), None)
        if with_docs and without:
            ratio = with_docs / without
            out.append(f"- attention T{T} D{D}: ours with documents {ratio:.2f}x ours without (target <= "
                       f"{DOCS_TARGET} at 512-token documents: {'met' if ratio <= DOCS_TARGET else 'NOT met'})")
    return out


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
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
    print(f"gated attention fwd+bwd, {args.dtype}, {args.heads} query / {args.kv_heads} kv heads, one packed row, "
          f"on {device_name(device)}, {time.strftime('%Y-%m-%d')}")
    print(report(rows))
    print("\n" + "\n".join(attention_verdicts(rows)))
    return rows


if __name__ == "__main__":
    main()
