"""Triton kernels of the chunked gated delta rule, forward and backward, and their launchers.

The maths is that of ``delta_rule_chunked`` (reference.py). The sequence of L = T * n_h sub-steps is cut into
chunks of C; a program sees one chunk of one (batch, value head), rows i = 0 .. C-1. Per chunk, with q and k
L2-normalised (q also times Dk^-1/2), G the in-chunk cumulative sum of the log decays g, seg_i the number of
document starts in the chunk up to and including row i, and S the state entering the chunk:

    Gamma_ij = exp(G_i - G_j)  for j <= i and seg_i == seg_j, else 0   decay from step j to step i
    din_i    = exp(G_i) if seg_i == 0 else 0                          what reaches step i of the carried state
    dout_i   = exp(G_end - G_i) if seg_i == seg_end else 0            decay from step i to the chunk's end
    dall     = din_end                                                the carried state's decay over the chunk

    A     = strictly_lower(beta_i Gamma_ij k_i.k_j)       Tinv = (I + A)^-1 (forward substitution)
    U     = Tinv (beta v)                                  W = Tinv (beta din k)            (C, Dv), (C, Dk)
    delta = U - W S                                        the writes, as the recurrence makes them
    o     = (din q) S + ((q k^T) * Gamma) delta
    S'    = dall S + (dout k)^T delta

Forward, three kernels: ``_wy_fwd`` (chunk-parallel: Tinv, U, W), ``_state_fwd`` (one program per (batch,
head, Dv tile) walks the chunks in order, S in registers; it writes every chunk's entering state and turns U
into delta in place), ``_output_fwd`` (chunk-parallel: o). Only Tinv and the entering states are kept for
the backward; W and delta are recomputed from them.

Backward, with dO the output's cotangent and dS' the cotangent of the state leaving a chunk:

    d delta = ((q k^T) * Gamma)^T dO + (dout k) dS'        dS = (din q)^T dO + dall dS' - W^T d delta
    dU = d delta      dW = -d delta S^T      dX = Tinv^T dU      dY = Tinv^T dW      (X = beta v, Y = beta din k)
    dA = -strictly_lower(dX U^T + dY W^T)                  (the gradient through a matrix inverse)

and for every product with Gamma_ij (or din, dout, dall) the log-decay gradient dG_i gains (d Gamma_ij)
Gamma_ij and dG_j loses it; dg is the reverse in-chunk cumulative sum of dG. Three kernels again:
``_output_bwd`` (chunk-parallel: recomputes W and delta; the local part ((q k^T) * Gamma)^T dO of d delta,
dq, and the parts of dk and dG that come through q k^T), ``_state_bwd`` (the chunks in reverse order, dS in
registers, from the final state's cotangent to the initial state's gradient; it completes d delta in place
and writes each chunk's dS'), ``_wy_bwd`` (chunk-parallel: everything through Tinv, U, W and the state
update: dv, dbeta, the rest of dk and dG, and dg).

Layout. The kernels read the caller's tensors as they are: q (B, T, Hk, Dk), k (B, L, Hk, Dk) (the
(B, T, n_h, ...) layout is already a sequence of sub-steps), v (B, L, Hv, Dv), g (B, T, Hv), beta (B, L, Hv),
resets (B, T). Sub-step row l belongs to token l // n_h; the query (and the output) sits at a token's last
sub-step, the decay and the reset at its first, so masked loads do what the reference's zero-padded
expansion does. Value head h reads key head h // r (grouped value attention); q's and k's gradients come
out per value head and the caller sums each group of r. q and k are normalised where they are loaded (the
whole head dim is one tile), and their gradients go through the normalisation's backward in the kernel
that finishes them. Intermediates live in (B, Hv, N * C, ...) buffers (N chunks; rows past L are padding:
k = v = beta = q = g = 0 there, so they write nothing and decay nothing).

Precision: accumulation in fp32 (fp64 for fp64 inputs). For 16-bit q the dot products take 16-bit operands
(one tensor-core pass at the full rate, as fla's kernels do) and the intermediates kept between kernels (Tinv,
W, delta, the forward's chunk states, the backward's d delta and state cotangents) are stored in that dtype; the
backward's recomputed chunk states stay fp32 for the one sum over a whole state, the decay's gradient
sum(S * dS'), which _state_bwd takes while dS is still in fp32 registers. For fp32 inputs
the dots use three TF32 products (``tf32x3``: each operand split into a TF32 head and a TF32 remainder, the
remainder x remainder term dropped), about fp32's accuracy on the tensor cores; plain TF32 (10 mantissa bits)
would put errors far above the fp32 reference's, and IEEE fp32 dots compile to scalar FMAs on the CUDA cores.
The tests hold the 16-bit path to 3x the error of the reference computed with bf16 operands in its products.

Tiles: C in {16, 32, 64}; the head dims are padded to powers of two >= 16 (what tl.dot needs on a GPU) and
masked; Dv is split into tiles of 32 or 64 columns (``LAUNCH``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted, interpreter_requested
from hybridtron.kernels.triton_utils import next_pow2

# Under the interpreter the kernels round as the GPU does by hand (read at import, when TRITON_INTERPRET also
# decides how the kernels are decorated): its tl.dot ignores input_precision and multiplies 16-bit operands
# wrongly, and its fp32 -> bf16 conversion truncates where the GPU's rounds to nearest even.
EMULATE = tl.constexpr(interpreter_requested())
EPS = tl.constexpr(1e-6)  # the L2 norm's eps, where the reference puts it: x / sqrt(sum(x^2) + eps); a global a
# kernel reads must be a constexpr (the interpreter does not check this; the GPU compiler does)

# Per kernel: (C, BK) -> (BV value columns per tile, num_warps, num_stages). Chosen from compiling for sm_90a at
# Dk = Dv = 128, C = 64 (bench/compile_report.py; bench/RESULTS.md): every kernel within the shared memory of one
# block, the fewest spilled bytes. Stages only matter where a loop loads (the state kernels' chunk loop, the
# value-tile loops); 3 put three backward kernels over the 227 KiB an H100 block may use.
def _wide(C: int, BK: int) -> bool:
    return C * BK > 4096


LAUNCH = {
    "wy_fwd": lambda C, BK: (64, 8 if _wide(C, BK) else 4, 1),
    "output_fwd": lambda C, BK: (32, 8 if _wide(C, BK) else 4, 1),
    "output_bwd": lambda C, BK: (32, 8 if _wide(C, BK) else 4, 1),
    "wy_bwd": lambda C, BK: (32, 8 if _wide(C, BK) else 4, 1),  # spill-free at 16 and 32; 32: wider MMAs
}

# The two state passes run their chunks one after another; their only parallelism is B x HV x (Dv / BV) programs
# (64 at batch 1, 16 heads, BV 32: half an H100's SMs), so the value tile trades programs for work per program,
# and which wins depends on the batch and the GPU. On the GPU they are autotuned per shape over these (BV, warps,
# stages), each compiled spill-free for sm_90a at D128 (bench/compile_report.py); under the interpreter one.
# (_state_bwd at 2 stages went over an A100 block's 163 KiB.)
STATE_TUNE = {
    "state_fwd": [(16, 4, 2), (32, 4, 2), (64, 4, 2)],
    "state_bwd": [(16, 4, 1), (16, 8, 1), (32, 8, 1)],  # (32, 4) and (64, 8) spilled 32 and 8 B
}
STATE_INTERPRET = (32, 4, 1)
STATE_SLOT = 16  # _state_bwd's S * dS' partial sums: one per 16 value columns (the narrowest tile), see DALL


def _prune_state_tiles(configs, named_args, **kwargs):
    """No tile wider than the value head dim (padded to a power of two >= 16) needs launching."""
    widest = max(16, next_pow2(kwargs["DV"]))  # every table holds a 16-column candidate, so one is always kept
    return [c for c in configs if c.kwargs["BV"] <= widest]


def _state_autotune(name: str, in_place: str):
    """triton.autotune over STATE_TUNE[name], keyed by the shape (programs, chunks, head dims; argument dtypes are
    in triton's key too). ``in_place``: the argument the kernel updates in place, restored after each timing run."""
    rows = [STATE_INTERPRET] if interpreter_requested() else STATE_TUNE[name]
    configs = [triton.Config({"BV": bv}, num_warps=w, num_stages=st) for bv, w, st in rows]
    return triton.autotune(configs=configs, key=["BH", "N", "DK", "DV"], restore_value=[in_place],
                           reset_to_zero=["DALL"] if name == "state_bwd" else None,
                           prune_configs_by={"early_config_prune": _prune_state_tiles})


# ----------------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _tf32(x):
    """x (fp32) rounded to TF32's 10 mantissa bits, to nearest with ties away from zero (as cvt.rna.tf32.f32):
    add half a TF32 unit to the magnitude's bits, then clear the 13 bits TF32 drops (-8192 = 0xFFFFE000)."""
    return ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_rne(x):
    """fp32 x rounded to bf16's 8 significant bits, to nearest with ties to even, as an fp32 value (the
    interpreter's own conversion truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, DT: tl.constexpr):
    """x converted to DT, rounded to nearest even (by hand for bf16 under the interpreter)."""
    if EMULATE and DT == tl.bfloat16 and x.dtype != tl.bfloat16:
        y = _bf16_rne(x.to(tl.float32)).to(DT)
    else:
        y = x.to(DT)
    return y


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """Matrix product with fp32 (fp64) accumulation. DOT is the operand dtype: bf16 / fp16 for 16-bit inputs
    (both operands rounded to it: one tensor-core pass at the full 16-bit rate), fp32 for fp32 inputs (tf32x3:
    about fp32's accuracy on tensor cores, see the module docstring), fp64 (IEEE). Under the interpreter the
    operands are rounded explicitly (tf32x3's three TF32 products made one by one) and multiplied exactly,
    so the CPU tests check the rounding the GPU does (not its summation order)."""
    if DOT == tl.float64:
        c = tl.dot(a, b, input_precision="ieee")
    elif DOT == tl.float32:
        if EMULATE:
            a_hi = _tf32(a)
            b_hi = _tf32(b)
            a_lo = _tf32(a - a_hi)
            b_lo = _tf32(b - b_hi)
            c = tl.dot(a_lo, b_hi, input_precision="ieee") + tl.dot(a_hi, b_lo, input_precision="ieee")
            c += tl.dot(a_hi, b_hi, input_precision="ieee")
        else:
            c = tl.dot(a, b, input_precision="tf32x3")
    elif EMULATE:
        c = tl.dot(_cast(a, DOT).to(tl.float32), _cast(b, DOT).to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a.to(DOT), b.to(DOT), out_dtype=tl.float32)
    return c


@triton.jit
def _dot_acc(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b as `_dot` rounds it; for 16-bit operands on the GPU the product accumulates into acc inside
    the tensor-core instruction (no second tile of registers for the product, no separate add)."""
    if DOT == tl.float64 or DOT == tl.float32 or EMULATE:
        c = acc + _dot(a, b, DOT)
    else:
        c = tl.dot(a.to(DOT), b.to(DOT), acc, out_dtype=tl.float32)
    return c


@triton.jit
def _sub_steps(rows, L, NH: tl.constexpr):
    """Flat sub-step rows -> token index, and whether the row is its token's first / last sub-step / real."""
    real = rows < L
    sub = rows % NH
    return rows // NH, real & (sub == 0), real & (sub == NH - 1), real


@triton.jit
def _load_unit_rows(ptr, row_offs, rmask, DK: tl.constexpr, BK: tl.constexpr, COMPUTE: tl.constexpr):
    """Rows of q or k, L2-normalised: (C, BK) and their 1 / norm (C,). Masked rows are zero."""
    ck = tl.arange(0, BK)
    x = tl.load(ptr + row_offs[:, None] + ck[None, :], mask=rmask[:, None] & (ck < DK)[None, :], other=0.0)
    x = x.to(COMPUTE)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) + EPS)
    return x * rstd[:, None], rstd


@triton.jit
def _q_scale(DK: tl.constexpr, COMPUTE: tl.constexpr):
    """Dk^-1/2, the queries' scale, in the compute dtype (a float argument would reach the kernel as fp32)."""
    return 1.0 / tl.sqrt(tl.full([], DK, dtype=COMPUTE))


@triton.jit
def _unit_rows_bwd(y, rstd, dy):
    """Gradient through y = x / sqrt(|x|^2 + eps), given y and 1 / sqrt(|x|^2 + eps): rstd (dy - y (y . dy))."""
    return rstd[:, None] * (dy - y * tl.sum(y * dy, 1)[:, None])


@triton.jit
def _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS: tl.constexpr, COMPUTE: tl.constexpr,
           C: tl.constexpr):
    """Per-chunk gates: the in-chunk cumulative log decay Gc (C,) and segment ids seg (C,), and their values at
    the chunk's end (padding rows decay nothing and start nothing, so the end is also the last real row's)."""
    g = tl.load(G + (b * T + tok) * HV + h, mask=first, other=0.0).to(COMPUTE)
    if HAS_RESETS:
        r = tl.load(RESETS + b * T + tok, mask=first, other=0).to(tl.int32)
        seg = tl.cumsum(r, 0)
        seg_end = tl.sum(r, 0)
    else:
        seg = tl.zeros([C], dtype=tl.int32)
        seg_end = 0
    return tl.cumsum(g, 0), tl.sum(g, 0), seg, seg_end


