"""One step of ring attention: a block of queries against a block of keys and values, with the log-sum-exp, by
the backend the model chose; and the gradients of that block's share of a result merged over several blocks.

Ring attention (train/parallel/context_parallel.py) computes a query block's attention one key block at a time
and merges the partial results by their log-sum-exp. Its backward needs, per block, the gradients of the block's
share of the merged output: that is flash attention's backward run with the *merged* output and log-sum-exp in
place of the block's own (it recomputes P = exp(s - lse) and Delta = rowsum(dO * O) from them), so every
backend here is a (forward, backward) pair of that kind. No block's scores are kept, and only the reference
forms them.

Two kinds of block:

- **causal**: the queries' own keys (t == s), causal, within documents (``docs``: runs of equal ids, `Docs`).
- **full**: every query sees every key (a block from earlier in the sequence, which ring attention has already
  cut to the document that crosses into the queries' block: a rectangle, no mask).

Backends (``RING_BACKENDS``):

- ``reference``: explicit scores of the block in float32 at least (float64 stays float64): the pure-torch
  reference the others are tested against.
- ``sdpa``: torch's fused attention kernels that return the log-sum-exp (the ones torch's own context parallelism
  calls): on CUDA flash attention (float16 / bfloat16, head dims up to 256), on the CPU torch's CPU flash kernel
  (any float dtype: how CI runs it). These take no document bounds, and a mask would be t x t, so a causal block
  with documents runs as one call per document run (host-side run bounds, computed once per forward).
- ``triton``: our kernel (kernels/gated_attention/triton_kernels.py): documents as per-token bounds in its causal
  mode, full blocks in its non-causal mode.

Layouts: q (B, t, H, D), k and v (B, s, KV, D) with H a multiple of KV (query head h reads kv head h // (H / KV));
out (B, t, H, D) in the kernel's dtype; lse (B, H, t) float32 (float64 on the reference in float64), natural log,
-inf on a row that sees no key.
"""

from __future__ import annotations

import math

import torch

from hybridtron.kernels.backend import BackendError

RING_BACKENDS = ("reference", "sdpa", "triton")
LN2 = math.log(2.0)


class Docs:
    """The documents of a (B, t) block of queries that attends causally to itself: ``ids`` (B, t), a document
    being a run of equal ids within a row. What the backends need of them is derived once and kept (one host
    sync for the runs, shared by every layer of a forward and its backward)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self._runs: list[list[tuple[int, int]]] | None = None
        self._bounds: tuple[torch.Tensor, torch.Tensor] | None = None

    def runs(self) -> list[list[tuple[int, int]]]:
        """Per batch row, the [begin, end) of each run of equal ids (a host sync, once)."""
        if self._runs is None:
            B, t = self.ids.shape
            cut = torch.ones(B, t + 1, dtype=torch.bool, device=self.ids.device)
            cut[:, 1:t] = self.ids[:, 1:] != self.ids[:, :-1]
            edges: list[list[int]] = [[] for _ in range(B)]
            for b, c in cut.nonzero().tolist():
                edges[b].append(c)
            self._runs = [list(zip(e[:-1], e[1:], strict=True)) for e in edges]
        return self._runs

    def pieces(self):
        """(row, begin, end) of every run, row by row."""
        return ((b, s, e) for b, row in enumerate(self.runs()) for s, e in row)

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, end) int32 per token of the flattened (B * t) block (`doc_bounds`), on the device."""
        if self._bounds is None:
            from hybridtron.kernels.gated_attention.reference import doc_bounds

            B, t = self.ids.shape
            self._bounds = doc_bounds(B, t, doc_ids=self.ids)
        return self._bounds


def check_backend(backend: str) -> None:
    if backend not in RING_BACKENDS:
        raise BackendError(f"ring attention runs its blocks on {', '.join(RING_BACKENDS)}; got {backend!r}")


def forward(backend: str, q, k, v, *, causal: bool, scale: float, docs: Docs | None = None):
    """(out (B, t, H, D), lse (B, H, t)) of the block; ``docs`` only with ``causal``."""
    check_backend(backend)
    if q.shape[1] == 0 or k.shape[1] == 0:  # nothing to see: a zero output, -inf log-sum-exp
        B, t, H, D = q.shape
        return q.new_zeros(B, t, H, D), torch.full((B, H, t), float("-inf"), dtype=_lse_dtype(q), device=q.device)
    if backend == "reference":
        return _ref_forward(q, k, v, causal, scale, docs)
    if backend == "triton":
        return _triton_forward(q, k, v, causal, scale, docs)
    if docs is not None and causal:
        return _by_runs(lambda a, b, c: _sdpa_forward(a, b, c, True, scale), (q, k, v), docs)
    return _sdpa_forward(q, k, v, causal, scale)


