"""Triton gated flash attention over packed documents: a forward kernel and a three-kernel backward.

Layout: tokens are flattened to one packed sequence of N = B * T rows; q, out (N, H, D), k, v (N, KV, D),
any token and head strides (the last dim contiguous), so the elementwise gate is read straight out of
q_proj's fused [query | gate] output without a copy. Documents arrive as two int32 vectors of length N,
``START[i]`` / ``END[i]``: the first index of token i's document and one past its last. Query row m may
attend key n iff ``START[m] <= n <= m`` (equivalently ``n <= m < END[n]``: documents are contiguous).
There is no T x T mask anywhere, and no host sync: the grid covers the packed sequence in fixed tiles.

Forward (grid: query tiles x query heads). A query tile [m0, m0 + BLOCK_M) visits key blocks from
``START[m0]`` (the earliest document any of its rows is in; tiles fully before it are never read) to its
last row: loop bounds, not masks, skip what the causal and document masks remove, so the work follows the
unmasked pairs (512-token documents in a 4096 sequence: about 1/6 of the tiles). The visited blocks fall in
three ranges: the ones some row's document start cuts, the ones fully inside every row's document and below
the diagonal, and the ones the diagonal cuts. Only the first and last get the per-element mask (its cost is
visible in the inner loop, so the middle range skips it). Softmax is online in fp32 with exp2 (scores
pre-multiplied by log2 e); the log-sum-exp (base 2) is saved for the backward. Epilogue: the ungated
attention A is stored (the backward needs it) and ``out = A * sigmoid(g)`` is computed from the fp32 A, so
the gate costs one extra read of g and no extra kernel.

K/V tiles of the forward and dQ loops come through tensor descriptors where triton has them and the target
is Hopper (TMA bulk copies into shared memory, no per-element addresses or masks: rows past N read as zeros),
pointer loads otherwise (`use_tma`, the ``TMA`` switch).

Causal load balancing: a tile's work varies from one key block to a whole document, so programs take tiles
heaviest first (`tile_orders`: an argsort of each 128-row super-tile's work, on the device, no host sync),
and the short tiles fill the tail of the grid, across batch rows and documents alike.

Backward, no atomics:
1. ``_bwd_pre`` (query tiles x heads): dA = dout * sigmoid(g) (stored: the other two kernels read it per
   tile pair, once instead of dout and g twice); dg = dout * A * s (1 - s) elementwise, or its sum over
   the head's channels headwise; Delta = rowsum(dA * A), from the ungated A and the gated dA.
2. ``_bwd_dkdv`` (key tiles x kv heads x splits): dK, dV of a kv head accumulate in registers over the query
   heads of its group (GQA without repeating K/V) and every query tile that sees the keys: from the tile's
   diagonal to the end of the last key's document. Where that makes too few programs for the GPU (one
   sequence: 4096 tokens x 4 kv heads are 128 key tiles), the group's query heads are split over programs
   whose fp32 partial sums the launcher adds (`dkdv_split`); still no atomics.
3. ``_bwd_dq`` (query tiles x heads): dQ over the same key blocks as the forward.
Both recompute P = exp2(scores - lse) and dS = P (dP - Delta).

Non-causal rectangle (``CAUSAL`` False; `attn_fwd` / `attn_bwd` with ``causal=False``), for ring attention's
cross-block steps: queries (Nq rows) against keys and values of another length (NK rows), every query seeing every
key, no documents, no gate. The same kernels and loop bodies, with constexpr branches (the causal mode compiles as
before): a query tile's forward and dQ visit key blocks [0, NK), the whole ones unmasked and the ragged last one
masked at NK; a key tile's dK/dV visit query tiles [0, Nq) alike. Every tile is the same work, so the grids run in
plain order (no `tile_orders`). The backward takes the *final* output and log-sum-exp, merged over all the key
blocks, as flash-attention's does (P = exp2(s - lse), Delta = rowsum(dout * out)), so it returns this block's share
of dq and its dk, dv.

Tile sizes are autotuned per head-dim block (16..256) and dtype on the GPU; under TRITON_INTERPRET=1 one
small config is used (autotuning would run every config in Python). fp32 inputs use IEEE fp32 dots, not
TF32, so an fp32 run is as exact as the fp32 reference. bf16 under the interpreter computes what the GPU does where
the interpreter would not (EMU_BF16: its bf16 dots, `_dot`, and its fp32 -> bf16 casts, `_round` and `_dot_rounded`);
on the GPU those switches compile to nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels import triton_utils
from hybridtron.kernels.backend import check_interpreted, interpreter_requested

LOG2E = 1.4426950408889634

GATE_NONE, GATE_HEAD, GATE_ELEM = 0, 1, 2


def _cfg(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# GPU candidates, (BLOCK_M, BLOCK_N, warps, stages), per (operand bytes, head-dim block): 2 for bf16 / fp16, whose
# dots run on tensor cores, 4 for fp32, whose IEEE dots are CUDA-core FMAs. Wider head dims hold bigger tiles in
# registers / shared memory, so they get smaller key blocks and fewer pipeline stages. The forward's and dQ's
# BLOCK_M is the query tile kept in registers; dK/dV's BLOCK_N is the key tile.
# Pruned by compiling every (dtype, head dim 64 / 128 / 256, gate) for sm_90a (bench/compile_report.py; figures in
# bench/RESULTS.md, 2026-11-25): no candidate exceeds a block's shared memory, and none spills except fp32 at 256.
# 2 bytes: all dots on warpgroup MMA except dK/dV at 256. There the two (BLOCK_N, 256) fp32 accumulators fill the
# registers: every 64-key tile (which warpgroup MMA needs) spilled 104-992 B a thread at 8 warps, and 16 warps cap
# a thread at 128 registers and spill more; the 32-key tiles run on mma.sync without spilling.
# 4 bytes: an FMA dot holds each thread's rows of its operands over the whole head dim in registers, so the tiles
# that fit shrink with D: 32 x 32 at 64, 16 x 16 (forward, dQ) at 128; the bf16 tiles spilled 0.1-24 KB there.
# At 256 no forward or dQ tile is spill-free (16 x 16 at 8 warps, the smallest, keeps 144 / 152 B of stack; 4 or
# 16 warps and wider tiles spill 1.8-2.8 KB), so the least-spilling one is kept: fp32 is the exact path, not a fast
# one.
_FWD = {
    (2, 64): [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4)],
    (2, 128): [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2)],
    (2, 256): [(64, 64, 8, 1), (64, 64, 8, 2), (64, 32, 8, 2)],
    (4, 64): [(32, 32, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)],
    (4, 128): [(16, 16, 8, 2)],
    (4, 256): [(16, 16, 8, 3)],  # spills (above)
}
_DKDV = {
    (2, 64): [(64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 3), (32, 64, 8, 3)],
    (2, 128): [(16, 128, 8, 3), (32, 128, 8, 1), (32, 64, 8, 3)],
    (2, 256): [(32, 32, 8, 1), (64, 32, 8, 1), (16, 32, 8, 2)],
    (4, 64): [(16, 128, 8, 2), (16, 64, 8, 2), (32, 32, 8, 2)],
    (4, 128): [(32, 64, 8, 1), (16, 64, 8, 2), (16, 32, 8, 2)],
    (4, 256): [(32, 32, 8, 1), (16, 32, 8, 2)],
}
_DQ = {
    (2, 64): [(128, 32, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4), (64, 32, 4, 4)],
    (2, 128): [(128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3)],
    (2, 256): [(64, 32, 8, 2), (64, 32, 8, 3)],
    (4, 64): [(32, 32, 8, 2), (64, 16, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2)],
    (4, 128): [(16, 16, 8, 2)],
    (4, 256): [(16, 16, 8, 2)],  # spills (above)
}
TABLES = {"fwd": _FWD, "dkdv": _DKDV, "dq": _DQ}
_INTERPRET = _cfg(16, 16, 4, 1)  # tiny tiles: several per test sequence, so every masking branch runs
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on an H100 (sm_90)


def shared_bytes(kernel: str, row: tuple, block_d: int, elem: int) -> int:
    """An upper bound on the shared memory a candidate ``row`` of TABLES[kernel] takes at head-dim block
    ``block_d`` and ``elem``-byte operands: its pipelined tiles (``stages`` copies), the tiles it keeps, the
    probabilities tile the second dot reads, 1 KiB for barriers and scratch. Checked against what triton 3.7.1
    allocates for sm_90a (bench/compile_report.py, every candidate of the tables and the sweeps that pruned them:
    0.51-0.99 of this), so the CPU tests can hold the tables under a block's limit without compiling."""
    bm, bn, _, stages = row
    if kernel == "fwd":  # K and V tiles through the pipeline, the query tile, P
        tiles = stages * 2 * bn * block_d + bm * block_d + bm * bn
    elif kernel == "dq":  # K and V through the pipeline, the query and dA tiles, dS
        tiles = stages * 2 * bn * block_d + 2 * bm * block_d + bm * bn
    else:  # query and dA tiles through the pipeline and once more transposed for the dots, the key and value tiles, P^T
        tiles = stages * 2 * bm * block_d + 2 * bm * block_d + 2 * bn * block_d + bn * bm
    return elem * tiles + 1024


