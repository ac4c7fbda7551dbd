"""Triton kernels of the MoE experts: a grouped GEMM whose A rows may be gathered through an index, its weight
gradient with the same gathered loads, and the SwiGLU activation on the packed [gate | up] projection.

Grouped GEMM (``grouped_mm``): C[r] = A[src(r)] @ B_e, for the rows r of expert e (rows offsets[e-1]:offsets[e]),
src(r) = order[r] // k when gathering (the token row of assignment order[r]: the permutation's gather, done by
the operand loads, so the permuted rows are never written), else r. B_e is weight[e] or its transpose, given
by strides. The per-expert offsets stay on the device: the grid is an upper bound on the row tiles,
cdiv(R, BM) + E (tiles are aligned to expert boundaries, each expert adding at most one partial tile), and
each program finds its expert and first row from the offsets (E values: a cumulative sum of the experts' tile
counts and a comparison), so nothing waits for the host; programs past the last tile return at once.

Weight gradient (``grouped_wgrad``): dW_e = dH_e^T @ A[src(rows of e)], one program per (expert, output tile),
looping over the expert's rows (a loop whose bounds it reads from the offsets) with the gathered loads of the
forward. An expert without rows gets zeros.

Tiles: autotuned on the GPU among a few candidates per kernel (all fitting an H100 block's shared memory in
bf16, checked by bench/compile_report.py); one small tile under the interpreter, so the tests' tiny shapes
still cross tile and expert boundaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels import backend, triton_utils
from hybridtron.kernels.swiglu.triton_kernels import swiglu_grads, swiglu_math
from hybridtron.kernels.triton_utils import compute_dtype, next_pow2, row_block, warps

# ---- SwiGLU on the packed gate_up rows ---------------------------------------------------------------------


@triton.jit
def _swiglu_packed_fwd_kernel(H, Y, M, HID, stride_h, stride_y, COMPUTE: tl.constexpr, BR: tl.constexpr,
                              BI: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < M)[:, None] & (c < HID)[None, :]
    h = H + r[:, None] * stride_h + c[None, :]
    g = tl.load(h, mask=m, other=0.0).to(COMPUTE)
    u = tl.load(h + HID, mask=m, other=0.0).to(COMPUTE)
    tl.store(Y + r[:, None] * stride_y + c[None, :], swiglu_math(g, u).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_packed_bwd_kernel(DY, H, DH, M, HID, stride_dy, stride_h, stride_dh, COMPUTE: tl.constexpr,
                              BR: tl.constexpr, BI: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < M)[:, None] & (c < HID)[None, :]
    dy = tl.load(DY + r[:, None] * stride_dy + c[None, :], mask=m, other=0.0).to(COMPUTE)
    h = H + r[:, None] * stride_h + c[None, :]
    g = tl.load(h, mask=m, other=0.0).to(COMPUTE)
    u = tl.load(h + HID, mask=m, other=0.0).to(COMPUTE)
    dg, du = swiglu_grads(dy, g, u)
    dh = DH + r[:, None] * stride_dh + c[None, :]
    tl.store(dh, dg.to(DH.dtype.element_ty), mask=m)
    tl.store(dh + HID, du.to(DH.dtype.element_ty), mask=m)


def _swiglu_tiles(inner: int) -> tuple[int, int]:
    BI = min(next_pow2(inner), 1024)
    return row_block(BI), BI


def swiglu_packed_fwd(h: torch.Tensor) -> torch.Tensor:
    """h (M, 2 I), unit stride along the row (any row stride) -> (M, I) contiguous, in h's dtype."""
    M, inner = h.shape[0], h.shape[1] // 2
    y = h.new_empty(M, inner)
    if y.numel():
        backend.check_interpreted(_swiglu_packed_fwd_kernel, h.device)
        BR, BI = _swiglu_tiles(inner)
        _swiglu_packed_fwd_kernel[(triton.cdiv(M, BR), triton.cdiv(inner, BI))](
            h, y, M, inner, h.stride(0), y.stride(0), COMPUTE=compute_dtype(h), BR=BR, BI=BI,
            num_warps=warps(BR * BI))
    return y