@triton.jit
def _decay_matrix(Gc, seg, C: tl.constexpr):
    """Gamma (C, C): exp(G_i - G_j) for j <= i within one document segment, else 0 (masked before the exp, so
    nothing above the diagonal can overflow)."""
    i = tl.arange(0, C)
    ok = (i[:, None] >= i[None, :]) & (seg[:, None] == seg[None, :])
    return tl.exp(tl.where(ok, Gc[:, None] - Gc[None, :], float("-inf")))


@triton.jit
def _state_decays(Gc, G_end, seg, seg_end):
    """din (C,): the carried-in state's decay at each row (0 after a reset); dout (C,): each row's decay to the
    chunk's end (0 before the chunk's last reset); dall: the carried-in state's decay over the whole chunk."""
    din = tl.where(seg == 0, tl.exp(Gc), 0.0)
    dout = tl.where(seg == seg_end, tl.exp(G_end - Gc), 0.0)
    dall = tl.where(seg_end == 0, tl.exp(G_end), 0.0)
    return din, dout, dall


@triton.jit
def _unit_lower_inverse(a, C: tl.constexpr):
    """(I + a)^-1 for a strictly lower triangular a (C, C), by forward substitution: row r of the inverse is
    e_r - a[r, :r] @ inv[:r, :], and rows above r are final by then. (Not a power series in a: with beta
    near 2 its terms grow large before they cancel.)"""
    i = tl.arange(0, C)
    inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0).to(a.dtype)
    for r in range(1, C):
        a_r = tl.sum(tl.where(i[:, None] == r, a, 0.0), 0)  # row r of a as a vector over columns (0 from r on)
        inv = tl.where(i[:, None] == r, inv - tl.sum(a_r[:, None] * inv, 0)[None, :], inv)
    return inv


