"""Triton rotary embedding of q and k in one kernel, with the per-head QK-norm fused in front.

A program handles positions (b, t): it loads that position's q heads as a [heads, channels] tile in three
pieces (the two rotated halves and the pass-through rest), normalises each head (QK-norm, optional),
rotates, and stores; then the same for k. Unfused, the QK-norm and the rotation each read and write q and
k once more. q and k are read through their strides (q is usually a view of the fused [query | gate]
projection), so no copy is made; outputs are contiguous (B, T, heads, D).

Backward recomputes the norm statistics from the saved input (nothing per token is stored), and walks
positions persistently so each program accumulates its share of the two norm gains' gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import check_interpreted
from ..triton_utils import compute_dtype, next_pow2, num_programs, warps


@triton.jit
def _load_parts(X, base, sh, NH, HALF, REST, COMPUTE: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    hh = tl.arange(0, BLOCK_H)
    c1 = tl.arange(0, BLOCK_HALF)
    cr = tl.arange(0, BLOCK_REST)
    hm = (hh < NH)[:, None]
    m1 = hm & (c1 < HALF)[None, :]
    mr = hm & (cr < REST)[None, :]
    ptr = X + base + hh[:, None].to(tl.int64) * sh
    x1 = tl.load(ptr + c1[None, :], mask=m1, other=0.0).to(COMPUTE)
    x2 = tl.load(ptr + HALF + c1[None, :], mask=m1, other=0.0).to(COMPUTE)
    xr = tl.load(ptr + 2 * HALF + cr[None, :], mask=mr, other=0.0).to(COMPUTE)
    return x1, x2, xr


@triton.jit
def _store_parts(Y, base, sh, NH, HALF, REST, y1, y2, yr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    hh = tl.arange(0, BLOCK_H)
    c1 = tl.arange(0, BLOCK_HALF)
    cr = tl.arange(0, BLOCK_REST)
    hm = (hh < NH)[:, None]
    m1 = hm & (c1 < HALF)[None, :]
    mr = hm & (cr < REST)[None, :]
    ptr = Y + base + hh[:, None].to(tl.int64) * sh
    tl.store(ptr + c1[None, :], y1.to(Y.dtype.element_ty), mask=m1)
    tl.store(ptr + HALF + c1[None, :], y2.to(Y.dtype.element_ty), mask=m1)
    tl.store(ptr + 2 * HALF + cr[None, :], yr.to(Y.dtype.element_ty), mask=mr)


@triton.jit
def _load_gain(W, HALF, REST, offset, COMPUTE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    c1 = tl.arange(0, BLOCK_HALF)
    cr = tl.arange(0, BLOCK_REST)
    w1 = tl.load(W + c1, mask=c1 < HALF, other=0.0).to(COMPUTE) + offset
    w2 = tl.load(W + HALF + c1, mask=c1 < HALF, other=0.0).to(COMPUTE) + offset
    wr = tl.load(W + 2 * HALF + cr, mask=cr < REST, other=0.0).to(COMPUTE) + offset
    return w1, w2, wr


@triton.jit
def _rstd(x1, x2, xr, D, eps):
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
    return 1.0 / tl.sqrt(ss / D + eps)  # (BLOCK_H,)


@triton.jit
def _rotary_fwd_kernel(
    Q, K, QO, KO, COS, SIN, QW, KW,
    T, H, KV, HALF, REST, D,
    sqb, sqt, sqh, skb, skt, skh, sct, eps, offset,
    NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    pid = tl.program_id(0)  # one position (b, t)
    b = pid // T
    t = pid % T
    c1 = tl.arange(0, BLOCK_HALF)
    cos = tl.load(COS + t * sct + c1, mask=c1 < HALF, other=0.0).to(COMPUTE)[None, :]
    sin = tl.load(SIN + t * sct + c1, mask=c1 < HALF, other=0.0).to(COMPUTE)[None, :]
    pid64 = pid.to(tl.int64)
    # q
    x1, x2, xr = _load_parts(Q, b.to(tl.int64) * sqb + t.to(tl.int64) * sqt, sqh, H, HALF, REST, COMPUTE,
                             BLOCK_H, BLOCK_HALF, BLOCK_REST)
    if NORM:
        r = _rstd(x1, x2, xr, D, eps)[:, None]
        x1, x2, xr = x1 * r, x2 * r, xr * r
        if HAS_W:
            w1, w2, wr = _load_gain(QW, HALF, REST, offset, COMPUTE, BLOCK_HALF, BLOCK_REST)
            x1, x2, xr = x1 * w1[None, :], x2 * w2[None, :], xr * wr[None, :]
    _store_parts(QO, pid64 * H * D, D, H, HALF, REST, x1 * cos - x2 * sin, x2 * cos + x1 * sin, xr,
                 BLOCK_H, BLOCK_HALF, BLOCK_REST)
    # k
    x1, x2, xr = _load_parts(K, b.to(tl.int64) * skb + t.to(tl.int64) * skt, skh, KV, HALF, REST, COMPUTE,
                             BLOCK_KV, BLOCK_HALF, BLOCK_REST)
    if NORM:
        r = _rstd(x1, x2, xr, D, eps)[:, None]
        x1, x2, xr = x1 * r, x2 * r, xr * r
        if HAS_W:
            w1, w2, wr = _load_gain(KW, HALF, REST, offset, COMPUTE, BLOCK_HALF, BLOCK_REST)
            x1, x2, xr = x1 * w1[None, :], x2 * w2[None, :], xr * wr[None, :]
    _store_parts(KO, pid64 * KV * D, D, KV, HALF, REST, x1 * cos - x2 * sin, x2 * cos + x1 * sin, xr,
                 BLOCK_KV, BLOCK_HALF, BLOCK_REST)


@triton.jit
def _rotary_bwd_one(DO, X, DX, do_base, x_base, sxh, dx_base, NH, HALF, REST, D, cos, sin, eps, offset,
                    W, dw1, dw2, dwr,
                    NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    g1, g2, gr = _load_parts(DO, do_base, D, NH, HALF, REST, COMPUTE, BLOCK_H, BLOCK_HALF, BLOCK_REST)
    # The rotation's transpose takes the gradient back to the (normalised) input of the rotation.
    n1 = g1 * cos + g2 * sin
    n2 = g2 * cos - g1 * sin
    nr = gr
    if NORM:
        x1, x2, xr = _load_parts(X, x_base, sxh, NH, HALF, REST, COMPUTE, BLOCK_H, BLOCK_HALF, BLOCK_REST)
        r = _rstd(x1, x2, xr, D, eps)[:, None]
        x1, x2, xr = x1 * r, x2 * r, xr * r  # x-hat
        if HAS_W:
            dw1 += tl.sum(n1 * x1, axis=0)
            dw2 += tl.sum(n2 * x2, axis=0)
            dwr += tl.sum(nr * xr, axis=0)
            w1, w2, wr = _load_gain(W, HALF, REST, offset, COMPUTE, BLOCK_HALF, BLOCK_REST)
            n1, n2, nr = n1 * w1[None, :], n2 * w2[None, :], nr * wr[None, :]
        c = (tl.sum(n1 * x1, axis=1) + tl.sum(n2 * x2, axis=1) + tl.sum(nr * xr, axis=1)) / D
        n1 = (n1 - x1 * c[:, None]) * r
        n2 = (n2 - x2 * c[:, None]) * r
        nr = (nr - xr * c[:, None]) * r
    _store_parts(DX, dx_base, D, NH, HALF, REST, n1, n2, nr, BLOCK_H, BLOCK_HALF, BLOCK_REST)
    return dw1, dw2, dwr


@triton.jit
def _rotary_bwd_kernel(
    DQO, DKO, Q, K, DQ, DK, COS, SIN, QW, KW, DQW, DKW,
    N, T, H, KV, HALF, REST, D,
    sqb, sqt, sqh, skb, skt, skh, sct, eps, offset, n_prog,
    NORM: tl.constexpr, HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    pid = tl.program_id(0)
    c1 = tl.arange(0, BLOCK_HALF)
    cr = tl.arange(0, BLOCK_REST)
    qw1 = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    qw2 = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    qwr = tl.zeros([BLOCK_REST], dtype=COMPUTE)
    kw1 = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    kw2 = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    kwr = tl.zeros([BLOCK_REST], dtype=COMPUTE)
    for row in range(pid, N, n_prog):  # positions (b, t), persistent
        row64 = tl.cast(row, tl.int64)  # (a Python int under the interpreter, where .to does not exist)
        b = row64 // T
        t = row64 % T
        cos = tl.load(COS + t * sct + c1, mask=c1 < HALF, other=0.0).to(COMPUTE)[None, :]
        sin = tl.load(SIN + t * sct + c1, mask=c1 < HALF, other=0.0).to(COMPUTE)[None, :]
        qw1, qw2, qwr = _rotary_bwd_one(DQO, Q, DQ, row64 * H * D, b * sqb + t * sqt, sqh, row64 * H * D,
                                        H, HALF, REST, D, cos, sin, eps, offset, QW, qw1, qw2, qwr,
                                        NORM, HAS_W, COMPUTE, BLOCK_H, BLOCK_HALF, BLOCK_REST)
        kw1, kw2, kwr = _rotary_bwd_one(DKO, K, DK, row64 * KV * D, b * skb + t * skt, skh, row64 * KV * D,
                                        KV, HALF, REST, D, cos, sin, eps, offset, KW, kw1, kw2, kwr,
                                        NORM, HAS_W, COMPUTE, BLOCK_KV, BLOCK_HALF, BLOCK_REST)
    if HAS_W:
        base = pid * D
        tl.store(DQW + base + c1, qw1, mask=c1 < HALF)
        tl.store(DQW + base + HALF + c1, qw2, mask=c1 < HALF)
        tl.store(DQW + base + 2 * HALF + cr, qwr, mask=cr < REST)
        tl.store(DKW + base + c1, kw1, mask=c1 < HALF)
        tl.store(DKW + base + HALF + c1, kw2, mask=c1 < HALF)
        tl.store(DKW + base + 2 * HALF + cr, kwr, mask=cr < REST)


def _blocks(q, k, cos):
    B, T, H, D = q.shape
    KV = k.shape[2]
    HALF = cos.shape[-1]
    REST = D - 2 * HALF
    return B, T, H, KV, D, HALF, REST, dict(
        BLOCK_H=next_pow2(H), BLOCK_KV=next_pow2(KV), BLOCK_HALF=next_pow2(HALF), BLOCK_REST=next_pow2(REST),
    )


def rotary_fwd(q, k, cos, sin, q_weight, k_weight, norm: bool, eps: float, offset: float):
    """q (B, T, H, D), k (B, T, KV, D) with unit channel stride; cos/sin (T, rot/2) with unit stride.
    -> rotated (and normalised) q, k, contiguous."""
    B, T, H, KV, D, HALF, REST, blocks = _blocks(q, k, cos)
    qo = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, KV, D), dtype=k.dtype, device=k.device)
    if B * T == 0:
        return qo, ko
    check_interpreted(_rotary_fwd_kernel, q.device)
    _rotary_fwd_kernel[(B * T,)](
        q, k, qo, ko, cos, sin, q_weight, k_weight, T, H, KV, HALF, REST, D,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), eps, offset,
        NORM=norm, HAS_W=q_weight is not None, COMPUTE=compute_dtype(q, k), **blocks,
        num_warps=warps((blocks["BLOCK_H"] + blocks["BLOCK_KV"]) * next_pow2(D)),
    )
    return qo, ko


def rotary_bwd(dqo, dko, q, k, cos, sin, q_weight, k_weight, norm: bool, eps: float, offset: float):
    """Gradients of `rotary_fwd` with respect to q, k (contiguous) and the two gains ((D,) or empty)."""
    B, T, H, KV, D, HALF, REST, blocks = _blocks(q, k, cos)
    dq = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, T, KV, D), dtype=k.dtype, device=k.device)
    cdt = compute_dtype(q, k)
    acc = torch.float64 if cdt == tl.float64 else torch.float32
    has_w = q_weight is not None
    n_prog = num_programs(q.device, B * T, per_sm=8)
    dqw = torch.zeros((n_prog, D) if has_w else (0,), dtype=acc, device=q.device)
    dkw = torch.zeros((n_prog, D) if has_w else (0,), dtype=acc, device=q.device)
    if B * T:
        check_interpreted(_rotary_bwd_kernel, q.device)
        _rotary_bwd_kernel[(n_prog,)](
            dqo, dko, q, k, dq, dk, cos, sin, q_weight, k_weight, dqw, dkw, B * T, T, H, KV, HALF, REST, D,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0),
            eps, offset, n_prog,
            NORM=norm, HAS_W=has_w, COMPUTE=cdt, **blocks,
            num_warps=warps((blocks["BLOCK_H"] + blocks["BLOCK_KV"]) * next_pow2(D)),
        )
    if has_w:
        dqw, dkw = dqw.sum(0), dkw.sum(0)
    return dq, dk, dqw, dkw
