"""Triton short causal depthwise convolution + SiLU, forward and backward.

    pre[t, c] = sum_{j<K} w[c, K-1-j] * xe[t-j, c] * same(t, t-j)      out = silu(pre)

xe is x extended on the left by ``past`` (K-1 rows, decoding) or zeros; same(t, u) says u is in t's
document (doc_ids), and the rows before x belong to x's first document (the call continues the cached
one, as the delta rule's state does; as the reference).
Tiles are [BT positions, BC channels] of one sequence; K is a compile-time constant (2-4 in practice), so
the taps unroll and every shifted load of a tile hits the cache lines the previous tap brought in.

Forward writes only ``out`` (pre-activation not kept: the backward recomputes it from x, K loads per tile).
Backward, per tile of input rows s (s < 0 are the past rows, present only when past is given):

    D(t)        = dy[t] * silu'(pre[t])                               for 0 <= t < T, else 0
    dxe[s]      = sum_i w[K-1-i] * D(s+i) * same(s+i, s)              -> dx (s >= 0) or dpast (s < 0)
    dw[K-1-i]  += sum_s D(s) * xe[s-i] * same(s, s-i)                 per-tile partial sums (no atomics:
                                                                       summed by torch afterwards, deterministic)

D(s+i) needs pre at K shifted rows, so a backward tile reads x K*K times (from cache) and writes dx once;
unfused, torch keeps pre (or silu's input) as one more activation and reads it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import check_interpreted
from ..triton_utils import compute_dtype, next_pow2, warps

BT = 16  # positions per tile


@triton.jit
def _load_xe(X, PAST, DOC, b, p, c, mask_c, T, C, KM1: tl.constexpr, HAS_PAST: tl.constexpr,
             COMPUTE: tl.constexpr):
    """xe at positions p (BT,) and channels c (BC,) of sequence b: x for 0 <= p < T, past for -(K-1) <= p < 0."""
    in_x = (p >= 0) & (p < T)
    offs = (b * T + p).to(tl.int64)[:, None] * C + c[None, :]
    v = tl.load(X + offs, mask=in_x[:, None] & mask_c[None, :], other=0.0).to(COMPUTE)
    if HAS_PAST:
        in_p = (p < 0) & (p >= -KM1)
        poffs = (b * KM1 + p + KM1).to(tl.int64)[:, None] * C + c[None, :]
        v += tl.load(PAST + poffs, mask=in_p[:, None] & mask_c[None, :], other=0.0).to(COMPUTE)
    return v


@triton.jit
def _same(DOC, b, t, u, T, HAS_DOC: tl.constexpr):
    """(BT,) bool: input position u (<= t) may feed output position t; False for t outside [0, T)."""
    if HAS_DOC:
        valid = (t >= 0) & (t < T)
        dt = tl.load(DOC + b.to(tl.int64) * T + t, mask=valid, other=-1)
        uu = tl.maximum(u, 0)  # a past row (u < 0) carries the id of x's first position
        du = tl.load(DOC + b.to(tl.int64) * T + uu, mask=uu < T, other=-2)
        return (dt == du) & valid
    else:
        return u == u


@triton.jit
def _pre(X, PAST, W, DOC, b, t, c, mask_c, T, C, K: tl.constexpr, HAS_PAST: tl.constexpr,
         HAS_DOC: tl.constexpr, COMPUTE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Pre-activation at output positions t (BT,), channels c: sum_j w[c, K-1-j] * xe[t-j] * same(t, t-j)."""
    acc = tl.zeros((BT, BC), dtype=COMPUTE)
    for j in tl.static_range(K):
        w = tl.load(W + c * K + (K - 1 - j), mask=mask_c, other=0.0).to(COMPUTE)
        xv = _load_xe(X, PAST, DOC, b, t - j, c, mask_c, T, C, K - 1, HAS_PAST, COMPUTE)
        if HAS_DOC:
            xv = tl.where(_same(DOC, b, t, t - j, T, HAS_DOC)[:, None], xv, 0.0)
        acc += w[None, :] * xv
    return acc