@triton.jit
def _chunk_setup(n, bh, L, T, HV, R: tl.constexpr, NH: tl.constexpr, C: tl.constexpr):
    """Indices of chunk n of program row bh = b * HV + h: batch, value head, key head, rows (C,) of the
    sub-step sequence, their tokens, and the first / last / real row masks."""
    b = bh // HV
    h = bh % HV
    rows = n * C + tl.arange(0, C)
    tok, first, last, real = _sub_steps(rows, L, NH)
    return b, h, h // R, rows, tok, first, last, real


# ----------------------------------------------------------------------------------------------------------
# forward


@triton.jit
def _wy_fwd_kernel(
    K, V, G, BETA, RESETS, TINV, U, W,
    T, L, LP, HK, HV,
    R: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_RESETS: tl.constexpr,
    LOAD_TINV: tl.constexpr, COMPUTE: tl.constexpr, DOT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Grid (N, B * HV): Tinv (solved here, or with LOAD_TINV read back as the forward stored it), U = Tinv
    (beta v) and W = Tinv (beta din k) of one chunk."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h, hk, rows, tok, first, last, real = _chunk_setup(n, bh, L, T, HV, R, NH, C)
    Gc, G_end, seg, seg_end = _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS, COMPUTE, C)
    din, dout, dall = _state_decays(Gc, G_end, seg, seg_end)
    k, _ = _load_unit_rows(K, ((b * L + rows) * HK + hk) * DK, real, DK, BK, COMPUTE)
    beta = tl.load(BETA + (b * L + rows) * HV + h, mask=real, other=0.0).to(COMPUTE)

    i = tl.arange(0, C)
    srow = bh * LP + rows  # rows of the (B, HV, LP, ...) buffers
    if LOAD_TINV:
        tinv = tl.load(TINV + srow[:, None] * C + i[None, :])
    else:
        a = _dot(k, tl.trans(k), DOT) * _decay_matrix(Gc, seg, C)
        a = tl.where(i[:, None] > i[None, :], a, 0.0) * beta[:, None]
        tinv = _cast(_unit_lower_inverse(a, C), TINV.dtype.element_ty)
        tl.store(TINV + srow[:, None] * C + i[None, :], tinv)
    ck = tl.arange(0, BK)
    w = _dot(tinv, k * (beta * din)[:, None], DOT)
    tl.store(W + srow[:, None] * DK + ck[None, :], _cast(w, W.dtype.element_ty), mask=(ck < DK)[None, :])
    for v0 in range(0, DV, BV):
        cv = v0 + tl.arange(0, BV)
        v = tl.load(V + ((b * L + rows) * HV + h)[:, None] * DV + cv[None, :],
                    mask=real[:, None] & (cv < DV)[None, :], other=0.0).to(COMPUTE)
        u = _dot(tinv, v * beta[:, None], DOT)
        tl.store(U + srow[:, None] * DV + cv[None, :], _cast(u, U.dtype.element_ty), mask=(cv < DV)[None, :])


