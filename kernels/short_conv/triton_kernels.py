"""Triton short causal depthwise convolution + SiLU, forward and backward, at memory bandwidth.

    pre[t, c] = sum_{j<K} w[c, K-1-j] * xe[t-j, c] * same(t, t-j)      out = silu(pre)

xe is x extended on the left by ``past`` (K-1 rows, decoding) or zeros; same(t, u) says u is in t's
document (doc_ids), and the rows before x belong to x's first document (the call continues the cached
one, as the delta rule's state does; as the reference).

Shape of the work. A program owns BC channels of R chunks of L consecutive rows each (R chunks side by
side: one step advances all R by one row, so a step moves an [R, BC] tile) and walks its chunks row by row,
keeping the last K-1 inputs (and, backward, the last K-1 pre-activation gradients) in registers: every
input is read once from memory (plus K-1 halo rows per chunk, from the cache), every pre-activation and
sigmoid is computed once. K (1-4, as causal-conv1d) is a compile-time constant, so the window is K-1 named
registers that shift each step.

Backward, per row t of the walk (xs_j = xe[t-j] * same(t, t-j)):

    D(t)         = dy[t] * silu'(pre[t])                      zero outside [0, T) (dy is)
    dw[K-1-j]   += D(t) * xs_j                                for t in this chunk; per program partial sums,
                                                               summed by torch afterwards (no atomics:
                                                               deterministic)
    dxe[t-K+1]   = sum_m w[m] * D(t-m) * same(t-m, t-K+1)     complete once D(t) is known -> dx, or dpast
                                                               for the past rows (t-K+1 < 0)

so a chunk's walk runs L + K - 1 steps (the last K-1 compute the D(t) its final rows need). The previous
design recomputed pre at K shifted row tiles for every output tile (K^2 loads, K sigmoids per element) with
16-row tiles: ~200 SASS instructions per element, 128-158 registers for 256 threads (one block per SM), and
a weight-gradient partial per 16 rows: 2.9 ms a call on the H100 for a 200 MB input, 8% of copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.limits import MAX_K
from hybridtron.kernels.triton_utils import compute_dtype, fast_math, interpreted, sigmoid

R = 4  # chunks a program walks side by side
BC = 128  # channels per program: 256 contiguous bytes of bf16 per row
UNROLL = tl.constexpr(3)  # K-1 window steps per unrolled body: the window shifts become register renames
NUM_WARPS = 2  # [R, BC] = 512 elements: 8 per thread (one 16-byte load of bf16)


@triton.jit
def _row(X, PAST, b, t, c, mask_c, T, C, KM1: tl.constexpr, HAS_PAST: tl.constexpr):
    """xe at rows t (R,) and channels c (BC,) of sequence b, in x's dtype (past is rounded to it, as the
    reference does): x for 0 <= t < T, past for -(K-1) <= t < 0, else 0."""
    in_x = (t >= 0) & (t < T)
    v = tl.load(X + ((b * T + t).to(tl.int64) * C)[:, None] + c[None, :], mask=in_x[:, None] & mask_c[None, :],
                other=0.0)
    if HAS_PAST:
        in_p = (t < 0) & (t >= -KM1)
        v += tl.load(PAST + ((b * KM1 + t + KM1).to(tl.int64) * C)[:, None] + c[None, :],
                     mask=in_p[:, None] & mask_c[None, :], other=0.0).to(X.dtype.element_ty)
    return v


@triton.jit
def _doc(DOC, b, t, T, HAS_DOC: tl.constexpr):
    """(R,) document id of row t; a past row (t < 0) carries x's first position's; rows past T any valid id
    (nothing they hold is used)."""
    if HAS_DOC:
        return tl.load(DOC + b.to(tl.int64) * T + tl.minimum(tl.maximum(t, 0), T - 1))
    else:
        return t * 0


@triton.jit
def _same(x, d, d0, HAS_DOC: tl.constexpr):
    """x (R, BC) where its row's document d (R,) is d0's, else 0."""
    if HAS_DOC:
        return tl.where((d == d0)[:, None], x, 0.0)
    else:
        return x


@triton.jit
def _short_conv_fwd_kernel(X, PAST, W, DOC, OUT, T, C, L, K: tl.constexpr, HAS_PAST: tl.constexpr,
                           HAS_DOC: tl.constexpr, COMPUTE: tl.constexpr, FAST: tl.constexpr, R: tl.constexpr,
                           BC: tl.constexpr):
    b = tl.program_id(2)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = c < C
    a = tl.program_id(0) * (R * L) + tl.arange(0, R) * L  # the R chunks' first rows
    # taps: w_j multiplies xe[t - j]
    w0 = tl.load(W + c * K + (K - 1), mask=mask_c, other=0.0).to(COMPUTE)[None, :]
    x1 = tl.zeros((R, BC), COMPUTE)
    x2 = tl.zeros((R, BC), COMPUTE)
    x3 = tl.zeros((R, BC), COMPUTE)
    d1 = _doc(DOC, b, a, T, HAS_DOC)
    d2 = d1
    d3 = d1
    if K > 1:
        w1 = tl.load(W + c * K + (K - 2), mask=mask_c, other=0.0).to(COMPUTE)[None, :]
        x1 = _row(X, PAST, b, a - 1, c, mask_c, T, C, K - 1, HAS_PAST).to(COMPUTE)
        d1 = _doc(DOC, b, a - 1, T, HAS_DOC)
    if K > 2:
        w2 = tl.load(W + c * K + (K - 3), mask=mask_c, other=0.0).to(COMPUTE)[None, :]
        x2 = _row(X, PAST, b, a - 2, c, mask_c, T, C, K - 1, HAS_PAST).to(COMPUTE)
        d2 = _doc(DOC, b, a - 2, T, HAS_DOC)
    if K > 3:
        w3 = tl.load(W + c * K, mask=mask_c, other=0.0).to(COMPUTE)[None, :]
        x3 = _row(X, PAST, b, a - 3, c, mask_c, T, C, K - 1, HAS_PAST).to(COMPUTE)
        d3 = _doc(DOC, b, a - 3, T, HAS_DOC)
    # rows t+1 and t+2 are in flight while row t is computed (two steps of latency hidden per program)
    xr = _row(X, PAST, b, a, c, mask_c, T, C, K - 1, HAS_PAST)
    xr1 = _row(X, PAST, b, a + 1, c, mask_c, T, C, K - 1, HAS_PAST)
    for i in tl.range(L, loop_unroll_factor=UNROLL):
        t = a + i
        xr2 = _row(X, PAST, b, t + 2, c, mask_c, T, C, K - 1, HAS_PAST)
        x0 = xr.to(COMPUTE)
        d0 = _doc(DOC, b, t, T, HAS_DOC)
        pre = w0 * x0
        if K > 1:
            pre += w1 * _same(x1, d1, d0, HAS_DOC)
        if K > 2:
            pre += w2 * _same(x2, d2, d0, HAS_DOC)
        if K > 3:
            pre += w3 * _same(x3, d3, d0, HAS_DOC)
        offs = ((b * T + t).to(tl.int64) * C)[:, None] + c[None, :]
        tl.store(OUT + offs, (pre * sigmoid(pre, FAST)).to(OUT.dtype.element_ty),
                 mask=(t < T)[:, None] & mask_c[None, :])
        xr = xr1
        xr1 = xr2
        x3 = x2
        x2 = x1
        x1 = x0
        d3 = d2
        d2 = d1
        d1 = d0


@triton.jit
def _short_conv_bwd_kernel(X, PAST, W, DOC, DY, DX, DPAST, DW_PART, T, C, L, K: tl.constexpr, P: tl.constexpr,
                           HAS_PAST: tl.constexpr, HAS_DOC: tl.constexpr, COMPUTE: tl.constexpr, FAST: tl.constexpr,
                           R: tl.constexpr, BC: tl.constexpr):
    # Rows run over [-P, T): P = K-1 past rows when past is given (their gradient goes to DPAST), else 0.
    g = tl.program_id(0)
    b = tl.program_id(2)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = c < C
    a = g * (R * L) - P + tl.arange(0, R) * L
    end = a + L
    w0 = tl.load(W + c * K + (K - 1), mask=mask_c, other=0.0).to(COMPUTE)[None, :]
    x1 = tl.zeros((R, BC), COMPUTE)
    x2 = tl.zeros((R, BC), COMPUTE)
    x3 = tl.zeros((R, BC), COMPUTE)
    D1 = tl.zeros((R, BC), COMPUTE)  # D(t-1), D(t-2), D(t-3)
    D2 = tl.zeros((R, BC), COMPUTE)
    D3 = tl.zeros((R, BC), COMPUTE)
    acc0 = tl.zeros((R, BC), COMPUTE)  # dw of tap j, summed over this program's rows
    acc1 = tl.zeros((R, BC), COMPUTE)
    acc2 = tl.zeros((R, BC), COMPUTE)
    acc3 = tl.zeros((R, BC), COMPUTE)
    d1 = _doc(DOC, b, a, T, HAS_DOC)
    d2 = d1
    d3 = d1
    if K > 1:
        w1 = tl.load(W + c * K + (K - 2), mask=mask_c, other=0.0).to(COMPUTE)[None, :]
        x1 = _row(X, PAST, b, a - 1, c, mask_c, T, C, K - 1, HAS_PAST).to(COMPUTE)
        d1 = _doc(DOC, b, a - 1, T, HAS_DOC)
    if K > 2:
        w2 = tl.load(W + c * K + (K - 3), mask=mask_c, other=0.0).to(COMPUTE)[None, :]
        x2 = _row(X, PAST, b, a - 2, c, mask_c, T, C, K - 1, HAS_PAST).to(COMPUTE)
        d2 = _doc(DOC, b, a - 2, T, HAS_DOC)
    if K > 3:
        w3 = tl.load(W + c * K, mask=mask_c, other=0.0).to(COMPUTE)[None, :]
        x3 = _row(X, PAST, b, a - 3, c, mask_c, T, C, K - 1, HAS_PAST).to(COMPUTE)
        d3 = _doc(DOC, b, a - 3, T, HAS_DOC)
    # rows t+1 and t+2 are in flight while row t is computed (two steps of latency hidden per program)
    xr = _row(X, PAST, b, a, c, mask_c, T, C, K - 1, HAS_PAST)
    dyr = _row(DY, DY, b, a, c, mask_c, T, C, K - 1, False)
    xr1 = _row(X, PAST, b, a + 1, c, mask_c, T, C, K - 1, HAS_PAST)
    dyr1 = _row(DY, DY, b, a + 1, c, mask_c, T, C, K - 1, False)
    for i in tl.range(L + K - 1, loop_unroll_factor=UNROLL):
        t = a + i
        xr2 = _row(X, PAST, b, t + 2, c, mask_c, T, C, K - 1, HAS_PAST)
        dyr2 = _row(DY, DY, b, t + 2, c, mask_c, T, C, K - 1, False)
        x0 = xr.to(COMPUTE)
        dy = dyr.to(COMPUTE)
        d0 = _doc(DOC, b, t, T, HAS_DOC)
        pre = w0 * x0
        if K > 1:
            xs1 = _same(x1, d1, d0, HAS_DOC)
            pre += w1 * xs1
        if K > 2:
            xs2 = _same(x2, d2, d0, HAS_DOC)
            pre += w2 * xs2
        if K > 3:
            xs3 = _same(x3, d3, d0, HAS_DOC)
            pre += w3 * xs3
        sig = sigmoid(pre, FAST)
        D0 = dy * sig * (1.0 + pre * (1.0 - sig))
        Do = tl.where((t < end)[:, None], D0, 0.0)  # rows of this chunk only: each row's dw counted once
        acc0 += Do * x0
        if K > 1:
            acc1 += Do * xs1
        if K > 2:
            acc2 += Do * xs2
        if K > 3:
            acc3 += Do * xs3
        # dxe at s = t - (K-1): the window's oldest row, fed by D(s + m') with weight w_{K-1-m'} (m' = 0..K-1)
        s = t - (K - 1)
        if K == 1:
            dxe = w0 * D0
        elif K == 2:
            dxe = w0 * D1 + w1 * _same(D0, d0, d1, HAS_DOC)
        elif K == 3:
            dxe = w0 * D2 + w1 * _same(D1, d1, d2, HAS_DOC) + w2 * _same(D0, d0, d2, HAS_DOC)
        else:
            dxe = (w0 * D3 + w1 * _same(D2, d2, d3, HAS_DOC) + w2 * _same(D1, d1, d3, HAS_DOC)
                   + w3 * _same(D0, d0, d3, HAS_DOC))
        keep = (i >= K - 1) & (s < T)
        soffs = ((b * T + s).to(tl.int64) * C)[:, None] + c[None, :]
        tl.store(DX + soffs, dxe.to(DX.dtype.element_ty), mask=(keep & (s >= 0))[:, None] & mask_c[None, :])
        if HAS_PAST:
            poffs = ((b * (K - 1) + s + (K - 1)).to(tl.int64) * C)[:, None] + c[None, :]
            tl.store(DPAST + poffs, dxe.to(DPAST.dtype.element_ty), mask=(keep & (s < 0))[:, None] & mask_c[None, :])
        xr = xr1
        xr1 = xr2
        dyr = dyr1
        dyr1 = dyr2
        x3 = x2
        x2 = x1
        x1 = x0
        D3 = D2
        D2 = D1
        D1 = D0
        d3 = d2
        d2 = d1
        d1 = d0
    # partials laid out (part, K, C): each tap's row is contiguous in c
    part = DW_PART + (b * tl.num_programs(0) + g).to(tl.int64) * K * C
    tl.store(part + (K - 1) * C + c, tl.sum(acc0, axis=0), mask=mask_c)
    if K > 1:
        tl.store(part + (K - 2) * C + c, tl.sum(acc1, axis=0), mask=mask_c)
    if K > 2:
        tl.store(part + (K - 3) * C + c, tl.sum(acc2, axis=0), mask=mask_c)
    if K > 3:
        tl.store(part + c, tl.sum(acc3, axis=0), mask=mask_c)


def _chunk_rows(rows: int, lanes: int, device: torch.device) -> int:
    """L, rows per chunk: long enough that the K-1 halo rows a chunk rereads and recomputes stay a small
    fraction (3/32 at L 32), short enough for >= 4 waves of the ~4 backward programs an H100 SM holds
    (132 SMs): B1 T8192 C6144 gets L 32 (3072 programs), B4 T4096 L 64. The interpreter gets 4, so tiny
    test shapes cross chunks and program groups."""
    if interpreted(device):
        return 4
    for L in (64, 32):
        if triton.cdiv(rows, R * L) * lanes >= 4 * 4 * 132:
            return L
    return 16


def _check_k(K: int) -> None:
    if not 1 <= K <= MAX_K:
        raise ValueError(f"short_conv: the Triton kernel takes filter widths 1-{MAX_K}, not {K}; choose "
                         f"model.kernels.conv=reference for wider filters")


def short_conv_fwd(x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None,
                   past: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, C), w (C, K), doc_ids (B, T) int64 or None, past (B, K-1, C) or None; all contiguous."""
    B, T, C = x.shape
    K = w.shape[1]
    _check_k(K)
    out = torch.empty_like(x)  # x's dtype: under autocast the activation dtype, as conv1d gives
    if out.numel() == 0:
        return out
    check_interpreted(_short_conv_fwd_kernel, x.device)
    compute = compute_dtype(x, w, past)
    n_cb = triton.cdiv(C, BC)
    L = _chunk_rows(B * T, n_cb, x.device)
    grid = (triton.cdiv(T, R * L), n_cb, B)
    _short_conv_fwd_kernel[grid](x, past if past is not None else x, w, doc_ids if doc_ids is not None else x, out,
                                 T, C, L, K=K, HAS_PAST=past is not None, HAS_DOC=doc_ids is not None,
                                 COMPUTE=compute, FAST=fast_math(x.device, compute), R=R, BC=BC,
                                 num_warps=NUM_WARPS)
    return out


