"""Triton MoE token permute / unpermute, forward and backward, each a row gather (no atomics, so the
results do not depend on scheduling).

    gather   xs[r]  = x[order[r] // k]                        permute forward
    combine  y[n]   = sum_j ys[pos[n k + j]] (* w[n k + j])   unpermute forward (weights), permute backward
                                                              (dx[n] = sum of the k rows holding token n)
    scatter  dys[pos[a]] = dy[a // k] * w[a],                 unpermute backward: one pass over the
             dw[a]       = <dy[a // k], ys[pos[a]]>           assignments gives both gradients

Tiles are [rows, BD] with a loop over d in BD-wide strips; combine keeps the k rows' sum in fp32 and rounds
once. Unfused, torch's unpermute writes ys * w, an index_copy of it and the (N, k, d) view before summing:
three (N k, d) tensors where the kernel reads ys once and writes (N, d).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import compute_dtype, next_pow2, row_block, warps


@triton.jit
def _gather_kernel(X, ORDER, XS, R, D, K: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    mask_r = r < R
    src = (tl.load(ORDER + r, mask=mask_r, other=0) // K).to(tl.int64)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = mask_r[:, None] & (d < D)[None, :]
        v = tl.load(X + src[:, None] * D + d[None, :], mask=m, other=0.0)
        tl.store(XS + r.to(tl.int64)[:, None] * D + d[None, :], v, mask=m)


@triton.jit
def _combine_kernel(YS, POS, W, Y, N, D, K: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0) * BR + tl.arange(0, BR)
    mask_n = n < N
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = mask_n[:, None] & (d < D)[None, :]
        acc = tl.zeros((BR, BD), dtype=COMPUTE)
        for j in tl.static_range(K):
            a = n.to(tl.int64) * K + j
            row = tl.load(POS + a, mask=mask_n, other=0).to(tl.int64)
            v = tl.load(YS + row[:, None] * D + d[None, :], mask=m, other=0.0).to(COMPUTE)
            if HAS_W:
                v *= tl.load(W + a, mask=mask_n, other=0.0).to(COMPUTE)[:, None]
            acc += v
        tl.store(Y + n.to(tl.int64)[:, None] * D + d[None, :], acc.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd_kernel(DY, YS, POS, W, DYS, DW, R, D, K: tl.constexpr, COMPUTE: tl.constexpr,
                        BR: tl.constexpr, BD: tl.constexpr):
    a = tl.program_id(0) * BR + tl.arange(0, BR)  # assignments
    mask_a = a < R
    row = tl.load(POS + a, mask=mask_a, other=0).to(tl.int64)
    tok = (a // K).to(tl.int64)
    w = tl.load(W + a, mask=mask_a, other=0.0).to(COMPUTE)
    dw = tl.zeros((BR,), dtype=COMPUTE)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = mask_a[:, None] & (d < D)[None, :]
        dy = tl.load(DY + tok[:, None] * D + d[None, :], mask=m, other=0.0).to(COMPUTE)
        ys = tl.load(YS + row[:, None] * D + d[None, :], mask=m, other=0.0).to(COMPUTE)
        dw += tl.sum(dy * ys, axis=1)
        tl.store(DYS + row[:, None] * D + d[None, :], (dy * w[:, None]).to(DYS.dtype.element_ty), mask=m)
    tl.store(DW + a, dw.to(DW.dtype.element_ty), mask=mask_a)


def _tiles(D: int) -> tuple[int, int]:
    BD = min(next_pow2(D), 256)
    return row_block(BD), BD


def gather(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x (N, d), order (N k,) int64 -> x[order // k]; contiguous inputs."""
    R, D = order.numel(), x.shape[1]
    xs = x.new_empty(R, D)
    if xs.numel():
        check_interpreted(_gather_kernel, x.device)
        BR, BD = _tiles(D)
        _gather_kernel[(triton.cdiv(R, BR),)](x, order, xs, R, D, K=top_k, BR=BR, BD=BD, num_warps=warps(BR * BD))
    return xs


def combine(ys: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """ys (N k, d), pos (N k,) int64, w (N k,) or None -> (N, d) in ys's dtype: sum_j ys[pos[n k + j]] (* w)."""
    D = ys.shape[1]
    N = pos.numel() // top_k
    y = ys.new_empty(N, D)
    if y.numel():
        check_interpreted(_combine_kernel, ys.device)
        BR, BD = _tiles(D)
        _combine_kernel[(triton.cdiv(N, BR),)](ys, pos, w if w is not None else ys, y, N, D, K=top_k,
                                               HAS_W=w is not None, COMPUTE=compute_dtype(ys, w), BR=BR, BD=BD,
                                               num_warps=warps(BR * BD))
    return y


def combine_bwd(dy: torch.Tensor, ys: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
                top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``combine(ys, pos, w)`` for dy (N, d): (dys like ys, dw like w)."""
    R, D = pos.numel(), ys.shape[1]
    dys, dw = torch.empty_like(ys), torch.empty_like(w)
    if R == 0:
        return dys, dw
    if D == 0:
        return dys, dw.zero_()
    check_interpreted(_combine_bwd_kernel, ys.device)
    BR, BD = _tiles(D)
    _combine_bwd_kernel[(triton.cdiv(R, BR),)](dy, ys, pos, w, dys, dw, R, D, K=top_k,
                                               COMPUTE=compute_dtype(dy, ys, w), BR=BR, BD=BD,
                                               num_warps=warps(BR * BD))
    return dys, dw
