"""Triton SwiGLU activation: ``y = silu(g) * u`` forward, and its backward from g and u alone.

Elementwise and bandwidth-bound: forward reads g, u and writes y (3 tensors); backward reads dy, g, u and
writes dg, du (5), recomputing sigmoid(g) instead of keeping silu(g) (one activation fewer kept per layer).
Unfused, eager torch writes silu(g) and reads it back in both directions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import compute_dtype

BLOCK = 1024


@triton.jit
def swiglu_math(g, u):
    """silu(g) * u on loaded tiles (also the MoE experts' packed kernel's, kernels/moe_gemm)."""
    return g * tl.sigmoid(g) * u


@triton.jit
def swiglu_grads(dy, g, u):
    """(d g, d u) of silu(g) * u, sigmoid(g) recomputed: d silu(g)/dg = sig (1 + g (1 - sig))."""
    sig = tl.sigmoid(g)
    return dy * u * sig * (1.0 + g * (1.0 - sig)), dy * g * sig


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, N, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(U + offs, mask=mask, other=0.0).to(COMPUTE)
    tl.store(Y + offs, swiglu_math(g, u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, N, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(G + offs, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(U + offs, mask=mask, other=0.0).to(COMPUTE)
    dg, du = swiglu_grads(dy, g, u)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g, u contiguous, same shape -> silu(g) * u in their promoted dtype."""
    y = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
    n = g.numel()
    if n:
        check_interpreted(_swiglu_fwd_kernel, g.device)
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](g, u, y, n, COMPUTE=compute_dtype(g, u), BLOCK=BLOCK,
                                                     num_warps=4)
    return y


def swiglu_bwd(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        check_interpreted(_swiglu_bwd_kernel, g.device)
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](dy, g, u, dg, du, n, COMPUTE=compute_dtype(g, u, dy),
                                                     BLOCK=BLOCK, num_warps=4)
    return dg, du