@_state_autotune("state_fwd", in_place="U")
@triton.jit
def _state_fwd_kernel(
    K, G, RESETS, W, U, S0, STATES, FINAL,
    T, L, LP, HK, HV, N, BH,
    R: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_RESETS: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, COMPUTE: tl.constexpr, DOT: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """Grid (BH = B * HV, Dv tiles): the chunks in order, state columns cv in registers (in COMPUTE). Writes the
    state entering each chunk to STATES (B, HV, N, DK, DV), delta over U in place, and the final state."""
    bh = tl.program_id(0).to(tl.int64)
    cv = tl.program_id(1) * BV + tl.arange(0, BV)
    ck = tl.arange(0, BK)
    s_offs = ck[:, None] * DV + cv[None, :]
    s_mask = (ck < DK)[:, None] & (cv < DV)[None, :]
    if HAS_S0:
        S = tl.load(S0 + bh * DK * DV + s_offs, mask=s_mask, other=0.0).to(COMPUTE)
    else:
        S = tl.zeros([BK, BV], dtype=COMPUTE)
    for n in range(N):
        tl.store(STATES + (bh * N + n) * DK * DV + s_offs, _cast(S, STATES.dtype.element_ty), mask=s_mask)
        b, h, hk, rows, tok, first, last, real = _chunk_setup(n, bh, L, T, HV, R, NH, C)
        Gc, G_end, seg, seg_end = _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS, COMPUTE, C)
        din, dout, dall = _state_decays(Gc, G_end, seg, seg_end)
        srow = bh * LP + rows
        w = tl.load(W + srow[:, None] * DK + ck[None, :], mask=(ck < DK)[None, :], other=0.0)
        u_ptrs = U + srow[:, None] * DV + cv[None, :]
        delta = tl.load(u_ptrs, mask=(cv < DV)[None, :], other=0.0).to(COMPUTE) - _dot(w, S, DOT)
        tl.store(u_ptrs, _cast(delta, U.dtype.element_ty), mask=(cv < DV)[None, :])
        k, _ = _load_unit_rows(K, ((b * L + rows) * HK + hk) * DK, real, DK, BK, COMPUTE)
        S = S * dall + _dot(tl.trans(k * dout[:, None]), delta, DOT)
    if STORE_FINAL:
        tl.store(FINAL + bh * DK * DV + s_offs, S, mask=s_mask)


@triton.jit
def _output_fwd_kernel(
    Q, K, G, RESETS, STATES, DELTA, OUT,
    T, L, LP, HK, HV, N,
    R: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_RESETS: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Grid (N, B * HV, Dv tiles): o = (din q) S + ((q k^T) * Gamma) delta at each token's last sub-step."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cv = tl.program_id(2) * BV + tl.arange(0, BV)
    b, h, hk, rows, tok, first, last, real = _chunk_setup(n, bh, L, T, HV, R, NH, C)
    Gc, G_end, seg, seg_end = _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS, COMPUTE, C)
    din, dout, dall = _state_decays(Gc, G_end, seg, seg_end)
    q, _ = _load_unit_rows(Q, ((b * T + tok) * HK + hk) * DK, last, DK, BK, COMPUTE)
    q = q * _q_scale(DK, COMPUTE)
    k, _ = _load_unit_rows(K, ((b * L + rows) * HK + hk) * DK, real, DK, BK, COMPUTE)
    p = _dot(q, tl.trans(k), DOT) * _decay_matrix(Gc, seg, C)

    ck = tl.arange(0, BK)
    S = tl.load(STATES + (bh * N + n) * DK * DV + ck[:, None] * DV + cv[None, :],
                mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0)
    delta = tl.load(DELTA + (bh * LP + rows)[:, None] * DV + cv[None, :], mask=(cv < DV)[None, :], other=0.0)
    o = _dot(q * din[:, None], S, DOT) + _dot(p, delta, DOT)
    tl.store(OUT + ((b * T + tok) * HV + h)[:, None] * DV + cv[None, :], _cast(o, OUT.dtype.element_ty),
             mask=last[:, None] & (cv < DV)[None, :])