def _configs(table: dict) -> list[triton.Config]:
    if interpreter_requested():
        return [_INTERPRET]
    unique = {row for rows in table.values() for row in rows}
    return [_cfg(*row) for row in sorted(unique)]


def _tier(block_d: int) -> int:
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


def table_key(q: torch.Tensor, block_d: int) -> tuple[int, int]:
    """The tables' key for a launch on ``q`` at head-dim block ``block_d``: fp32 inputs take the FMA dots' small
    tiles, bf16 / fp16 the tensor cores'."""
    return (4 if q.element_size() >= 4 else 2), _tier(block_d)


def _pruner(table: dict):
    def prune(configs, named_args, **kwargs):
        want = set(table[table_key(named_args["Q"], kwargs["BLOCK_D"])])
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in want]
    return prune


def _autotune(table: dict):
    configs = _configs(table)
    if len(configs) == 1:
        return triton.autotune(configs=configs, key=["BLOCK_D", "GATE", "CAUSAL"])
    return triton.autotune(configs=configs, key=["BLOCK_D", "GATE", "CAUSAL"],
                           prune_configs_by={"early_config_prune": _pruner(table)})


# ----------------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _load_tile(ptrs, rmask, dmask, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A (rows, BLOCK_D) tile; masks only where rows may run past N or D is not a power of two."""
    if CHECK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return x


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, EMU_BF16: tl.constexpr):
    """tl.dot with fp32 accumulation. EMU_BF16 (bfloat16 under the interpreter, see `_round`): upcast the operands
    first, as the interpreter's tl.dot multiplies bfloat16 bit patterns as integers (triton 3.7,
    triton-lang/triton#11584). Products of bfloat16 values are exact in fp32, so this computes what the GPU's bf16
    MMA does."""
    if EMU_BF16:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _round(x, dtype: tl.constexpr, EMU_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``: to nearest, ties to even, as the GPU's conversion (cvt.rn) does. EMU_BF16
    (bfloat16 under the interpreter): the interpreter's fp32 -> bfloat16 cast truncates instead (triton 3.7: it
    drops the low 16 bits, a bias toward zero of up to a whole ulp), so round first, by Veltkamp's splitting:
    with t = x (2^16 + 1), t - (t - x) is x rounded to nearest even at bf16's 8 bits (exact for |x| < 2^111;
    where t overflows x goes on as it is, and so does inf; NaN stays NaN). Three flops, where bit arithmetic costs
    the interpreter 8x more. The stored outputs and gradients go through here, the probabilities and dS the dots take
    through `_dot_rounded`; on the GPU both are the plain cast. Truncated, the interpreter's bf16 dq / dk were up to
    2x further from the fp32 reference than flash-attention's accuracy rule allows, where rounded to nearest they
    meet it (tests/kernels/test_attention_fa_rule.py)."""
    if EMU_BF16:
        if dtype == tl.bfloat16:
            t = x * 65537.0
            r = t - (t - x)
            x = tl.where(r == r, r, tl.where(x == x, x, float("nan")))  # a NaN's payload may sit in the low bits
    return x.to(dtype)


@triton.jit
def _dot_rounded(a, b, PRECISION: tl.constexpr, EMU_BF16: tl.constexpr):
    """fp32 ``a`` (probabilities, dS) rounded to ``b``'s dtype as the tensor cores take it, times ``b``, fp32
    accumulation. EMU_BF16: `_round`'s rounding, written out (the interpreter's call into a nested jit function
    costs more than the arithmetic, and this runs once per tile pair; |a| stays far below 2^111: p <= 1, and
    |dS| <= |dP| + |Delta|), then fp32 dots as in `_dot`."""
    if EMU_BF16:
        t = a * 65537.0
        c = tl.dot(t - (t - a), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a.to(b.dtype), b, input_precision=PRECISION)
    return c


@triton.jit
def _kv_tile(X, n0, cols64, stride_n, dcols, cmask, dmask, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
             TMA: tl.constexpr):
    """Key (or value) rows [n0, n0 + BLOCK_N) of one kv head: through its tensor descriptor (TMA on Hopper: one
    asynchronous bulk copy into shared memory, no per-element addresses; rows past N and columns past D read as
    zeros), or, TMA False, through pointers with `_load_tile`'s masks."""
    if TMA:
        x = X.load([n0, 0])
    else:
        x = _load_tile(X + cols64[:, None] * stride_n + dcols[None, :], cmask, dmask, MASKED, EVEN_D)
    return x