def backward(backend: str, dout, q, k, v, out, lse, *, causal: bool, scale: float, docs: Docs | None = None):
    """(dq, dk, dv) of the block's share of the merged result whose output and log-sum-exp are ``out`` (B, t, H,
    D) and ``lse`` (B, H, t) for these queries: the gradient ``dout`` of that output propagated through this
    block's keys alone."""
    check_backend(backend)
    if q.shape[1] == 0 or k.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if backend == "reference":
        return _ref_backward(dout, q, k, v, out, lse, causal, scale, docs)
    if backend == "triton":
        return _triton_backward(dout, q, k, v, out, lse, causal, scale, docs)
    if docs is not None and causal:
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for b, s, e in docs.pieces():
            piece = [t[b:b + 1, s:e] for t in (dout, q, k, v, out)]
            for g, d in zip(grads, _sdpa_backward(*piece, lse[b:b + 1, :, s:e], True, scale), strict=True):
                g[b:b + 1, s:e] = d
        return tuple(grads)
    return _sdpa_backward(dout, q, k, v, out, lse, causal, scale)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _by_runs(fn, qkv, docs: Docs):
    """A causal block with documents as one causal call per document run (row by row)."""
    q = qkv[0]
    B, t, H, D = q.shape
    out = q.new_zeros(B, t, H, D)
    lse = torch.full((B, H, t), float("-inf"), dtype=_lse_dtype(q), device=q.device)
    for b, s, e in docs.pieces():
        out[b:b + 1, s:e], lse[b:b + 1, :, s:e] = fn(*(x[b:b + 1, s:e] for x in qkv))
    return out, lse


# ---- reference --------------------------------------------------------------------------------------------------
def _ref_scores(q, k, causal: bool, scale: float, docs: Docs | None):
    """(qh (B, H, t, D), kh (B, H, s, D), masked scores (B, H, t, s)) in float32 at least."""
    f = _lse_dtype(q)
    group = q.shape[2] // k.shape[2]
    qh = q.to(f).transpose(1, 2)
    kh = k.to(f).transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        t = q.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None, None]
        if docs is not None:
            mask = mask & (docs.ids[:, None, :, None] == docs.ids[:, None, None, :])
        s = s.masked_fill(~mask, float("-inf"))
    return qh, kh, s


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), 0.0, lse)[..., None]