# ----------------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _output_bwd_kernel(
    Q, K, G, RESETS, DO, STATES, DELTA, DDELTA, DK_PART, DG_PART, DQ,
    T, L, LP, HK, HV, N,
    R: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_RESETS: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Grid (N, B * HV). Takes o's gradient back to q (finished here: dq of this value head, through the L2
    norm), to delta locally (DDELTA = ((q k^T) * Gamma)^T dO, completed by _state_bwd), to k through q k^T
    (DK_PART) and to the in-chunk log decays through Gamma and din (DG_PART)."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h, hk, rows, tok, first, last, real = _chunk_setup(n, bh, L, T, HV, R, NH, C)
    Gc, G_end, seg, seg_end = _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS, COMPUTE, C)
    din, dout, dall = _state_decays(Gc, G_end, seg, seg_end)
    gamma = _decay_matrix(Gc, seg, C)
    q_offs = ((b * T + tok) * HK + hk) * DK
    k_offs = ((b * L + rows) * HK + hk) * DK
    scale = _q_scale(DK, COMPUTE)

    ck = tl.arange(0, BK)
    srow = bh * LP + rows
    # q and k are loaded again after the value-tile loop rather than kept across it: fewer (C, BK) tiles
    # live in registers through the loop.
    qn, _ = _load_unit_rows(Q, q_offs, last, DK, BK, COMPUTE)
    k, _ = _load_unit_rows(K, k_offs, real, DK, BK, COMPUTE)
    pt = _cast(_dot(k, tl.trans(qn * scale), DOT) * tl.trans(gamma), DOT)  # P^T, P = (q k^T) * Gamma

    dq_in = tl.zeros([C, BK], dtype=COMPUTE)  # d(din q) = dO S^T
    dp = tl.zeros([C, C], dtype=COMPUTE)  # d((q k^T) * Gamma) = dO delta^T
    for v0 in range(0, DV, BV):
        cv = v0 + tl.arange(0, BV)
        mv = (cv < DV)[None, :]
        S = tl.load(STATES + (bh * N + n) * DK * DV + ck[:, None] * DV + cv[None, :],
                    mask=(ck < DK)[:, None] & mv, other=0.0)
        delta = tl.load(DELTA + srow[:, None] * DV + cv[None, :], mask=mv, other=0.0)
        do = tl.load(DO + ((b * T + tok) * HV + h)[:, None] * DV + cv[None, :], mask=last[:, None] & mv,
                     other=0.0).to(COMPUTE)
        dq_in += _dot(do, tl.trans(S), DOT)
        dp += _dot(do, tl.trans(delta), DOT)
        tl.store(DDELTA + srow[:, None] * DV + cv[None, :], _cast(_dot(pt, do, DOT), DDELTA.dtype.element_ty),
                 mask=mv)

    qn, q_rstd = _load_unit_rows(Q, q_offs, last, DK, BK, COMPUTE)
    q = qn * scale
    k, _ = _load_unit_rows(K, k_offs, real, DK, BK, COMPUTE)
    dqk = dp * gamma  # gradient of q k^T
    dq = din[:, None] * dq_in + _dot(dqk, k, DOT)
    tl.store(DK_PART + srow[:, None] * BK + ck[None, :], _dot(tl.trans(dqk), q, DOT))
    z = dp * tl.trans(pt).to(COMPUTE)  # d Gamma_ij * Gamma_ij
    tl.store(DG_PART + srow, din * tl.sum(q * dq_in, 1) + tl.sum(z, 1) - tl.sum(z, 0))
    dq = _unit_rows_bwd(qn, q_rstd, dq * scale)
    tl.store(DQ + ((b * T + tok) * HV + h)[:, None] * DK + ck[None, :], _cast(dq, DQ.dtype.element_ty),
             mask=last[:, None] & (ck < DK)[None, :])