@triton.jit
def _short_conv_fwd_kernel(X, PAST, W, DOC, OUT, T, C, K: tl.constexpr, HAS_PAST: tl.constexpr,
                           HAS_DOC: tl.constexpr, COMPUTE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    mask_c = c < C
    pre = _pre(X, PAST, W, DOC, b, t, c, mask_c, T, C, K, HAS_PAST, HAS_DOC, COMPUTE, BT, BC)
    offs = (b * T + t).to(tl.int64)[:, None] * C + c[None, :]
    tl.store(OUT + offs, (pre * tl.sigmoid(pre)).to(OUT.dtype.element_ty), mask=(t < T)[:, None] & mask_c[None, :])


@triton.jit
def _dpre(X, PAST, W, DOC, DY, b, t, c, mask_c, T, C, K: tl.constexpr, HAS_PAST: tl.constexpr,
          HAS_DOC: tl.constexpr, COMPUTE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dy * silu'(pre) at output positions t (zero outside [0, T))."""
    pre = _pre(X, PAST, W, DOC, b, t, c, mask_c, T, C, K, HAS_PAST, HAS_DOC, COMPUTE, BT, BC)
    valid = (t >= 0) & (t < T)
    offs = (b * T + t).to(tl.int64)[:, None] * C + c[None, :]
    dy = tl.load(DY + offs, mask=valid[:, None] & mask_c[None, :], other=0.0).to(COMPUTE)
    sig = tl.sigmoid(pre)
    return dy * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def _short_conv_bwd_kernel(X, PAST, W, DOC, DY, DX, DPAST, DW_PART, T, C, n_tb,
                           K: tl.constexpr, P: tl.constexpr, HAS_PAST: tl.constexpr, HAS_DOC: tl.constexpr,
                           COMPUTE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # Rows s run over [-P, T): P = K-1 past rows when past is given (their gradient goes to DPAST), else 0.
    tb = tl.program_id(0)
    s = tb * BT - P + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    mask_c = c < C
    dxe = tl.zeros((BT, BC), dtype=COMPUTE)
    d0 = tl.zeros((BT, BC), dtype=COMPUTE)
    for i in tl.static_range(K):
        d = _dpre(X, PAST, W, DOC, DY, b, s + i, c, mask_c, T, C, K, HAS_PAST, HAS_DOC, COMPUTE, BT, BC)
        if i == 0:
            d0 = d
        if HAS_DOC:
            d = tl.where(_same(DOC, b, s + i, s, T, HAS_DOC)[:, None], d, 0.0)
        w = tl.load(W + c * K + (K - 1 - i), mask=mask_c, other=0.0).to(COMPUTE)
        dxe += w[None, :] * d
    in_x = (s >= 0) & (s < T)
    offs = (b * T + s).to(tl.int64)[:, None] * C + c[None, :]
    tl.store(DX + offs, dxe.to(DX.dtype.element_ty), mask=in_x[:, None] & mask_c[None, :])
    if HAS_PAST:
        poffs = (b * (K - 1) + s + (K - 1)).to(tl.int64)[:, None] * C + c[None, :]
        tl.store(DPAST + poffs, dxe.to(DPAST.dtype.element_ty), mask=(s < 0)[:, None] & mask_c[None, :])
    # Weight gradient of this tile: rows s in [0, T) as outputs (d0 is zero elsewhere).
    part = (b * n_tb + tb).to(tl.int64) * K * C
    for i in tl.static_range(K):
        xv = _load_xe(X, PAST, DOC, b, s - i, c, mask_c, T, C, K - 1, HAS_PAST, COMPUTE)
        if HAS_DOC:
            xv = tl.where(_same(DOC, b, s, s - i, T, HAS_DOC)[:, None], xv, 0.0)
        tl.store(DW_PART + part + c * K + (K - 1 - i), tl.sum(d0 * xv, axis=0), mask=mask_c)


def _tiles(C: int) -> int:
    return min(next_pow2(C), 128)


def short_conv_fwd(x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None,
                   past: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, C), w (C, K), doc_ids (B, T) int64 or None, past (B, K-1, C) or None; all contiguous."""
    B, T, C = x.shape
    K = w.shape[1]
    out = torch.empty_like(x)  # x's dtype: under autocast the activation dtype, as conv1d gives
    if out.numel() == 0:
        return out
    check_interpreted(_short_conv_fwd_kernel, x.device)
    BC = _tiles(C)
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC), B)
    _short_conv_fwd_kernel[grid](x, past if past is not None else x, w, doc_ids if doc_ids is not None else x, out,
                                 T, C, K=K, HAS_PAST=past is not None, HAS_DOC=doc_ids is not None,
                                 COMPUTE=compute_dtype(x, w, past), BT=BT, BC=BC, num_warps=warps(BT * BC))
    return out


def short_conv_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None,
                   past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx like x, dw like w, dpast like past or an empty tensor)."""
    B, T, C = x.shape
    K = w.shape[1]
    dx = torch.empty_like(x)
    dpast = torch.empty_like(past) if past is not None else x.new_empty(0)
    P = K - 1 if past is not None else 0
    n_tb = triton.cdiv(T + P, BT)
    if B * (T + P) * C == 0:
        return dx.zero_(), torch.zeros_like(w), dpast.zero_()
    check_interpreted(_short_conv_bwd_kernel, x.device)
    compute = compute_dtype(x, w, past, dy)
    part = torch.empty(B * n_tb, C, K, dtype=torch.float64 if compute == tl.float64 else torch.float32,
                       device=x.device)
    BC = _tiles(C)
    grid = (n_tb, triton.cdiv(C, BC), B)
    _short_conv_bwd_kernel[grid](x, past if past is not None else x, w, doc_ids if doc_ids is not None else x, dy,
                                 dx, dpast, part, T, C, n_tb, K=K, P=P, HAS_PAST=past is not None,
                                 HAS_DOC=doc_ids is not None, COMPUTE=compute, BT=BT, BC=BC,
                                 num_warps=warps(BT * BC))
    return dx, part.sum(0).to(w.dtype), dpast
