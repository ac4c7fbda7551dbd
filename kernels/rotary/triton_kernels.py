"""Triton rotary embedding of q and k in one kernel, with the per-head QK-norm fused in front.

Rows are (b, t, head) triples of q and of k; a program takes a block of rows of one of them (q's blocks
first, then k's, on one grid axis) as one [rows, D] tile: each row is 2 D contiguous bytes, read with
16-byte vector loads, and a row lies inside one warp, so its norm statistics are warp shuffles. The
rotation's partner of channel c (c + rot/2 for the first half, c - rot/2 for the second; none past rot) is a
second load of the same row at permuted offsets, served by the cache the first load filled:

    y[c] = xn[c] cos[t, j] + s[c] xn[p(c)] sin[t, j]      s = -1 (first half), +1 (second); j = c mod rot/2

with xn the normalised row times its gain (cos = 1, sin = 0 past rot). Unfused, the QK-norm and the rotation
each read and write q and k once more. q and k are read through their strides (q is usually a view of the
fused [query | gate] projection), so no copy is made; outputs are contiguous (B, T, heads, D).

Backward is the same walk with the rotation transposed (s -> -s), the norm's statistics recomputed from
the saved input (nothing per token is stored); each program writes its block's share of the two gains'
gradients, summed by torch (deterministic). The previous kernel held a row as three tiles (the two rotated
halves and the rest, padded to powers of two: 16 + 16 + 128 lanes for D 128 at 25% rotary) whose per-row
sums met through shared memory, 16 warps a program: 14% of copy bandwidth on the H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import compute_dtype, next_pow2, row_block, warps


@triton.jit
def _row_offsets(rows, T, NH, sb, st, sh):
    """(b, t, head) of each row -> offset of its first channel in the strided input, and its position t.
    Row indices fit int32 (the launcher checks): 32-bit division, 64-bit offsets."""
    head = rows % NH
    bt = rows // NH
    t = bt % T
    return (bt // T).to(tl.int64) * sb + t.to(tl.int64) * st + head.to(tl.int64) * sh, t


@triton.jit
def _perm(HALF: tl.constexpr, D, BLOCK_D: tl.constexpr):
    """Channels c, their mask, the rotation partner p(c), whether c is rotated, its sign and table column.
    HALF is a compile-time constant, so triton sees p and the table columns as runs of HALF contiguous
    channels and vectorises their loads."""
    c = tl.arange(0, BLOCK_D)
    first = c < HALF
    rot = c < 2 * HALF
    p = tl.where(first, c + HALF, c - HALF)
    sign = tl.where(first, -1.0, 1.0)
    j = tl.where(first, c, c - HALF)
    return c, c < D, p, rot, sign, j


@triton.jit
def _tables(COS, SIN, t, rmask, sct, j, rot, COMPUTE: tl.constexpr):
    """cos, sin (rows, BLOCK_D) at each row's position: 1 and 0 on the channels past rot."""
    m = rmask[:, None] & rot[None, :]
    off = t[:, None] * sct + j[None, :]
    return (tl.load(COS + off, mask=m, other=1.0).to(COMPUTE), tl.load(SIN + off, mask=m, other=0.0).to(COMPUTE))