@_state_autotune("state_bwd", in_place="DDELTA")
@triton.jit
def _state_bwd_kernel(
    Q, K, G, RESETS, DO, W, DDELTA, DHT, STATES, DSTATES, DALL, DH0,
    T, L, LP, HK, HV, N, BH, NS,
    R: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_RESETS: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Grid (BH = B * HV, Dv tiles): the chunks in reverse order, dS (the cotangent of the state leaving the chunk)
    in registers, starting from the final state's cotangent. Writes each chunk's dS' to DSTATES, its tile's
    share of sum(S * dS') (the chunk decay's gradient; S the state entering the chunk) to slot (tile) of DALL
    (B * HV, N, NS) in fp32 (NS: the slots of the narrowest tile; the launcher zeroes the rest), completes d delta = DDELTA + (dout k) dS' in place, and ends with the initial state's gradient.
    The sum is taken here, against dS in fp32 registers, so DSTATES can be stored in the operand dtype (bf16
    for bf16 inputs; _wy_bwd reads it only as a dot operand)."""
    bh = tl.program_id(0).to(tl.int64)
    cv = tl.program_id(1) * BV + tl.arange(0, BV)
    ck = tl.arange(0, BK)
    mv = (cv < DV)[None, :]
    s_offs = ck[:, None] * DV + cv[None, :]
    s_mask = (ck < DK)[:, None] & mv
    dS = tl.load(DHT + bh * DK * DV + s_offs, mask=s_mask, other=0.0).to(COMPUTE)
    for j in range(N):
        n = N - 1 - j
        tl.store(DSTATES + (bh * N + n) * DK * DV + s_offs, _cast(dS, DSTATES.dtype.element_ty), mask=s_mask)
        S = tl.load(STATES + (bh * N + n) * DK * DV + s_offs, mask=s_mask, other=0.0)
        tl.store(DALL + (bh * N + n) * NS + tl.program_id(1), tl.sum(tl.sum(S * dS, 1), 0))
        b, h, hk, rows, tok, first, last, real = _chunk_setup(n, bh, L, T, HV, R, NH, C)
        Gc, G_end, seg, seg_end = _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS, COMPUTE, C)
        din, dout, dall = _state_decays(Gc, G_end, seg, seg_end)
        srow = bh * LP + rows
        k, _ = _load_unit_rows(K, ((b * L + rows) * HK + hk) * DK, real, DK, BK, COMPUTE)
        dd_ptrs = DDELTA + srow[:, None] * DV + cv[None, :]
        dd = tl.load(dd_ptrs, mask=mv, other=0.0).to(COMPUTE) + _dot(k * dout[:, None], dS, DOT)
        tl.store(dd_ptrs, _cast(dd, DDELTA.dtype.element_ty), mask=mv)
        q, _ = _load_unit_rows(Q, ((b * T + tok) * HK + hk) * DK, last, DK, BK, COMPUTE)
        q = q * _q_scale(DK, COMPUTE)
        do = tl.load(DO + ((b * T + tok) * HV + h)[:, None] * DV + cv[None, :], mask=last[:, None] & mv,
                     other=0.0).to(COMPUTE)
        w = tl.load(W + srow[:, None] * DK + ck[None, :], mask=(ck < DK)[None, :], other=0.0)
        dS = dS * dall + _dot(tl.trans(q * din[:, None]), do, DOT) - _dot(tl.trans(w), dd, DOT)
    tl.store(DH0 + bh * DK * DV + s_offs, dS, mask=s_mask)


@triton.jit
def _wy_bwd_kernel(
    K, V, G, BETA, RESETS, TINV, STATES, DSTATES, DALL, W, DELTA, DDELTA, DK_PART, DG_PART, DK_OUT, DV_OUT, DG,
    DBETA, T, L, LP, HK, HV, N, NS, NSP: tl.constexpr,
    R: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_RESETS: tl.constexpr,
    COMPUTE: tl.constexpr, DOT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Grid (N, B * HV). From d delta (= dU) and the chunk's dS': dv, dbeta, dk (this value head's, through the
    L2 norm, DK_PART included) and dg (DG_PART included, summed back from the end of the chunk)."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h, hk, rows, tok, first, last, real = _chunk_setup(n, bh, L, T, HV, R, NH, C)
    beta = tl.load(BETA + (b * L + rows) * HV + h, mask=real, other=0.0).to(COMPUTE)

    i = tl.arange(0, C)
    ck = tl.arange(0, BK)
    mk = (ck < DK)[None, :]
    srow = bh * LP + rows
    tinv = tl.load(TINV + srow[:, None] * C + i[None, :])

    # Two passes over the value tiles, so that no more than two (C, BK) fp32 tiles are live at once (on sm_90a
    # the one-pass form held dY, d(dout k) and dX U^T together and spilled): the first ends dY and dX U^T, the
    # second sums d(dout k) with dk, which the first pass's results have started, live beside it.
    dy = tl.zeros([C, BK], dtype=COMPUTE)  # gradient of Y = beta din k: Tinv^T dW, dW = -d delta S^T
    dxu = tl.zeros([C, C], dtype=COMPUTE)  # dX U^T, the U half of -dA
    dbeta = tl.zeros([C], dtype=COMPUTE)
    for v0 in range(0, DV, BV):
        cv = v0 + tl.arange(0, BV)
        mv = (cv < DV)[None, :]
        S = tl.load(STATES + (bh * N + n) * DK * DV + ck[:, None] * DV + cv[None, :], mask=(ck < DK)[:, None] & mv,
                    other=0.0)
        dd = tl.load(DDELTA + srow[:, None] * DV + cv[None, :], mask=mv, other=0.0)
        v_offs = ((b * L + rows) * HV + h)[:, None] * DV + cv[None, :]
        v = tl.load(V + v_offs, mask=real[:, None] & mv, other=0.0).to(COMPUTE)
        dx = _dot(tl.trans(tinv), dd, DOT)  # gradient of X = beta v (and Tinv^T d delta)
        dy = _dot_acc(-dx, tl.trans(S), dy, DOT)
        tl.store(DV_OUT + v_offs, _cast(dx * beta[:, None], DV_OUT.dtype.element_ty), mask=real[:, None] & mv)
        dbeta += tl.sum(v * dx, 1)
        dxu = _dot_acc(dx, tl.trans(_dot(tinv, v * beta[:, None], DOT)), dxu, DOT)

    # The gates, W, Gamma and k only now, and each (C, BK) tile consumed as soon as it can be.
    Gc, G_end, seg, seg_end = _gates(G, RESETS, b, h, tok, first, T, HV, HAS_RESETS, COMPUTE, C)
    din, dout, dall = _state_decays(Gc, G_end, seg, seg_end)
    w = tl.load(W + srow[:, None] * DK + ck[None, :], mask=mk, other=0.0)
    dxu = _dot_acc(dy, tl.trans(w), dxu, DOT)  # dX U^T + dY W^T; W is not needed again
    k, k_rstd = _load_unit_rows(K, ((b * L + rows) * HK + hk) * DK, real, DK, BK, COMPUTE)
    ky = tl.sum(k * dy, 1)
    k = _cast(k, DOT)  # from here only a dot operand: rounded once, as every dot would, in half the registers
    dk = (beta * din)[:, None] * dy  # dY ends here
    # m = dA * Gamma on A's support, with dA = -(dX U^T + dY W^T); A = beta_i Gamma_ij (k k^T)_ij.
    m = tl.where(i[:, None] > i[None, :], -dxu * _decay_matrix(Gc, seg, C), 0.0)
    # dk += (m * beta) k + m^T (beta * k) = (mb + mb^T) k with mb = m * beta: one dot (mb is strictly lower
    # triangular, so the sum adds nothing to anything and rounds as the two operands did apart).
    mb = m * beta[:, None]
    dk = _dot_acc(mb + tl.trans(mb), k, dk, DOT)
    mkk = m * _dot(k, tl.trans(k), DOT)
    dbeta += din * ky + tl.sum(mkk, 1)
    z = mkk * beta[:, None]  # d Gamma_ij * Gamma_ij through A
    dG = din * beta * ky + tl.sum(z, 1) - tl.sum(z, 0) + tl.load(DG_PART + srow)

    dk_out = tl.zeros([C, BK], dtype=COMPUTE)  # d(dout k) = delta dS'^T
    for v0 in range(0, DV, BV):
        cv = v0 + tl.arange(0, BV)
        mv = (cv < DV)[None, :]
        dS = tl.load(DSTATES + (bh * N + n) * DK * DV + ck[:, None] * DV + cv[None, :],
                     mask=(ck < DK)[:, None] & mv, other=0.0)
        delta = tl.load(DELTA + srow[:, None] * DV + cv[None, :], mask=mv, other=0.0)
        dk_out = _dot_acc(delta, tl.trans(dS), dk_out, DOT)
    k, k_rstd = _load_unit_rows(K, ((b * L + rows) * HK + hk) * DK, real, DK, BK, COMPUTE)  # not kept across it
    d_dout = tl.sum(k * dk_out, 1)
    dk += dout[:, None] * dk_out
    dG -= dout * d_dout
    # G_end enters dout (exp(G_end - G_i)) and dall (exp(G_end)).
    jv = tl.arange(0, NSP)
    d_dall = tl.sum(tl.load(DALL + (bh * N + n) * NS + jv, mask=jv < NS, other=0.0), 0)  # sum(S * dS'): _state_bwd
    dG += tl.where(i == C - 1, tl.sum(dout * d_dout, 0) + dall * d_dall, 0.0)
    tl.store(DG + (b * T + tok) * HV + h, _cast(tl.cumsum(dG, 0, reverse=True), DG.dtype.element_ty), mask=first)
    tl.store(DBETA + (b * L + rows) * HV + h, _cast(dbeta, DBETA.dtype.element_ty), mask=real)
    dk += tl.load(DK_PART + srow[:, None] * BK + ck[None, :])
    dk = _unit_rows_bwd(k, k_rstd, dk)
    tl.store(DK_OUT + ((b * L + rows) * HV + h)[:, None] * DK + ck[None, :], _cast(dk, DK_OUT.dtype.element_ty),
             mask=real[:, None] & mk)


# ----------------------------------------------------------------------------------------------------------
# launchers


def _dtypes(q: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(accumulation dtype, operand dtype): fp32 and the 16-bit dtype for 16-bit q; fp32 and fp32 for fp32;
    fp64 and fp64 for fp64. The operand dtype is also what the intermediates (Tinv, W, U, delta, the chunk
    states and their cotangents) are stored in."""
    acc = torch.promote_types(q.dtype, torch.float32)
    return acc, (q.dtype if q.element_size() == 2 else acc)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def _meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, resets, chunk_size: int) -> dict:
    B, T, n_h, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    C = chunk_size
    N = triton.cdiv(T * n_h, C)
    BK = max(16, next_pow2(Dk))
    acc, op = _dtypes(q)
    return dict(
        shapes=(B, T, n_h, Hk, Hv, Dk, Dv, N),
        scalars=dict(T=T, L=T * n_h, LP=N * C, HK=Hk, HV=Hv),
        consts=dict(R=Hv // Hk, NH=n_h, DK=Dk, DV=Dv, HAS_RESETS=resets is not None, COMPUTE=_TL[acc], DOT=_TL[op],
                    C=C, BK=BK),
        acc=acc, op=op,
    )