def swiglu_packed_bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Gradient of ``swiglu_packed_fwd(h)`` for dy (M, I): one (M, 2 I) tensor, [d gate | d up]."""
    M, inner = h.shape[0], h.shape[1] // 2
    dh = h.new_empty(M, 2 * inner)
    if dy.numel():
        backend.check_interpreted(_swiglu_packed_bwd_kernel, h.device)
        BR, BI = _swiglu_tiles(inner)
        _swiglu_packed_bwd_kernel[(triton.cdiv(M, BR), triton.cdiv(inner, BI))](
            dy, h, dh, M, inner, dy.stride(0), h.stride(0), dh.stride(0), COMPUTE=compute_dtype(h, dy), BR=BR,
            BI=BI, num_warps=warps(BR * BI))
    return dh


# ---- grouped GEMM with gathered rows -----------------------------------------------------------------------

# GPU candidates (BM, BN, BK, warps, stages). BM x BK of A and BK x BN of B per stage: at bf16 the largest,
# (128, 256, 64) x 3 stages, holds 144 KiB of the 227 KiB an H100 block may use; 4-byte operands are pruned
# to the candidates that fit (`_fits`). The weight gradient's BM runs over the weight's output rows, BK over
# the expert's token rows.
_GEMM = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
         (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)]
_WGRAD = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4),
          (64, 64, 64, 4, 4)]
_INTERPRET = (16, 16, 16, 4, 1)  # the smallest tl.dot tile: the tests' shapes span several tiles and experts
_SHARED = 200 * 1024  # a margin under the H100's 232448 bytes for triton's own scratch (barriers, layouts)


def _cfg(bm: int, bn: int, bk: int, w: int, s: int) -> triton.Config:
    return triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)


def _configs(table: list) -> list[triton.Config]:
    # TRITON_INTERPRET is read when the kernels are decorated (this module's import), as gated_attention's are
    return [_cfg(*_INTERPRET)] if backend.interpreter_requested() else [_cfg(*row) for row in table]


def _fits(configs, named_args, **kwargs):
    """The candidates whose pipelined operand tiles fit in shared memory at the operands' element size (fp32 and
    fp64 halve and quarter what bf16 can hold) and, for 4-byte operands, whose accumulator is at most 32 values a
    thread: tf32x3 holds each operand fragment twice more (its TF32 head and remainder), and the larger tiles
    spilled at sm_90a (compiled with bench/compile_report.py). The smallest when none is left."""
    size = named_args["A" if "A" in named_args else "DH"].element_size()

    def ok(c):
        bm, bn, bk = c.kwargs["BM"], c.kwargs["BN"], c.kwargs["BK"]
        return c.num_stages * (bm + bn) * bk * size <= _SHARED and (size < 4 or bm * bn <= 32 * 32 * c.num_warps)

    kept = [c for c in configs if ok(c)]
    return kept or [min(configs, key=lambda c: (c.kwargs["BM"] + c.kwargs["BN"]) * c.kwargs["BK"] * c.num_stages)]


def _autotune(table: list, key: list[str]):
    configs = _configs(table)
    if len(configs) == 1:
        return triton.autotune(configs=configs, key=key)
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": _fits})


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a @ b. DOT_F32: upcast the 16-bit operands first -- under the interpreter only, whose tl.dot
    multiplies bfloat16 bit patterns as integers (triton 3.7, triton-lang/triton#11584); products of bf16
    values are exact in fp32, so this is what the GPU's MMA computes."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)  # fp64 accumulates in fp64
    return acc


@triton.jit
def _source_rows(ORDER, rows, rmask, TOPK: tl.constexpr, GATHER: tl.constexpr):
    """The A / X rows that expert-sorted rows ``rows`` read: the token row order[r] // k of each assignment when
    gathering (the permutation's gather), else the rows themselves. int64: row offsets can pass 2^31 elements."""
    if GATHER:
        src = (tl.load(ORDER + rows, mask=rmask, other=0) // TOPK).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return src


@triton.jit
def _tile_of_expert(OFFS, t, E, E_BLOCK: tl.constexpr, BM: tl.constexpr):
    """Row tile t of the expert-aligned tiling: (expert, first row, end of the expert's rows). The expert is E
    for tiles past the last one. From the running counts alone: each expert has cdiv(count, BM) tiles, so the
    tile's expert is the number of experts whose tiles all come before t."""
    ex = tl.arange(0, E_BLOCK)
    real = ex < E
    ends = tl.load(OFFS + ex, mask=real, other=0)
    starts = tl.load(OFFS + ex - 1, mask=real & (ex > 0), other=0)
    tiles = tl.where(real, (ends - starts + BM - 1) // BM, 0)
    tile_end = tl.cumsum(tiles, 0)
    e = tl.sum((tile_end <= t).to(tl.int32), 0)  # the padding (ex >= E) sits at the total: counted past it only
    here = ex == e
    first_tile = tl.sum(tl.where(here, tile_end - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, starts, 0), 0) + (t - first_tile) * BM
    return e, row0, tl.sum(tl.where(here, ends, 0), 0)


@_autotune(_GEMM, key=["N", "K", "GATHER"])
@triton.jit
def _grouped_mm_kernel(A, ORDER, B, OFFS, C, N, K, E, stride_a, stride_be, stride_bk, stride_bn, stride_c,
                       TOPK: tl.constexpr, GATHER: tl.constexpr, E_BLOCK: tl.constexpr, ACC: tl.constexpr,
                       PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # consecutive programs share a row tile (its gathered A rows stay in L2 across the N tiles) and, tile after
    # tile, an expert (its weight stays in L2)
    n_tiles = tl.cdiv(N, BN)
    t = tl.program_id(0) // n_tiles
    e, row0, row_end = _tile_of_expert(OFFS, t, E, E_BLOCK, BM)
    if e < E:
        rows = row0 + tl.arange(0, BM)
        rmask = rows < row_end
        src = _source_rows(ORDER, rows, rmask, TOPK, GATHER)
        cols = (tl.program_id(0) % n_tiles) * BN + tl.arange(0, BN)
        cmask = cols < N
        ks = tl.arange(0, BK)
        a_ptr = A + src[:, None] * stride_a + ks[None, :]
        b_ptr = B + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BM, BN), dtype=ACC)
        for k0 in range(0, K, BK):
            kmask = ks < K - k0
            a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = _dot(a, b, acc, PRECISION, DOT_F32)
            a_ptr += BK
            b_ptr += BK * stride_bk
        c_ptr = C + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@_autotune(_WGRAD, key=["N", "K", "GATHER"])
@triton.jit
def _grouped_wgrad_kernel(DH, X, ORDER, OFFS, DW, N, K, stride_dh, stride_x,
                          TOPK: tl.constexpr, GATHER: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                          DOT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # dW[e] (N, K) = dH[rows of e]^T (N x rows) @ X[src(rows of e)] (rows x K): tile (BM of N, BN of K), the
    # reduction over the expert's rows in BK steps
    m_tiles, n_tiles = tl.cdiv(N, BM), tl.cdiv(K, BN)
    pid = tl.program_id(0)
    e = pid // (m_tiles * n_tiles)
    pm = pid % (m_tiles * n_tiles) // n_tiles
    pn = pid % n_tiles
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    end = tl.load(OFFS + e)
    ms = pm * BM + tl.arange(0, BM)
    ns = pn * BN + tl.arange(0, BN)
    mmask, nmask = ms < N, ns < K
    acc = tl.zeros((BM, BN), dtype=ACC)
    for r0 in range(start, end, BK):
        rows = r0 + tl.arange(0, BK)
        rmask = rows < end
        src = _source_rows(ORDER, rows, rmask, TOPK, GATHER)
        # dH rows as they lie (BK x BM, unit stride along BM), transposed in registers / shared memory
        dh = tl.load(DH + rows.to(tl.int64)[:, None] * stride_dh + ms[None, :], mask=rmask[:, None] & mmask[None, :],
                     other=0.0)
        x = tl.load(X + src[:, None] * stride_x + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(tl.trans(dh), x, acc, PRECISION, DOT_F32)
    dw = DW + e.to(tl.int64) * N * K + ms.to(tl.int64)[:, None] * K + ns[None, :]
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _dot_flags(t: torch.Tensor) -> dict:
    """Accumulator, dot precision and interpreter upcast for operands of t's dtype: fp32 accumulation (fp64 for
    the tests' fp64); fp32 operands as three TF32 products on the GPU (tf32x3: about fp32's accuracy on the
    tensor cores), IEEE under the interpreter."""
    interp = triton_utils.interpreted(t.device)
    acc = compute_dtype(t)
    precision = "tf32x3" if t.dtype == torch.float32 and not interp else "ieee"
    return dict(ACC=acc, PRECISION=precision, DOT_F32=interp and t.element_size() == 2)


def grouped_mm(a: torch.Tensor, order: torch.Tensor | None, weight: torch.Tensor, offsets: torch.Tensor, top_k: int,
               transpose: bool) -> torch.Tensor:
    """Rows of expert e (offsets[e-1]:offsets[e], offsets int32 on a's device, offsets[-1] = the rows) times
    weight[e].T (transpose, weight (E, out, in)) or weight[e] (weight (E, in, out)); row r reads a[order[r] // k]
    (order int64) or a[r] (order None). Contiguous a and weight; the output (rows, out) in a's dtype."""
    E = weight.shape[0]
    K, N = (weight.shape[2], weight.shape[1]) if transpose else (weight.shape[1], weight.shape[2])
    R = order.numel() if order is not None else a.shape[0]
    c = a.new_empty(R, N)
    if c.numel() == 0:
        return c
    if K == 0:
        return c.zero_()
    backend.check_interpreted(_grouped_mm_kernel, a.device)
    sbk, sbn = (weight.stride(2), weight.stride(1)) if transpose else (weight.stride(1), weight.stride(2))

    def grid(meta):
        return ((triton.cdiv(R, meta["BM"]) + E) * triton.cdiv(N, meta["BN"]),)

    _grouped_mm_kernel[grid](a, order if order is not None else offsets, weight, offsets, c, N, K, E, a.stride(0),
                             weight.stride(0), sbk, sbn, c.stride(0), TOPK=top_k, GATHER=order is not None,
                             E_BLOCK=next_pow2(E), **_dot_flags(a))
    return c


def grouped_wgrad(dh: torch.Tensor, x: torch.Tensor, order: torch.Tensor | None, offsets: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """dW (E, out, in) in x's dtype: dW[e] = dh[rows of e]^T @ x[src(rows of e)], src as in `grouped_mm`; dh
    (rows, out), x (tokens, in), contiguous."""
    E, N, K = offsets.numel(), dh.shape[1], x.shape[1]
    dw = x.new_empty(E, N, K)
    if dw.numel() == 0:
        return dw
    if dh.shape[0] == 0:
        return dw.zero_()
    backend.check_interpreted(_grouped_wgrad_kernel, x.device)

    def grid(meta):
        return (E * triton.cdiv(N, meta["BM"]) * triton.cdiv(K, meta["BN"]),)

    _grouped_wgrad_kernel[grid](dh, x, order if order is not None else offsets, offsets, dw, N, K, dh.stride(0),
                                x.stride(0), TOPK=top_k, GATHER=order is not None, **_dot_flags(x))
    return dw