@triton.jit
def _kv_source(X, stride_n, N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """What `_kv_tile` reads from: a (N, D) tensor descriptor of the kv head X points at, or X itself."""
    if TMA:
        src = tl.make_tensor_descriptor(X, shape=[N, D], strides=[stride_n, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        src = X
    return src


@triton.jit
def _fwd_range(
    acc, l_i, m_i, q, K, V, sk_n, sv_n, rows, starts, dcols, dmask, n_lo, n_hi, N, qk_scale,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, EMU_BF16: tl.constexpr, TMA: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Online softmax over key blocks [n_lo, n_hi) for one query tile. K, V point at this kv head; N is the key
    count. MASKED: the causal and document masks (CAUSAL), or only the key-row bound (the ragged last block of a
    non-causal rectangle)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cols64 = cols.to(tl.int64)
        cmask = cols < N
        k = _kv_tile(K, n0, cols64, sk_n, dcols, cmask, dmask, MASKED, EVEN_D, TMA)
        s = _dot(q, tl.trans(k), PRECISION, EMU_BF16) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            if CAUSAL:
                ok = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= starts[:, None])
            else:
                ok = cmask[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row whose keys so far are all masked has max -inf: shift by 0 so exp2 gives 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(V, n0, cols64, sv_n, dcols, cmask, dmask, MASKED, EVEN_D, TMA)
        acc = acc * alpha[:, None] + _dot_rounded(p, v, PRECISION, EMU_BF16)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_ranges(START, m0, rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MERGE: tl.constexpr):
    """Per-row document starts of query tile [m0, m0 + BLOCK_M) and its key-block ranges: [a, b) cut by a
    document start (masked), [b, c) fully visible to every row (unmasked), [c, hi) cut by the diagonal
    (masked). Keys before ``a`` (other documents) are never read. An unmasked middle of at most MERGE blocks
    is merged into one masked loop [a, hi) (see `_merge`)."""
    starts = tl.load(START + tl.minimum(rows, N - 1))  # rows past N borrow the last row's start
    lo = tl.load(START + m0)
    lo_last = tl.load(START + tl.minimum(m0 + BLOCK_M, N) - 1)
    hi = tl.minimum(m0 + BLOCK_M, N)
    a = (lo // BLOCK_N) * BLOCK_N
    c = ((m0 + 1) // BLOCK_N) * BLOCK_N  # blocks ending at or before row m0's diagonal
    b = tl.minimum(tl.cdiv(lo_last, BLOCK_N) * BLOCK_N, c)  # blocks starting at or after every row's start
    b, c = _merge(b, c, hi, MERGE * BLOCK_N)
    return starts, a, b, c, hi


@triton.jit
def _merge(b, c, hi, most):
    """Ranges [a, b) masked, [b, c) unmasked, [c, hi) masked -> [a, hi) masked where c - b <= most. Each loop
    starts its software pipeline afresh, waiting a full load latency for its first tile; with short documents,
    where the three ranges are a few blocks each, that costs more than masking a block or two."""
    short = (c - b) <= most
    return tl.where(short, hi, b), tl.where(short, hi, c)


@triton.jit
def _tile_start(ORDER, pid, BLOCK: tl.constexpr, ORDER_BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """First row of the tile program ``pid`` works on. ORDER lists the super-tiles of ORDER_BLOCK rows
    heaviest first (`tile_orders`); a super-tile's ORDER_BLOCK // BLOCK tiles run in consecutive programs,
    heaviest first as well (the last one for query tiles, HEAVY_LAST; the first one for key tiles)."""
    tl.static_assert(ORDER_BLOCK % BLOCK == 0)
    PER: tl.constexpr = ORDER_BLOCK // BLOCK
    sub = pid % PER
    if HEAVY_LAST:
        sub = PER - 1 - sub
    return (tl.load(ORDER + pid // PER) * PER + sub) * BLOCK


# ----------------------------------------------------------------------------------------------------------
# forward


@_autotune(_FWD)
@triton.jit
def _fwd_kernel(
    Q, K, V, G, OUT, A, LSE, START, ORDER,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, so_n, so_h,
    N, NK, D, GROUP, qk_scale,
    GATE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, EMU_BF16: tl.constexpr, ORDER_BLOCK: tl.constexpr, MERGE: tl.constexpr, TMA: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if CAUSAL:
        m0 = _tile_start(ORDER, tl.program_id(0), BLOCK_M, ORDER_BLOCK, True)  # the longest tiles first
        n_keys = N
    else:  # a rectangle: N queries x NK keys, every tile the same work, in plain order
        m0 = tl.program_id(0) * BLOCK_M
        n_keys = NK
    h = tl.program_id(1)
    if m0 < N:  # the last super-tile may be short: its missing tiles have nothing to do
        rows = m0 + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        rmask = rows < N
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        if CAUSAL:
            starts, a, b, c, hi = _key_ranges(START, m0, rows, N, BLOCK_M, BLOCK_N, MERGE)
        else:  # every key: the whole blocks unmasked, the ragged last one masked at NK
            starts, b, c, hi = rows, 0, (NK // BLOCK_N) * BLOCK_N, NK

        q = _load_tile(Q + rows64[:, None] * sq_n + h * sq_h + dcols[None, :], rmask, dmask, True, EVEN_D)
        kvh = (h // GROUP).to(tl.int64)
        Kh = _kv_source(K + kvh * sk_h, sk_n, n_keys, D, BLOCK_N, BLOCK_D, TMA)
        Vh = _kv_source(V + kvh * sv_h, sv_n, n_keys, D, BLOCK_N, BLOCK_D, TMA)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if CAUSAL:
            acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, Kh, Vh, sk_n, sv_n, rows, starts, dcols, dmask, a, b, N,
                                       qk_scale, True, EVEN_D, BLOCK_N, PRECISION, EMU_BF16, TMA, CAUSAL)
        acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, Kh, Vh, sk_n, sv_n, rows, starts, dcols, dmask, b, c, n_keys,
                                   qk_scale, False, EVEN_D, BLOCK_N, PRECISION, EMU_BF16, TMA, CAUSAL)
        acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, Kh, Vh, sk_n, sv_n, rows, starts, dcols, dmask, c, hi, n_keys,
                                   qk_scale, True, EVEN_D, BLOCK_N, PRECISION, EMU_BF16, TMA, CAUSAL)

        # Only rows past N can have l = 0 (every real row sees its diagonal, or, non-causal, NK > 0 keys).
        l_i = tl.where(l_i > 0, l_i, 1.0)
        attn = acc / l_i[:, None]
        offs = rows64[:, None] * so_n + h * so_h + dcols[None, :]
        omask = rmask[:, None] & dmask[None, :]
        if GATE == 0:
            tl.store(OUT + offs, _round(attn, OUT.dtype.element_ty, EMU_BF16), mask=omask)
        else:
            tl.store(A + offs, _round(attn, A.dtype.element_ty, EMU_BF16), mask=omask)
            if GATE == 1:
                g = tl.load(G + rows64 * sg_n + h * sg_h, mask=rmask, other=0.0).to(tl.float32)
                out = attn * tl.sigmoid(g)[:, None]
            else:
                g = tl.load(G + rows64[:, None] * sg_n + h * sg_h + dcols[None, :], mask=omask, other=0.0)
                out = attn * tl.sigmoid(g.to(tl.float32))
            tl.store(OUT + offs, _round(out, OUT.dtype.element_ty, EMU_BF16), mask=omask)
        tl.store(LSE + h.to(tl.int64) * N + rows, m_i + tl.math.log2(l_i), mask=rmask)


# ----------------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _bwd_pre_kernel(
    DO, A, G, DA, DG, DELTA,
    sdo_n, sdo_h, sa_n, sa_h, sg_n, sg_h, sdg_n, sdg_h,
    N, D,
    GATE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, EMU_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    rmask = rows < N
    dcols = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (dcols < D)[None, :]
    tile = rows64[:, None] * sdo_n + h * sdo_h + dcols[None, :]  # dA is written in dout's layout
    do = tl.load(DO + tile, mask=mask, other=0.0).to(tl.float32)
    attn = tl.load(A + rows64[:, None] * sa_n + h * sa_h + dcols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE == 0:
        da = do
    else:
        if GATE == 1:
            g = tl.load(G + rows64 * sg_n + h * sg_h, mask=rmask, other=0.0).to(tl.float32)
            sg = tl.sigmoid(g)
            dg = tl.sum(do * attn, 1) * sg * (1.0 - sg)
            tl.store(DG + rows64 * sdg_n + h * sdg_h, _round(dg, DG.dtype.element_ty, EMU_BF16), mask=rmask)
            da = do * sg[:, None]
        else:
            g = tl.load(G + rows64[:, None] * sg_n + h * sg_h + dcols[None, :], mask=mask, other=0.0)
            sg = tl.sigmoid(g.to(tl.float32))
            dg = do * attn * sg * (1.0 - sg)
            tl.store(DG + rows64[:, None] * sdg_n + h * sdg_h + dcols[None, :],
                     _round(dg, DG.dtype.element_ty, EMU_BF16), mask=mask)
            da = do * sg
        # Round dA as the dot products will read it, so Delta is the row sum of exactly those values.
        da = _round(da, DA.dtype.element_ty, EMU_BF16)
        tl.store(DA + tile, da, mask=mask)
        da = da.to(tl.float32)
    tl.store(DELTA + h.to(tl.int64) * N + rows, tl.sum(da * attn, 1), mask=rmask)


@triton.jit
def _dkdv_range(
    dk, dv, k, v, Q, DA, LSE, DELTA, sq_n, sda_n, cols, ends, dcols, dmask, m_lo, m_hi, N, qk_scale,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr, EMU_BF16: tl.constexpr, CAUSAL: tl.constexpr,
):
    """dK, dV of one key tile from query blocks [m_lo, m_hi) of one query head (Q, DA, LSE, DELTA point at it);
    N is the query count. MASKED: the causal and document masks (CAUSAL), or only the query-row bound."""
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        rmask = rows < N
        q = _load_tile(Q + rows64[:, None] * sq_n + dcols[None, :], rmask, dmask, MASKED, EVEN_D)
        da = _load_tile(DA + rows64[:, None] * sda_n + dcols[None, :], rmask, dmask, MASKED, EVEN_D)
        if MASKED:
            lse = tl.load(LSE + rows, mask=rmask, other=0.0)
            delta = tl.load(DELTA + rows, mask=rmask, other=0.0)
        else:
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        s_t = _dot(k, tl.trans(q), PRECISION, EMU_BF16) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED:
            if CAUSAL:
                ok = (rows[None, :] >= cols[:, None]) & (rows[None, :] < ends[:, None])
            else:
                ok = rmask[None, :]
            p_t = tl.where(ok, p_t, 0.0)
        dv += _dot_rounded(p_t, da, PRECISION, EMU_BF16)
        dp_t = _dot(v, tl.trans(da), PRECISION, EMU_BF16)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot_rounded(ds_t, q, PRECISION, EMU_BF16)
    return dk, dv


@_autotune(_DKDV)
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DA, LSE, DELTA, END, ORDER, DK, DV,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sda_n, sda_h, sdk_s, sdk_n, sdk_h,
    N, NK, D, GROUP, SPLIT, qk_scale, sm_scale,
    GATE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, EMU_BF16: tl.constexpr, ORDER_BLOCK: tl.constexpr, MERGE: tl.constexpr, TMA: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if CAUSAL:
        n0 = _tile_start(ORDER, tl.program_id(0), BLOCK_N, ORDER_BLOCK, False)  # the longest tiles first
        n_keys = N
    else:  # a rectangle: NK keys seen by all N queries, plain order
        n0 = tl.program_id(0) * BLOCK_N
        n_keys = NK
    kvh = tl.program_id(1) // SPLIT
    part = tl.program_id(1) % SPLIT  # this program's share of the kv head's query heads
    if n0 < n_keys:
        cols = n0 + tl.arange(0, BLOCK_N)
        cols64 = cols.to(tl.int64)
        cmask = cols < n_keys
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        if CAUSAL:
            ends = tl.load(END + tl.minimum(cols, N - 1))
            end_first = tl.load(END + n0)
            q_hi = tl.load(END + tl.minimum(n0 + BLOCK_N, N) - 1)  # one past the last row that sees any key here
            # Query-block ranges: [a, b) cut by the diagonal (masked), [b, c) seeing every key of the tile
            # (unmasked), [c, q_hi) cut by a document end (masked).
            a = (n0 // BLOCK_M) * BLOCK_M
            b = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, q_hi)
            c = tl.maximum((end_first // BLOCK_M) * BLOCK_M, b)
            b, c = _merge(b, c, q_hi, MERGE * BLOCK_M)
        else:  # every query: the whole blocks unmasked, the ragged last one masked at N
            ends, b, c, q_hi = cols, 0, (N // BLOCK_M) * BLOCK_M, N

        kvh64 = kvh.to(tl.int64)
        k = _load_tile(K + cols64[:, None] * sk_n + kvh64 * sk_h + dcols[None, :], cmask, dmask, True, EVEN_D)
        v = _load_tile(V + cols64[:, None] * sv_n + kvh64 * sv_h + dcols[None, :], cmask, dmask, True, EVEN_D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        heads = GROUP // SPLIT
        h_lo = kvh * GROUP + part * heads
        for h in range(h_lo, h_lo + heads):  # query heads reading this kv head, this program's share
            # (the loop variable is a plain int under the interpreter: no .to(); H * N and H * D fit in int32)
            Qh = Q + h * sq_h
            DAh = DA + h * sda_h
            LSEh = LSE + h * N
            DELTAh = DELTA + h * N
            if CAUSAL:
                dk, dv = _dkdv_range(dk, dv, k, v, Qh, DAh, LSEh, DELTAh, sq_n, sda_n, cols, ends, dcols, dmask,
                                     a, b, N, qk_scale, True, EVEN_D, BLOCK_M, PRECISION, EMU_BF16, CAUSAL)
            dk, dv = _dkdv_range(dk, dv, k, v, Qh, DAh, LSEh, DELTAh, sq_n, sda_n, cols, ends, dcols, dmask,
                                 b, c, N, qk_scale, False, EVEN_D, BLOCK_M, PRECISION, EMU_BF16, CAUSAL)
            dk, dv = _dkdv_range(dk, dv, k, v, Qh, DAh, LSEh, DELTAh, sq_n, sda_n, cols, ends, dcols, dmask,
                                 c, q_hi, N, qk_scale, True, EVEN_D, BLOCK_M, PRECISION, EMU_BF16, CAUSAL)
        # SPLIT > 1: DK, DV are fp32 partial sums (SPLIT, N, KV, D), summed by the launcher
        offs = part.to(tl.int64) * sdk_s + cols64[:, None] * sdk_n + kvh64 * sdk_h + dcols[None, :]
        mask = cmask[:, None] & dmask[None, :]
        tl.store(DK + offs, _round(dk * sm_scale, DK.dtype.element_ty, EMU_BF16), mask=mask)
        tl.store(DV + offs, _round(dv, DV.dtype.element_ty, EMU_BF16), mask=mask)


@triton.jit
def _dq_range(
    dq, q, da, lse, delta, K, V, sk_n, sv_n, rows, starts, dcols, dmask, n_lo, n_hi, N, qk_scale,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, EMU_BF16: tl.constexpr, TMA: tl.constexpr, CAUSAL: tl.constexpr,
):
    """dQ of one query tile from key blocks [n_lo, n_hi) (N: the key count; MASKED as in `_fwd_range`)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cols64 = cols.to(tl.int64)
        cmask = cols < N
        k = _kv_tile(K, n0, cols64, sk_n, dcols, cmask, dmask, MASKED, EVEN_D, TMA)
        v = _kv_tile(V, n0, cols64, sv_n, dcols, cmask, dmask, MASKED, EVEN_D, TMA)
        s = _dot(q, tl.trans(k), PRECISION, EMU_BF16) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            if CAUSAL:
                ok = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= starts[:, None])
            else:
                ok = cmask[None, :]
            p = tl.where(ok, p, 0.0)
        dp = _dot(da, tl.trans(v), PRECISION, EMU_BF16)
        ds = p * (dp - delta[:, None])
        dq += _dot_rounded(ds, k, PRECISION, EMU_BF16)
    return dq


@_autotune(_DQ)
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DA, LSE, DELTA, START, ORDER, DQ,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sda_n, sda_h, sdq_n, sdq_h,
    N, NK, D, GROUP, qk_scale, sm_scale,
    GATE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, EMU_BF16: tl.constexpr, ORDER_BLOCK: tl.constexpr, MERGE: tl.constexpr, TMA: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if CAUSAL:
        m0 = _tile_start(ORDER, tl.program_id(0), BLOCK_M, ORDER_BLOCK, True)
        n_keys = N
    else:  # as in the forward: plain order, every key
        m0 = tl.program_id(0) * BLOCK_M
        n_keys = NK
    h = tl.program_id(1)
    if m0 < N:
        h64 = h.to(tl.int64)
        rows = m0 + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        rmask = rows < N
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        if CAUSAL:
            starts, a, b, c, hi = _key_ranges(START, m0, rows, N, BLOCK_M, BLOCK_N, MERGE)
        else:
            starts, b, c, hi = rows, 0, (NK // BLOCK_N) * BLOCK_N, NK

        q = _load_tile(Q + rows64[:, None] * sq_n + h64 * sq_h + dcols[None, :], rmask, dmask, True, EVEN_D)
        da = _load_tile(DA + rows64[:, None] * sda_n + h64 * sda_h + dcols[None, :], rmask, dmask, True, EVEN_D)
        lse = tl.load(LSE + h64 * N + rows, mask=rmask, other=0.0)
        delta = tl.load(DELTA + h64 * N + rows, mask=rmask, other=0.0)
        kvh = (h // GROUP).to(tl.int64)
        Kh = _kv_source(K + kvh * sk_h, sk_n, n_keys, D, BLOCK_N, BLOCK_D, TMA)
        Vh = _kv_source(V + kvh * sv_h, sv_n, n_keys, D, BLOCK_N, BLOCK_D, TMA)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if CAUSAL:
            dq = _dq_range(dq, q, da, lse, delta, Kh, Vh, sk_n, sv_n, rows, starts, dcols, dmask, a, b, N, qk_scale,
                           True, EVEN_D, BLOCK_N, PRECISION, EMU_BF16, TMA, CAUSAL)
        dq = _dq_range(dq, q, da, lse, delta, Kh, Vh, sk_n, sv_n, rows, starts, dcols, dmask, b, c, n_keys, qk_scale,
                       False, EVEN_D, BLOCK_N, PRECISION, EMU_BF16, TMA, CAUSAL)
        dq = _dq_range(dq, q, da, lse, delta, Kh, Vh, sk_n, sv_n, rows, starts, dcols, dmask, c, hi, n_keys,
                       qk_scale, True, EVEN_D, BLOCK_N, PRECISION, EMU_BF16, TMA, CAUSAL)
        offs = rows64[:, None] * sdq_n + h64 * sdq_h + dcols[None, :]
        tl.store(DQ + offs, _round(dq * sm_scale, DQ.dtype.element_ty, EMU_BF16),
                 mask=rmask[:, None] & dmask[None, :])


# ----------------------------------------------------------------------------------------------------------
# launchers


def _gate_mode(gate: torch.Tensor | None) -> int:
    if gate is None:
        return GATE_NONE
    return GATE_HEAD if gate.dim() == 2 else GATE_ELEM


def _gate_strides(gate: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if gate is None else (gate.stride(0), gate.stride(1))


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> dict:
    N, H, D = q.shape
    block_d = max(16, triton.next_power_of_2(D))
    tma = use_tma(k, v)
    if tma:
        _ensure_allocator(q.device)
    return dict(
        N=N, NK=k.shape[0], D=D, GROUP=H // k.shape[1], EVEN_D=block_d == D, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        EMU_BF16=triton_utils.interpreted(q.device) and q.dtype == torch.bfloat16,  # see `_dot`, `_round`
        ORDER_BLOCK=_order_block(),
        MERGE=1 if interpreter_requested() else 2,  # the tests' short sequences run both the merged and split ranges
        TMA=tma, CAUSAL=causal,
    )


TMA = True  # the switch: False keeps every load on pointers (tests run both ways)


def use_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """K/V tiles through tensor descriptors: triton has them, the target is Hopper or newer (TMA; the interpreter
    runs them too), and the tensors meet TMA's alignment (base address and row stride multiples of 16 bytes)."""
    if not TMA or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if not triton_utils.interpreted(k.device):
        from triton.runtime.driver import driver

        if driver.active.get_current_target().arch < 90:
            return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               and t.stride(1) * t.element_size() % 16 == 0 for t in (k, v))


def _ensure_allocator(device: torch.device) -> None:
    """Device-side descriptors need a little global scratch, which triton asks an allocator for at launch. Set one
    (torch's caching allocator on the tensors' device) unless the caller has; the setting is per context, and
    the backward runs in autograd's thread, so each launch checks."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def _order_block() -> int:
    """Rows per super-tile of the launch order: a multiple of every tile size (the GPU's configs use at most
    128-row tiles); 32 under the interpreter, so its 16-row tiles run two to a super-tile there too."""
    return 32 if interpreter_requested() else 128


def tile_orders(start: torch.Tensor, end: torch.Tensor | None, block: int):
    """Launch orders (int32, heaviest first) of the super-tiles of ``block`` rows: causal load balancing.
    A query tile's work is the keys from its first row's document start to its last row; a key tile's, the
    queries from its first key to its last key's document end. Grids run roughly in program order, so the
    longest tiles start first and the short ones fill the tail (the sawtooth of one batch row after another,
    or documents of mixed lengths, would otherwise leave long tiles for the end). Returns (query order, key
    order), the key order None without ``end``. Fixed-shape ops: no host sync."""
    N = start.numel()
    s0 = torch.arange(0, N, block, device=start.device, dtype=torch.int64)
    last = torch.clamp(s0 + block, max=N) - 1
    q_order = torch.argsort(last + 1 - start[s0].long(), descending=True, stable=True).to(torch.int32)
    if end is None:
        return q_order, None
    return q_order, torch.argsort(end[last].long() - s0, descending=True, stable=True).to(torch.int32)


def dkdv_split(n_tokens: int, kv_heads: int, group: int, device: torch.device) -> int:
    """Programs per (key tile, kv head) in the dK/dV kernel, each taking ``group // split`` of the kv head's
    query heads. One program per kv head accumulates over every query head in registers (no partial sums), but
    at grouped-query attention on one sequence that is few programs: 4096 tokens, 4 kv heads, 128-key tiles
    make 128 programs for an H100's 132 SMs, and with causal masking the first tiles do 2x the mean's work.
    So split until there are two programs per SM; the splits' fp32 partial sums are added by the launcher."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 132  # an H100's (the compile report's target); under the interpreter, splitting is what is tested
    tiles = triton.cdiv(n_tokens, 128) * kv_heads
    for split in range(1, group + 1):
        if group % split == 0 and tiles * split >= 2 * sms:
            return split
    return group


def _grid(N: int, order_block: int, block: int, heads: int) -> tuple[int, int]:
    return triton.cdiv(N, order_block) * (order_block // block), heads


def _rect_check(fn: str, q, k, v, gate) -> None:
    """The non-causal rectangle mode's inputs: q (Nq, H, D), k, v (Nk, KV, D), no gate."""
    if gate is not None:
        raise ValueError(f"{fn}: causal=False (ring attention's rectangle) takes no gate; got one of shape "
                         f"{tuple(gate.shape)}")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2] or k.shape[1] == 0 \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"{fn}: causal=False needs q (Nq, H, D), k = v (Nk, KV, D) with H a multiple of KV; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels read the last dim at stride 1 (any token and head strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def attn_fwd(q, k, v, gate, start, scale: float, order: torch.Tensor | None = None, causal: bool = True):
    """q (N, H, D), k, v (N, KV, D), gate None / (N, H) / (N, H, D), start (N,) int32 ->
    out (N, H, D), A (N, H, D) the ungated attention (empty without a gate: out is A), lse (H, N) fp32 base 2.
    ``order``: the query tiles' launch order (`tile_orders`), computed here if not given.

    ``causal=False``: the rectangle of ring attention's cross-block steps. q (Nq, H, D) against k, v (Nk, KV, D),
    every query row attending every key row; gate must be None, ``start`` and ``order`` are ignored (may be None).
    Returns out (Nq, H, D), A empty, lse (H, Nq) fp32 base 2; no keys (Nk = 0) give out 0 and lse -inf."""
    if not causal:
        _rect_check("attn_fwd", q, k, v, gate)
        q, k, v = (_rows_contiguous(t) for t in (q, k, v))
    N, H, D = q.shape
    out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    attn = torch.empty_like(out) if gate is not None else out.new_empty(0)
    lse = torch.empty((H, N), dtype=torch.float32, device=q.device)
    if N == 0:
        return out, attn, lse
    if not causal and k.shape[0] == 0:
        return out.zero_(), attn, lse.fill_(float("-inf"))
    check_interpreted(_fwd_kernel, q.device)
    common = _common(q, k, v, causal)
    sg = _gate_strides(gate)
    if causal:
        if order is None:
            order = tile_orders(start, None, common["ORDER_BLOCK"])[0]
        ob = common["ORDER_BLOCK"]
        grid = lambda meta: _grid(N, ob, meta["BLOCK_M"], H)  # noqa: E731
    else:
        start = order = None
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), H)  # noqa: E731
    _fwd_kernel[grid](
        q, k, v, gate, out, attn if gate is not None else None, lse, start, order,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), sg[0], sg[1],
        out.stride(0), out.stride(1), qk_scale=scale * LOG2E, GATE=_gate_mode(gate), **common,
    )
    return out, attn, lse


def attn_bwd(dout, q, k, v, gate, attn, lse, start, end, scale: float, split: int | None = None,
             causal: bool = True):
    """Gradients of `attn_fwd`: dq (N, H, D), dk, dv (N, KV, D), dgate (gate's shape, contiguous; empty
    without a gate). ``attn`` is the ungated attention output (``out`` itself without a gate). ``split``:
    programs per kv head in the dK/dV kernel (a divisor of H // KV), `dkdv_split` if None.

    ``causal=False``: the rectangle's backward (see `attn_fwd`), as flash-attention's: gate None, ``start`` and
    ``end`` ignored (may be None). ``attn`` and ``lse`` (H, Nq, base 2) may be the *final* output and log-sum-exp,
    merged over several key blocks: P = exp2(s - lse) and Delta = rowsum(dout * attn) then give this block's
    share of dq and its dk, dv. dout is taken in q's dtype. Returns dq (Nq, H, D), dk, dv (Nk, KV, D) in the
    inputs' dtypes, dgate empty."""
    if not causal:
        _rect_check("attn_bwd", q, k, v, gate)
        q, k, v, attn = (_rows_contiguous(t) for t in (q, k, v, attn))
        dout = _rows_contiguous(dout.to(q.dtype))
        lse = lse.to(torch.float32).contiguous()
    N, H, D = q.shape
    NK, KV = k.shape[0], k.shape[1]
    dq = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if gate is not None else q.new_empty(0)
    if N == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v), dgate
    if not causal and NK == 0:
        return dq.zero_(), torch.empty_like(k), torch.empty_like(v), dgate
    check_interpreted(_bwd_pre_kernel, q.device)
    mode = _gate_mode(gate)
    common = _common(q, k, v, causal)
    group = common["GROUP"]
    split = dkdv_split(NK, KV, group, q.device) if split is None else split
    if split < 1 or group % split:
        raise ValueError(f"attn_bwd: split={split} must divide the {group} query heads per kv head")
    if split == 1:
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        dk_out, dv_out, sdk = dk, dv, (0, dk.stride(0), dk.stride(1))
    else:  # fp32 partial sums per split, contiguous (split, NK, KV, D)
        dk_out = torch.empty((split, NK, KV, D), dtype=torch.float32, device=q.device)
        dv_out = torch.empty_like(dk_out)
        sdk = dk_out.stride()[:3]
    delta = torch.empty((H, N), dtype=torch.float32, device=q.device)
    da = torch.empty_like(dout) if gate is not None else dout
    pre_rows = 16 if interpreter_requested() else max(1, min(64, 8192 // common["BLOCK_D"]))
    sg = _gate_strides(gate)
    sdg = _gate_strides(dgate if gate is not None else None)
    _bwd_pre_kernel[(triton.cdiv(N, pre_rows), H)](
        dout, attn, gate, da if gate is not None else None, dgate if gate is not None else None, delta,
        dout.stride(0), dout.stride(1), attn.stride(0), attn.stride(1), sg[0], sg[1], sdg[0], sdg[1],
        N, D, GATE=mode, BLOCK_D=common["BLOCK_D"], BLOCK_M=pre_rows, EMU_BF16=common["EMU_BF16"],
        num_warps=4 if common["BLOCK_D"] * pre_rows <= 4096 else 8,
    )
    ob = common["ORDER_BLOCK"]
    if causal:
        q_order, k_order = tile_orders(start, end, ob)
        dkdv_grid = lambda meta: _grid(N, ob, meta["BLOCK_N"], KV * split)  # noqa: E731
        dq_grid = lambda meta: _grid(N, ob, meta["BLOCK_M"], H)  # noqa: E731
    else:  # every tile the same work: plain order
        start = end = q_order = k_order = None
        dkdv_grid = lambda meta: (triton.cdiv(NK, meta["BLOCK_N"]), KV * split)  # noqa: E731
        dq_grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), H)  # noqa: E731
    common.update(qk_scale=scale * LOG2E, sm_scale=scale, GATE=mode)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               da.stride(0), da.stride(1))
    _bwd_dkdv_kernel[dkdv_grid](
        q, k, v, da, lse, delta, end, k_order, dk_out, dv_out, *strides, *sdk, SPLIT=split, **common,
    )
    _bwd_dq_kernel[dq_grid](
        q, k, v, da, lse, delta, start, q_order, dq, *strides, dq.stride(0), dq.stride(1), **common,
    )
    if split > 1:
        dk = dk_out.sum(0).to(k.dtype)
        dv = dv_out.sum(0).to(v.dtype)
    return dq, dk, dv, dgate