def _launch(kernel: str, C: int, BK: int, Dv: int) -> dict:
    """BV, num_warps and num_stages of one kernel at chunk C and key block BK (see LAUNCH)."""
    bv, warps, stages = LAUNCH[kernel](C, BK)
    return dict(BV=min(bv, max(16, next_pow2(Dv))), num_warps=warps, num_stages=stages)


def _resets_u8(resets: torch.Tensor | None) -> torch.Tensor | None:
    return None if resets is None else resets.view(torch.uint8)


def _states(m: dict, k, g, rs, w, u, initial_state, final, dev, dtype=None) -> torch.Tensor:
    """The state pass: the state entering each chunk (B, HV, N, DK, DV) in ``dtype`` (default: the operand
    dtype), delta over u in place, and the final state into ``final`` (when not None)."""
    B, T, n_h, Hk, Hv, Dk, Dv, N = m["shapes"]
    sc, cs = m["scalars"], m["consts"]
    states = torch.empty(B, Hv, N, Dk, Dv, dtype=dtype or m["op"], device=dev)
    _state_fwd_kernel[lambda meta: (B * Hv, triton.cdiv(Dv, meta["BV"]))](
        k, g, rs, w, u, initial_state, states, final, **sc, N=N, BH=B * Hv, HAS_S0=initial_state is not None,
        STORE_FINAL=final is not None, **cs)
    return states


