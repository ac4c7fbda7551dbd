"""Triton rotary embedding of q and k in one kernel, with the per-head QK-norm fused in front.

Rows are (b, t, head) triples of q and of k; a program takes a block of rows of one of them (the grid's
second axis says which) as [rows, channels] tiles in three pieces: the two rotated halves and the
pass-through rest. It normalises each row (the QK-norm, optional), rotates it by its position's angles and
stores it. Unfused, the QK-norm and the rotation each read and write q and k once more. q and k are read
through their strides (q is usually a view of the fused [query | gate] projection), so no copy is made;
outputs are contiguous (B, T, heads, D).

Backward recomputes the norm statistics from the saved input (nothing per token is stored) and walks row
blocks persistently, so each program accumulates its share of the two gains' gradients in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import check_interpreted
from ..triton_utils import compute_dtype, next_pow2, num_programs, row_block, warps


@triton.jit
def _row_offsets(rows, T, NH, sb, st, sh):
    """(b, t, head) of each row -> offset of its first channel in the strided input, and its position t."""
    r = rows.to(tl.int64)
    head = r % NH
    bt = r // NH
    t = bt % T
    return (bt // T) * sb + t * st + head * sh, t


@triton.jit
def _load3(ptr, rmask, HALF, REST, COMPUTE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """ptr: (BLOCK_R, 1) row starts -> the two rotated halves and the rest, in COMPUTE."""
    c1 = tl.arange(0, BLOCK_HALF)[None, :]
    cr = tl.arange(0, BLOCK_REST)[None, :]
    m1 = rmask[:, None] & (c1 < HALF)
    mr = rmask[:, None] & (cr < REST)
    x1 = tl.load(ptr + c1, mask=m1, other=0.0).to(COMPUTE)
    x2 = tl.load(ptr + HALF + c1, mask=m1, other=0.0).to(COMPUTE)
    xr = tl.load(ptr + 2 * HALF + cr, mask=mr, other=0.0).to(COMPUTE)
    return x1, x2, xr


@triton.jit
def _store3(ptr, rmask, HALF, REST, y1, y2, yr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    c1 = tl.arange(0, BLOCK_HALF)[None, :]
    cr = tl.arange(0, BLOCK_REST)[None, :]
    m1 = rmask[:, None] & (c1 < HALF)
    mr = rmask[:, None] & (cr < REST)
    dt = ptr.dtype.element_ty
    tl.store(ptr + c1, y1.to(dt), mask=m1)
    tl.store(ptr + HALF + c1, y2.to(dt), mask=m1)
    tl.store(ptr + 2 * HALF + cr, yr.to(dt), mask=mr)


@triton.jit
def _gain3(W, HALF, REST, offset, COMPUTE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    c1 = tl.arange(0, BLOCK_HALF)
    cr = tl.arange(0, BLOCK_REST)
    w1 = tl.load(W + c1, mask=c1 < HALF, other=0.0).to(COMPUTE) + offset
    w2 = tl.load(W + HALF + c1, mask=c1 < HALF, other=0.0).to(COMPUTE) + offset
    wr = tl.load(W + 2 * HALF + cr, mask=cr < REST, other=0.0).to(COMPUTE) + offset
    return w1[None, :], w2[None, :], wr[None, :]


@triton.jit
def _tables(COS, SIN, t, rmask, sct, HALF, COMPUTE: tl.constexpr, BLOCK_HALF: tl.constexpr):
    c1 = tl.arange(0, BLOCK_HALF)[None, :]
    m = rmask[:, None] & (c1 < HALF)
    off = t[:, None] * sct + c1
    return tl.load(COS + off, mask=m, other=0.0).to(COMPUTE), tl.load(SIN + off, mask=m, other=0.0).to(COMPUTE)


@triton.jit
def _rstd(x1, x2, xr, D, eps):
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
    return (1.0 / tl.sqrt(ss / D + eps))[:, None]


@triton.jit
def _fwd_rows(X, Y, W, COS, SIN, blk, N, T, NH, sb, st, sh, sct, HALF, REST, D, eps, offset,
              NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    base, t = _row_offsets(rows, T, NH, sb, st, sh)
    x1, x2, xr = _load3(X + base[:, None], rmask, HALF, REST, COMPUTE, BLOCK_HALF, BLOCK_REST)
    if NORM:
        r = _rstd(x1, x2, xr, D, eps)
        x1, x2, xr = x1 * r, x2 * r, xr * r
        if HAS_W:
            w1, w2, wr = _gain3(W, HALF, REST, offset, COMPUTE, BLOCK_HALF, BLOCK_REST)
            x1, x2, xr = x1 * w1, x2 * w2, xr * wr
    cos, sin = _tables(COS, SIN, t, rmask, sct, HALF, COMPUTE, BLOCK_HALF)
    out = Y + rows.to(tl.int64)[:, None] * D
    _store3(out, rmask, HALF, REST, x1 * cos - x2 * sin, x2 * cos + x1 * sin, xr, BLOCK_HALF, BLOCK_REST)


@triton.jit
def _rotary_fwd_kernel(
    Q, K, QO, KO, COS, SIN, QW, KW,
    NQ, NK, T, H, KV, HALF, REST, D,
    sqb, sqt, sqh, skb, skt, skh, sct, eps, offset,
    NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    blk = tl.program_id(0)
    if tl.program_id(1) == 0:
        _fwd_rows(Q, QO, QW, COS, SIN, blk, NQ, T, H, sqb, sqt, sqh, sct, HALF, REST, D, eps, offset,
                  NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_HALF, BLOCK_REST)
    else:
        _fwd_rows(K, KO, KW, COS, SIN, blk, NK, T, KV, skb, skt, skh, sct, HALF, REST, D, eps, offset,
                  NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_HALF, BLOCK_REST)


@triton.jit
def _bwd_rows(DO, X, DX, W, DW, COS, SIN, pid, n_prog, N, T, NH, sb, st, sh, sct, HALF, REST, D, eps, offset,
              NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    dw1 = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    dw2 = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    dwr = tl.zeros([BLOCK_REST], dtype=COMPUTE)
    if HAS_W:
        w1, w2, wr = _gain3(W, HALF, REST, offset, COMPUTE, BLOCK_HALF, BLOCK_REST)
    for row0 in range(pid * BLOCK_R, N, n_prog * BLOCK_R):
        rows = row0 + tl.arange(0, BLOCK_R)
        rmask = rows < N
        base, t = _row_offsets(rows, T, NH, sb, st, sh)
        cont = rows.to(tl.int64)[:, None] * D
        g1, g2, gr = _load3(DO + cont, rmask, HALF, REST, COMPUTE, BLOCK_HALF, BLOCK_REST)
        cos, sin = _tables(COS, SIN, t, rmask, sct, HALF, COMPUTE, BLOCK_HALF)
        # The rotation's transpose takes the gradient back to the rotation's (normalised) input.
        n1 = g1 * cos + g2 * sin
        n2 = g2 * cos - g1 * sin
        nr = gr
        if NORM:
            x1, x2, xr = _load3(X + base[:, None], rmask, HALF, REST, COMPUTE, BLOCK_HALF, BLOCK_REST)
            r = _rstd(x1, x2, xr, D, eps)
            x1, x2, xr = x1 * r, x2 * r, xr * r  # x-hat
            if HAS_W:
                dw1 += tl.sum(n1 * x1, axis=0)
                dw2 += tl.sum(n2 * x2, axis=0)
                dwr += tl.sum(nr * xr, axis=0)
                n1, n2, nr = n1 * w1, n2 * w2, nr * wr
            c = ((tl.sum(n1 * x1, axis=1) + tl.sum(n2 * x2, axis=1) + tl.sum(nr * xr, axis=1)) / D)[:, None]
            n1 = (n1 - x1 * c) * r
            n2 = (n2 - x2 * c) * r
            nr = (nr - xr * c) * r
        _store3(DX + cont, rmask, HALF, REST, n1, n2, nr, BLOCK_HALF, BLOCK_REST)
    if HAS_W:
        c1 = tl.arange(0, BLOCK_HALF)
        cr = tl.arange(0, BLOCK_REST)
        out = DW + pid * D
        tl.store(out + c1, dw1, mask=c1 < HALF)
        tl.store(out + HALF + c1, dw2, mask=c1 < HALF)
        tl.store(out + 2 * HALF + cr, dwr, mask=cr < REST)


@triton.jit
def _rotary_bwd_kernel(
    DQO, DKO, Q, K, DQ, DK, COS, SIN, QW, KW, DQW, DKW,
    NQ, NK, T, H, KV, HALF, REST, D,
    sqb, sqt, sqh, skb, skt, skh, sct, eps, offset, n_prog,
    NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _bwd_rows(DQO, Q, DQ, QW, DQW, COS, SIN, pid, n_prog, NQ, T, H, sqb, sqt, sqh, sct, HALF, REST, D, eps,
                  offset, NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_HALF, BLOCK_REST)
    else:
        _bwd_rows(DKO, K, DK, KW, DKW, COS, SIN, pid, n_prog, NK, T, KV, skb, skt, skh, sct, HALF, REST, D, eps,
                  offset, NORM, HAS_W, COMPUTE, BLOCK_R, BLOCK_HALF, BLOCK_REST)


def _sizes(q, k, cos):
    B, T, H, D = q.shape
    KV = k.shape[2]
    HALF = cos.shape[-1]
    REST = D - 2 * HALF
    block_d = next_pow2(D)
    blocks = dict(BLOCK_R=row_block(block_d), BLOCK_HALF=next_pow2(HALF), BLOCK_REST=next_pow2(REST))
    return B, T, H, KV, D, HALF, REST, blocks


def _strides(q, k, cos):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0))


def rotary_fwd(q, k, cos, sin, q_weight, k_weight, norm: bool, eps: float, offset: float):
    """q (B, T, H, D), k (B, T, KV, D) with unit channel stride; cos/sin (T, rot/2) with unit stride.
    -> rotated (and normalised) q, k, contiguous."""
    B, T, H, KV, D, HALF, REST, blocks = _sizes(q, k, cos)
    qo = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, KV, D), dtype=k.dtype, device=k.device)
    NQ, NK = B * T * H, B * T * KV
    if NQ == 0:
        return qo, ko
    check_interpreted(_rotary_fwd_kernel, q.device)
    grid = (triton.cdiv(max(NQ, NK), blocks["BLOCK_R"]), 2)
    _rotary_fwd_kernel[grid](
        q, k, qo, ko, cos, sin, q_weight, k_weight, NQ, NK, T, H, KV, HALF, REST, D, *_strides(q, k, cos),
        eps, offset, NORM=norm, HAS_W=q_weight is not None, COMPUTE=compute_dtype(q, k), **blocks,
        num_warps=warps(blocks["BLOCK_R"] * next_pow2(D)),
    )
    return qo, ko


def rotary_bwd(dqo, dko, q, k, cos, sin, q_weight, k_weight, norm: bool, eps: float, offset: float):
    """Gradients of `rotary_fwd` with respect to q, k (contiguous) and the two gains ((D,) or empty)."""
    B, T, H, KV, D, HALF, REST, blocks = _sizes(q, k, cos)
    dq = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, T, KV, D), dtype=k.dtype, device=k.device)
    cdt = compute_dtype(q, k)
    acc = torch.float64 if cdt == tl.float64 else torch.float32
    has_w = q_weight is not None
    NQ, NK = B * T * H, B * T * KV
    n_prog = num_programs(q.device, triton.cdiv(max(NQ, NK, 1), blocks["BLOCK_R"]))
    dqw = torch.zeros((n_prog, D) if has_w else (0,), dtype=acc, device=q.device)
    dkw = torch.zeros((n_prog, D) if has_w else (0,), dtype=acc, device=q.device)
    if NQ:
        check_interpreted(_rotary_bwd_kernel, q.device)
        _rotary_bwd_kernel[(n_prog, 2)](
            dqo, dko, q, k, dq, dk, cos, sin, q_weight, k_weight, dqw, dkw, NQ, NK, T, H, KV, HALF, REST, D,
            *_strides(q, k, cos), eps, offset, n_prog,
            NORM=norm, HAS_W=has_w, COMPUTE=cdt, **blocks, num_warps=warps(blocks["BLOCK_R"] * next_pow2(D)),
        )
    if has_w:
        dqw, dkw = dqw.sum(0), dkw.sum(0)
    return dq, dk, dqw, dkw
