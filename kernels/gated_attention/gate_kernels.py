"""Triton sigmoid output gate: ``out = attn * sigmoid(gate)`` forward, and its backward, each one pass.

For attention backends whose kernel does not take the gate (torch SDPA, flex attention): unfused, eager
torch runs sigmoid, the product and, in the backward, four more elementwise kernels (s, dout * s,
dout * attn, s (1 - s) and their product) plus a sum over D for a per-head gate, each a full read and write.
Here the forward reads attn and gate and writes out (3 tensors); the backward reads dout, attn, gate and
writes d_attn, d_gate (5), recomputing sigmoid(gate) rather than keeping it (no activation saved beyond
attn, which the attention backend keeps for its own backward anyway).

Layouts: attn, dout (M, D) contiguous rows (M = tokens x heads); gate (M, D) elementwise or (M,) headwise.
The forward and the elementwise backward walk the flat M * D elements in 1-D blocks (no lanes lost to a
head dim that is not a power of two); the headwise backward tiles [BLOCK_M, BLOCK_D] rows so that a
row's d_gate = sum over D of dout attn s (1 - s) is one in-register reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import compute_dtype, fast_math, next_pow2, row_block, sigmoid, warps

# Elements per program of the 1-D kernels: 4 warps x 32 lanes x 8 elements, i.e. 16-byte bf16 vectors
# per lane (as kernels/swiglu); memory-bound, so bigger blocks only cost occupancy at small M * D.
BLOCK = 1024


@triton.jit
def _gate_fwd_kernel(A, G, OUT, N, D: tl.constexpr, HEADWISE: tl.constexpr, COMPUTE: tl.constexpr,
                     FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    # headwise: one gate per row of D. D is a compile-time constant (a variant per head dim) so that the division
    # becomes a multiply-high and shifts; with a runtime D the sm_90a PTX held a div.s64 (a software routine of
    # tens of instructions) in every thread, in a kernel that has a few instructions per element to spare.
    g = tl.load(G + (offs // D if HEADWISE else offs), mask=mask, other=0.0).to(COMPUTE)
    tl.store(OUT + offs, (a * sigmoid(g, FAST)).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(DO, A, G, DA, DG, N, COMPUTE: tl.constexpr, FAST: tl.constexpr, BLOCK: tl.constexpr):
    """Elementwise gate: d_attn = dout s, d_gate = dout attn s (1 - s)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    do = tl.load(DO + offs, mask=mask, other=0.0).to(COMPUTE)
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(G + offs, mask=mask, other=0.0).to(COMPUTE)
    s = sigmoid(g, FAST)
    tl.store(DA + offs, (do * s).to(DA.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (do * a * s * (1.0 - s)).to(DG.dtype.element_ty), mask=mask)


@triton.jit
def _gate_headwise_bwd_kernel(DO, A, G, DA, DG, M, D, COMPUTE: tl.constexpr, FAST: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per-head gate (one per row): d_attn = dout s, d_gate = s (1 - s) sum_D dout attn."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    mask = rmask[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    do = tl.load(DO + offs, mask=mask, other=0.0).to(COMPUTE)
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(G + rows, mask=rmask, other=0.0).to(COMPUTE)
    s = sigmoid(g, FAST)
    tl.store(DA + offs, (do * s[:, None]).to(DA.dtype.element_ty), mask=mask)
    tl.store(DG + rows, (tl.sum(do * a, axis=1) * s * (1.0 - s)).to(DG.dtype.element_ty), mask=rmask)


def gate_fwd(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """attn (M, D), gate (M, D) or (M,), contiguous -> attn * sigmoid(gate) (M, D) in attn's dtype."""
    M, D = attn.shape
    out = torch.empty_like(attn)
    n = attn.numel()
    if n:
        cdt = compute_dtype(attn, gate)
        check_interpreted(_gate_fwd_kernel, attn.device)
        _gate_fwd_kernel[(triton.cdiv(n, BLOCK),)](
            attn, gate, out, n, D if gate.dim() == 1 else 1, HEADWISE=gate.dim() == 1, COMPUTE=cdt, FAST=fast_math(attn.device, cdt),
            BLOCK=BLOCK, num_warps=4,
        )
    return out


def gate_bwd(dout: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `gate_fwd`: d_attn (M, D) in attn's dtype, d_gate in gate's shape and dtype."""
    M, D = attn.shape
    d_attn, d_gate = torch.empty_like(attn), torch.empty_like(gate)
    if not attn.numel():
        return d_attn, d_gate.zero_()  # D == 0: a headwise gate's sum over nothing
    cdt = compute_dtype(attn, gate, dout)
    fast = fast_math(attn.device, cdt)
    if gate.dim() == 1:
        BLOCK_D = next_pow2(D)
        BLOCK_M = min(row_block(BLOCK_D), next_pow2(M))
        check_interpreted(_gate_headwise_bwd_kernel, attn.device)
        _gate_headwise_bwd_kernel[(triton.cdiv(M, BLOCK_M),)](
            dout, attn, gate, d_attn, d_gate, M, D, COMPUTE=cdt, FAST=fast, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
            num_warps=warps(BLOCK_M * BLOCK_D),
        )
    else:
        n = attn.numel()
        check_interpreted(_gate_bwd_kernel, attn.device)
        _gate_bwd_kernel[(triton.cdiv(n, BLOCK),)](dout, attn, gate, d_attn, d_gate, n, COMPUTE=cdt, FAST=fast,
                                                   BLOCK=BLOCK, num_warps=4)
    return d_attn, d_gate