@triton.jit
def _fwd_block(X, Y, W, COS, SIN, blk, N, T, NH, sb, st, sh, sct, HALF: tl.constexpr, D, eps, offset,
               NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    base, t = _row_offsets(rows, T, NH, sb, st, sh)
    c, cmask, p, rot, sign, j = _perm(HALF, D, BLOCK_D)
    m = rmask[:, None] & cmask[None, :]
    src = X + base[:, None]
    x = tl.load(src + c[None, :], mask=m, other=0.0).to(COMPUTE)
    xp = tl.load(src + p[None, :], mask=m & rot[None, :], other=0.0).to(COMPUTE)
    if NORM:
        r = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        x, xp = x * r, xp * r
        if HAS_W:
            x = x * (tl.load(W + c, mask=cmask, other=0.0).to(COMPUTE) + offset)[None, :]
            xp = xp * (tl.load(W + p, mask=rot, other=0.0).to(COMPUTE) + offset)[None, :]
    cos, sin = _tables(COS, SIN, t, rmask, sct, j, rot, COMPUTE)
    y = x * cos + sign[None, :] * xp * sin
    tl.store(Y + rows.to(tl.int64)[:, None] * D + c[None, :], y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rotary_fwd_kernel(
    Q, K, QO, KO, COS, SIN, QW, KW,
    NQ, NK, T, H, KV, D, n_qblk,
    sqb, sqt, sqh, skb, skt, skh, sct, eps, offset,
    HALF: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0)
    if blk < n_qblk:
        _fwd_block(Q, QO, QW, COS, SIN, blk, NQ, T, H, sqb, sqt, sqh, sct, HALF, D, eps, offset,
                   NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_D)
    else:
        _fwd_block(K, KO, KW, COS, SIN, blk - n_qblk, NK, T, KV, skb, skt, skh, sct, HALF, D, eps, offset,
                   NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_D)


@triton.jit
def _bwd_block(DO, X, DX, W, DW, COS, SIN, blk, N, T, NH, sb, st, sh, sct, HALF: tl.constexpr, D, eps, offset,
               NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    base, t = _row_offsets(rows, T, NH, sb, st, sh)
    c, cmask, p, rot, sign, j = _perm(HALF, D, BLOCK_D)
    m = rmask[:, None] & cmask[None, :]
    cont = DO + rows.to(tl.int64)[:, None] * D
    g = tl.load(cont + c[None, :], mask=m, other=0.0).to(COMPUTE)
    gp = tl.load(cont + p[None, :], mask=m & rot[None, :], other=0.0).to(COMPUTE)
    cos, sin = _tables(COS, SIN, t, rmask, sct, j, rot, COMPUTE)
    # The rotation's transpose takes the gradient back to the rotation's (normalised) input.
    n = g * cos - sign[None, :] * gp * sin
    if NORM:
        x = tl.load(X + base[:, None] + c[None, :], mask=m, other=0.0).to(COMPUTE)
        r = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        x = x * r  # x-hat
        if HAS_W:
            tl.store(DW + blk.to(tl.int64) * D + c, tl.sum(n * x, axis=0), mask=cmask)
            n = n * (tl.load(W + c, mask=cmask, other=0.0).to(COMPUTE) + offset)[None, :]
        n = (n - x * (tl.sum(n * x, axis=1) / D)[:, None]) * r
    tl.store(DX + rows.to(tl.int64)[:, None] * D + c[None, :], n.to(DX.dtype.element_ty), mask=m)


@triton.jit
def _rotary_bwd_kernel(
    DQO, DKO, Q, K, DQ, DK, COS, SIN, QW, KW, DQW, DKW,
    NQ, NK, T, H, KV, D, n_qblk,
    sqb, sqt, sqh, skb, skt, skh, sct, eps, offset,
    HALF: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0)
    if blk < n_qblk:
        _bwd_block(DQO, Q, DQ, QW, DQW, COS, SIN, blk, NQ, T, H, sqb, sqt, sqh, sct, HALF, D, eps, offset,
                   NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_D)
    else:
        _bwd_block(DKO, K, DK, KW, DKW, COS, SIN, blk - n_qblk, NK, T, KV, skb, skt, skh, sct, HALF, D, eps,
                   offset, NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_D)


def _sizes(q, k, cos):
    B, T, H, D = q.shape
    KV = k.shape[2]
    block_d = next_pow2(D)
    # 16 rows of 128 channels a program: 4 warps, a row per 16 threads (8 channels = one 16-byte load each)
    return B, T, H, KV, D, cos.shape[-1], dict(BLOCK_R=row_block(block_d, target=2048, max_rows=32),
                                                BLOCK_D=block_d)


def _strides(q, k, cos):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0))


def _warps(blocks) -> int:
    return max(1, min(8, warps(blocks["BLOCK_R"] * blocks["BLOCK_D"]) // 2))


def rotary_fwd(q, k, cos, sin, q_weight, k_weight, norm: bool, eps: float, offset: float):
    """q (B, T, H, D), k (B, T, KV, D) with unit channel stride; cos/sin (T, rot/2) with unit stride.
    -> rotated (and normalised) q, k, contiguous."""
    B, T, H, KV, D, HALF, blocks = _sizes(q, k, cos)
    qo = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, KV, D), dtype=k.dtype, device=k.device)
    NQ, NK = B * T * H, B * T * KV
    if NQ == 0:
        return qo, ko
    if NQ + blocks["BLOCK_R"] >= 2**31:
        raise ValueError(f"rotary_qk: {NQ} (b, t, head) rows of q; the kernel indexes rows in int32 (< 2^31)")
    check_interpreted(_rotary_fwd_kernel, q.device)
    n_q, n_k = triton.cdiv(NQ, blocks["BLOCK_R"]), triton.cdiv(NK, blocks["BLOCK_R"])
    _rotary_fwd_kernel[(n_q + n_k,)](
        q, k, qo, ko, cos, sin, q_weight, k_weight, NQ, NK, T, H, KV, D, n_q, *_strides(q, k, cos),
        eps, offset, HALF=HALF, NORM=norm, HAS_W=q_weight is not None, COMPUTE=compute_dtype(q, k), **blocks,
        num_warps=_warps(blocks),
    )
    return qo, ko


def rotary_bwd(dqo, dko, q, k, cos, sin, q_weight, k_weight, norm: bool, eps: float, offset: float):
    """Gradients of `rotary_fwd` with respect to q, k (contiguous) and the two gains ((D,) or empty)."""
    B, T, H, KV, D, HALF, blocks = _sizes(q, k, cos)
    dq = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, T, KV, D), dtype=k.dtype, device=k.device)
    cdt = compute_dtype(q, k)
    acc = torch.float64 if cdt == tl.float64 else torch.float32
    has_w = q_weight is not None
    NQ, NK = B * T * H, B * T * KV
    n_q, n_k = triton.cdiv(NQ, blocks["BLOCK_R"]), triton.cdiv(NK, blocks["BLOCK_R"])
    # one partial per row block, summed below (no atomics: deterministic); empty without gains
    dqw = torch.zeros((n_q, D) if has_w else (0,), dtype=acc, device=q.device)
    dkw = torch.zeros((n_k, D) if has_w else (0,), dtype=acc, device=q.device)
    if NQ:
        check_interpreted(_rotary_bwd_kernel, q.device)
        _rotary_bwd_kernel[(n_q + n_k,)](
            dqo, dko, q, k, dq, dk, cos, sin, q_weight, k_weight, dqw, dkw, NQ, NK, T, H, KV, D, n_q,
            *_strides(q, k, cos), eps, offset,
            HALF=HALF, NORM=norm, HAS_W=has_w and norm, COMPUTE=cdt, **blocks, num_warps=_warps(blocks),
        )
    if has_w:
        dqw, dkw = dqw.sum(0), dkw.sum(0)
    return dq, dk, dqw, dkw