def _ref_forward(q, k, v, causal, scale, docs):
    qh, kh, s = _ref_scores(q, k, causal, scale, docs)
    vh = v.to(qh.dtype).transpose(1, 2).repeat_interleave(qh.shape[1] // v.shape[2], dim=1)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, t)
    out = torch.exp(s - _safe(lse)) @ vh
    return out.transpose(1, 2), lse


def _ref_backward(dout, q, k, v, out, lse, causal, scale, docs):
    qh, kh, s = _ref_scores(q, k, causal, scale, docs)
    KV, group = k.shape[2], q.shape[2] // k.shape[2]
    vh = v.to(qh.dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    p = torch.exp(s - _safe(lse.to(qh.dtype)))
    do = dout.to(qh.dtype).transpose(1, 2)
    delta = (do * out.to(qh.dtype).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (do @ vh.transpose(-1, -2) - delta)
    dq = (ds @ kh) * scale
    B, H, s_len, D = kh.shape
    dk = ((ds.transpose(-1, -2) @ qh) * scale).view(B, KV, group, s_len, D).sum(2)
    dv = (p.transpose(-1, -2) @ do).view(B, KV, group, s_len, D).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---- sdpa -------------------------------------------------------------------------------------------------------
def _heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, s, KV, D) -> (B, KV * group, s, D): these kernels take no grouped-query heads, so kv heads repeat."""
    return x.transpose(1, 2).repeat_interleave(group, dim=1) if group > 1 else x.transpose(1, 2)


def _sum_heads(x: torch.Tensor, kv: int) -> torch.Tensor:
    """(B, H, s, D) gradients per query head -> (B, s, KV, D)."""
    B, H, s, D = x.shape
    return x.reshape(B, kv, H // kv, s, D).sum(2).transpose(1, 2)


def _sdpa_ok(q: torch.Tensor) -> None:
    if q.device.type == "cuda" and (q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256
                                    or q.shape[-1] % 8):
        raise BackendError(
            f"ring attention (sdpa): torch's flash kernel takes float16/bfloat16 with head_dim a multiple of 8 up to "
            f"256; got {q.dtype}, head_dim={q.shape[-1]}. Train in bf16 (autocast), or use "
            f"model.kernels.attention=triton or reference")


def _sdpa_forward(q, k, v, causal, scale):
    _sdpa_ok(q)
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), _heads(k, group), _heads(v, group)
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse.to(_lse_dtype(q))


def _sdpa_backward(dout, q, k, v, out, lse, causal, scale):
    _sdpa_ok(q)
    KV, group = k.shape[2], q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), _heads(k, group), _heads(v, group)
    do, oh = dout.to(q.dtype).transpose(1, 2), out.to(q.dtype).transpose(1, 2)
    lse = lse.to(_lse_dtype(q)).contiguous()  # (a strided log-sum-exp gives wrong gradients in these kernels)
    if q.device.type == "cuda":
        t, s = q.shape[1], k.shape[1]
        empty = torch.empty(0, dtype=torch.int32, device=q.device)
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the kernel never reads them
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, qh, kh, vh, oh, lse, empty, empty, t, s, 0.0, causal, seed, seed, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, qh, kh, vh, oh, lse, 0.0, causal, scale=scale)
    return dq.transpose(1, 2), _sum_heads(dk, KV), _sum_heads(dv, KV)


# ---- triton -----------------------------------------------------------------------------------------------------
# Custom ops, opaque to torch.compile and with fake implementations, as op.py's: the memory planner's fake run
# (train/plan/memory.py) takes this path with fake tensors, which the launchers cannot take.
@torch.library.custom_op("hybridtron::attention_block_fwd", mutates_args=())
def _block_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor | None, scale: float,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_attention.triton_kernels import attn_fwd

    out, _, lse2 = attn_fwd(q, k, v, None, start, scale, causal=causal)
    return out, lse2


@_block_fwd.register_fake
def _(q, k, v, start, scale, causal):
    N, H, D = q.shape
    return q.new_empty((N, H, D)), q.new_empty((H, N), dtype=torch.float32)


@torch.library.custom_op("hybridtron::attention_block_bwd", mutates_args=())
def _block_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse2: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor | None, scale: float,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_attention.triton_kernels import attn_bwd

    dq, dk, dv, _ = attn_bwd(dout, q, k, v, None, out, lse2, start, end, scale, causal=causal)
    return dq, dk, dv


@_block_bwd.register_fake
def _(dout, q, k, v, out, lse2, start, end, scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _triton_inputs(*ts: torch.Tensor) -> list[torch.Tensor]:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1 or ts[0].dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise BackendError(f"ring attention (triton): q, k, v must share one dtype of float16, bfloat16, float32; got "
                           f"{sorted(str(d) for d in dtypes)}. Train under autocast, or use "
                           f"model.kernels.attention=reference")
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _triton_forward(q, k, v, causal, scale, docs):
    B, t, H, D = q.shape
    q, k, v = _triton_inputs(q, k, v)
    if causal:  # the rows (and their documents) packed into one sequence: documents as per-token bounds
        start = docs.bounds()[0] if docs is not None else _row_bounds(B, t, q.device)[0]
        out, lse2 = _block_fwd(*(x.reshape(B * t, *x.shape[2:]) for x in (q, k, v)), start, scale, True)
        return out.view(B, t, H, D), (lse2.view(H, B, t).transpose(0, 1) * LN2).contiguous()
    outs, lses = [], []
    for b in range(B):  # every query sees every key of its own row only: one call per row
        o, lse2 = _block_fwd(q[b], k[b], v[b], None, scale, False)
        outs.append(o)
        lses.append(lse2 * LN2)
    return torch.stack(outs), torch.stack(lses)


def _triton_backward(dout, q, k, v, out, lse, causal, scale, docs):
    B, t, H, D = q.shape
    q, k, v = _triton_inputs(q, k, v)
    lse2 = lse.float() / LN2  # (B, H, t), base 2 as the kernel keeps it
    if causal:
        start, end = docs.bounds() if docs is not None else _row_bounds(B, t, q.device)
        flat = [x.reshape(B * t, *x.shape[2:]).contiguous() for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype))]
        dq, dk, dv = _block_bwd(*flat[:4], flat[4], lse2.transpose(0, 1).reshape(H, B * t).contiguous(), start, end,
                                scale, True)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    grads = [[], [], []]
    for b in range(B):
        d = _block_bwd(dout[b].to(q.dtype).contiguous(), q[b], k[b], v[b], out[b].to(q.dtype).contiguous(),
                       lse2[b].contiguous(), None, None, scale, False)
        for g, x in zip(grads, d, strict=True):
            g.append(x)
    return tuple(torch.stack(g) for g in grads)


def _row_bounds(B: int, t: int, device):
    from hybridtron.kernels.gated_attention.reference import doc_bounds

    return doc_bounds(B, t, device=device)
