"""Triton kernels of the gathered sparse attention (reference.py): one program per query, which gathers its
S <= 64 keys once, and walks the value width E in tiles (E is the mixer's whole value width, up to thousands).

There is no reuse between queries (each has its own key list), so the work is a gather: per query S (D + E)
loads for 2 S (D + E) FLOPs; tensor cores cannot help. The backward recomputes the probabilities from q and
the gathered keys (cheaper than saving them: S D multiply-adds) and scatters the key and value gradients with
atomic adds into fp32 (fp64 in the tests) buffers, cast to k's and v's dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import compute_dtype, next_pow2


@triton.jit
def _probs(Q, K, IDX, b, t, T, L, S, D, scale, BS: tl.constexpr, BD: tl.constexpr, COMPUTE: tl.constexpr):
    """(p (BS,), key rows (BS,) int64, valid (BS,), q (BD,), gathered keys (BS, BD)) of query t of row b."""
    s = tl.arange(0, BS)
    d = tl.arange(0, BD)
    row = (b * T + t).to(tl.int64)
    ids = tl.load(IDX + row * S + s, mask=s < S, other=-1)
    valid = ids >= 0
    key = b.to(tl.int64) * L + tl.maximum(ids, 0).to(tl.int64)
    q = tl.load(Q + row * D + d, mask=d < D, other=0.0).to(COMPUTE)
    kg = tl.load(K + key[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0).to(COMPUTE)
    logit = tl.where(valid, tl.sum(kg * q[None, :], axis=1) * scale, float("-inf"))
    m = tl.max(logit, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key at all: every p is exp(-inf) = 0
    p = tl.exp(logit - m)
    total = tl.sum(p, axis=0)
    p = p / tl.where(total > 0, total, 1.0)
    return p, key, valid, q, kg


@triton.jit
def _hax_fwd_kernel(Q, K, V, IDX, OUT, T, L, S, D, E, scale, BS: tl.constexpr, BD: tl.constexpr,
                    BE: tl.constexpr, COMPUTE: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    p, key, valid, q, kg = _probs(Q, K, IDX, b, t, T, L, S, D, scale, BS, BD, COMPUTE)
    row = (b * T + t).to(tl.int64)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        vg = tl.load(V + key[:, None] * E + e[None, :], mask=valid[:, None] & (e < E)[None, :], other=0.0)
        o = tl.sum(p[:, None] * vg.to(COMPUTE), axis=0)
        tl.store(OUT + row * E + e, o.to(OUT.dtype.element_ty), mask=e < E)


@triton.jit
def _hax_bwd_kernel(Q, K, V, IDX, DO, DQ, DK, DV, T, L, S, D, E, scale, BS: tl.constexpr, BD: tl.constexpr,
                    BE: tl.constexpr, COMPUTE: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    p, key, valid, q, kg = _probs(Q, K, IDX, b, t, T, L, S, D, scale, BS, BD, COMPUTE)
    row = (b * T + t).to(tl.int64)
    dp = tl.zeros_like(p)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        me = e < E
        do = tl.load(DO + row * E + e, mask=me, other=0.0).to(COMPUTE)
        vg = tl.load(V + key[:, None] * E + e[None, :], mask=valid[:, None] & me[None, :], other=0.0).to(COMPUTE)
        dp += tl.sum(vg * do[None, :], axis=1)
        tl.atomic_add(DV + key[:, None] * E + e[None, :], p[:, None] * do[None, :], mask=valid[:, None] & me[None, :])
    ds = p * (dp - tl.sum(p * dp, axis=0))  # sum_s p_s dp_s = do . out
    d = tl.arange(0, BD)
    md = d < D
    dq = tl.sum(ds[:, None] * kg, axis=0) * scale
    tl.store(DQ + row * D + d, dq.to(DQ.dtype.element_ty), mask=md)
    tl.atomic_add(DK + key[:, None] * D + d[None, :], (ds * scale)[:, None] * q[None, :],
                  mask=valid[:, None] & md[None, :])


def _blocks(S: int, D: int, E: int) -> tuple[int, int, int]:
    BS, BD = next_pow2(S), next_pow2(D)
    return BS, BD, max(16, min(next_pow2(E), 8192 // BS))


def hax_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q (B, T, D), k (B, L, D), v (B, L, E), idx (B, T, S) int32; all contiguous -> (B, T, E) in q's dtype."""
    B, T, S = idx.shape
    L, D, E = k.shape[1], q.shape[-1], v.shape[-1]
    out = torch.empty(B, T, E, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if S == 0 or L == 0:
        return out.zero_()
    check_interpreted(_hax_fwd_kernel, q.device)
    BS, BD, BE = _blocks(S, D, E)
    _hax_fwd_kernel[(T, B)](q, k, v, idx, out, T, L, S, D, E, scale, BS=BS, BD=BD, BE=BE,
                            COMPUTE=compute_dtype(q, k, v), num_warps=4)
    return out


def hax_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq like q, dk like k, dv like v)."""
    B, T, S = idx.shape
    L, D, E = k.shape[1], q.shape[-1], v.shape[-1]
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    if B * T and S and L and D and E:
        check_interpreted(_hax_bwd_kernel, q.device)
        BS, BD, BE = _blocks(S, D, E)
        _hax_bwd_kernel[(T, B)](q, k, v, idx, do, dq, dk, dv, T, L, S, D, E, scale, BS=BS, BD=BD, BE=BE,
                                COMPUTE=compute_dtype(q, k, v), num_warps=4)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