def chunk_gdr_fwd(q, k, v, g, beta, resets, initial_state, chunk_size: int):
    """q (B, T, Hk, Dk), k (B, T, n_h, Hk, Dk), v (B, T, n_h, Hv, Dv), g (B, T, Hv), beta (B, T, n_h, Hv),
    resets (B, T) bool or None, initial_state (B, Hv, Dk, Dv) or None; all contiguous. Returns o (B, T, Hv, Dv)
    in q's dtype, the final state (B, Hv, Dk, Dv) in fp32 (fp64 for fp64 q), and for the backward Tinv
    (B, Hv, N * C, C) in the operand dtype (q's for 16-bit q): the only intermediate kept."""
    m = _meta(q, k, v, resets, chunk_size)
    B, T, n_h, Hk, Hv, Dk, Dv, N = m["shapes"]
    C, acc, op = chunk_size, m["acc"], m["op"]
    o = q.new_empty(B, T, Hv, Dv)
    tinv = torch.empty(B, Hv, N * C, C, dtype=op, device=q.device)
    if o.numel() == 0 or Dk == 0:
        final = q.new_zeros(B, Hv, Dk, Dv, dtype=acc) if initial_state is None else initial_state.to(acc, copy=True)
        return o.zero_(), final, tinv
    check_interpreted(_wy_fwd_kernel, q.device)
    final = torch.empty(B, Hv, Dk, Dv, dtype=acc, device=q.device)
    w = torch.empty(B, Hv, N * C, Dk, dtype=op, device=q.device)
    u = torch.empty(B, Hv, N * C, Dv, dtype=op, device=q.device)  # U, then delta
    rs = _resets_u8(resets)
    sc, cs = m["scalars"], m["consts"]
    lw, lo = (_launch(name, C, cs["BK"], Dv) for name in ("wy_fwd", "output_fwd"))
    _wy_fwd_kernel[(N, B * Hv)](k, v, g, beta, rs, tinv, u, w, **sc, **cs, LOAD_TINV=False, **lw)
    states = _states(m, k, g, rs, w, u, initial_state, final, q.device)
    del w
    _output_fwd_kernel[(N, B * Hv, triton.cdiv(Dv, lo["BV"]))](q, k, g, rs, states, u, o, **sc, N=N, **cs, **lo)
    return o, final, tinv


def chunk_gdr_bwd(do, dht, q, k, v, g, beta, resets, tinv, initial_state, chunk_size: int):
    """Gradients of `chunk_gdr_fwd` from do (B, T, Hv, Dv) and dht (B, Hv, Dk, Dv), the final state's
    cotangent (contiguous), given the forward's Tinv and initial state: W, U, delta and the chunk states are
    recomputed (one chunk-parallel kernel and the state pass). Returns dq, dk, dv, dg, dbeta in their inputs'
    dtypes and the initial state's gradient in the accumulation dtype. dq and dk are summed over each key
    head's r value heads here."""
    m = _meta(q, k, v, resets, chunk_size)
    B, T, n_h, Hk, Hv, Dk, Dv, N = m["shapes"]
    C, acc, op = chunk_size, m["acc"], m["op"]
    r = Hv // Hk
    if do.numel() == 0 or Dk == 0:
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dht.to(acc, copy=True))
    check_interpreted(_output_bwd_kernel, q.device)
    dev = q.device

    def scratch(*shape, dtype=acc):
        return torch.empty(B, Hv, *shape, dtype=dtype, device=dev)

    rs = _resets_u8(resets)
    sc, cs = m["scalars"], m["consts"]
    w, delta = scratch(N * C, Dk, dtype=op), scratch(N * C, Dv, dtype=op)
    lw = _launch("wy_fwd", C, cs["BK"], Dv)
    _wy_fwd_kernel[(N, B * Hv)](k, v, g, beta, rs, tinv, delta, w, **sc, **cs, LOAD_TINV=True, **lw)
    # The chunk states in fp32 and their cotangents in the operand dtype: the decay's gradient sums S * dS' over
    # the whole state, a sum _state_bwd takes from these fp32 states and its fp32 registers (DALL); everywhere
    # else both are dot operands, rounded to the operand dtype anyway. The states live only for the backward.
    states = _states(m, k, g, rs, w, delta, initial_state, None, dev, dtype=acc)
    # d delta (the local part, then its sum with the carried part) and the state cotangents in the operand
    # dtype: the kernels that read them take them only as dot operands, which round to it anyway (the local part
    # is rounded once more before the sum). dk_part in fp32 (it is added, not multiplied), with the padded BK
    # columns (zeros past Dk): _wy_bwd adds it to a BK-wide tile unmasked.
    ddelta = scratch(N * C, Dv, dtype=op)
    dk_part, dg_part, dstates = scratch(N * C, cs["BK"]), scratch(N * C), scratch(N, Dk, Dv, dtype=op)
    dh0 = torch.empty(B, Hv, Dk, Dv, dtype=acc, device=dev)
    # Per value head; with r > 1 kept in fp32 until the group sum.
    dq_h = torch.empty(B, T, Hv, Dk, dtype=q.dtype if r == 1 else acc, device=dev)
    dk_h = torch.empty(B, T, n_h, Hv, Dk, dtype=k.dtype if r == 1 else acc, device=dev)
    dv, dg, dbeta = torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
    lo, lw = (_launch(name, C, cs["BK"], Dv) for name in ("output_bwd", "wy_bwd"))
    _output_bwd_kernel[(N, B * Hv)](q, k, g, rs, do, states, delta, ddelta, dk_part, dg_part, dq_h, **sc, N=N,
                                    **cs, **lo)
    # One S * dS' slot per 16 value columns, zeroed: a wider tile fills fewer (its sum covers several).
    ns = triton.cdiv(Dv, STATE_SLOT)
    dall = torch.zeros(B, Hv, N, ns, dtype=acc, device=dev)
    _state_bwd_kernel[lambda meta: (B * Hv, triton.cdiv(Dv, meta["BV"]))](
        q, k, g, rs, do, w, ddelta, dht, states, dstates, dall, dh0, **sc, N=N, BH=B * Hv, NS=ns, **cs)
    _wy_bwd_kernel[(N, B * Hv)](k, v, g, beta, rs, tinv, states, dstates, dall, w, delta, ddelta, dk_part, dg_part,
                                dk_h, dv, dg, dbeta, **sc, N=N, NS=ns, NSP=next_pow2(ns), **cs, **lw)
    if r > 1:
        dq_h = dq_h.view(B, T, Hk, r, Dk).sum(3).to(q.dtype)
        dk_h = dk_h.view(B, T, n_h, Hk, r, Dk).sum(4).to(k.dtype)
    return dq_h, dk_h, dv, dg, dbeta, dh0