def short_conv_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None,
                   past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx like x, dw like w, dpast like past or an empty tensor)."""
    B, T, C = x.shape
    K = w.shape[1]
    _check_k(K)
    dx = torch.empty_like(x)
    dpast = torch.empty_like(past) if past is not None else x.new_empty(0)
    P = K - 1 if past is not None else 0
    if B * (T + P) * C == 0:
        return dx.zero_(), torch.zeros_like(w), dpast.zero_()
    check_interpreted(_short_conv_bwd_kernel, x.device)
    compute = compute_dtype(x, w, past, dy)
    n_cb = triton.cdiv(C, BC)
    L = _chunk_rows(B * (T + P), n_cb, x.device)
    n_g = triton.cdiv(T + P, R * L)
    part = torch.empty(B * n_g, K, C, dtype=torch.float64 if compute == tl.float64 else torch.float32,
                       device=x.device)
    grid = (n_g, n_cb, B)
    _short_conv_bwd_kernel[grid](x, past if past is not None else x, w, doc_ids if doc_ids is not None else x, dy,
                                 dx, dpast, part, T, C, L, K=K, P=P, HAS_PAST=past is not None,
                                 HAS_DOC=doc_ids is not None, COMPUTE=compute, FAST=fast_math(x.device, compute), R=R, BC=BC,
                                 num_warps=NUM_WARPS)
    return dx, part.sum(0).t().to(w.dtype).contiguous(), dpast
