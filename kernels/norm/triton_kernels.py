"""Triton RMSNorm: forward and backward, with the residual add and the silu(z) gate fused in.

One kernel pair serves every form (constexpr switches): plain ``x / rms(x) * w``, zero-centred
``* (1 + w)`` (``offset`` 1), gainless, with the residual add ``h = x + r`` before the norm (``h`` is also
written out: it is the new residual stream), and gated ``* silu(z)`` (the delta-rule mixer's output norm).

Forward tiles ``[BLOCK_M, BLOCK_D]`` rows x channels (the whole row is in one tile, so one pass reads x
once and writes y once: the op is bandwidth-bound); every load (the gain included, in the tile's layout) is
issued before the row sum. Backward is persistent: each program walks row blocks pid, pid + P, ..., loading
the next block while it computes the current one, and keeps its share of dw in registers (summed across its
rows once, at the end), written once as a (P, D) partial summed by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import compute_dtype, next_pow2, num_programs, row_block, warps


@triton.jit
def _norm_fwd_kernel(
    X, R, W, Z, Y, H, RSTD,
    M, D, eps, offset,
    HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_Z: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    # Every load is issued before the row sum (a barrier across warps when a row spans them), the gain as
    # a [1, BLOCK_D] row in the tile's own layout (no shared-memory shuffle of it).
    x = tl.load(X + offs, mask=mask, other=0.0).to(COMPUTE)
    if HAS_R:
        r = tl.load(R + offs, mask=mask, other=0.0)
    if HAS_W:
        w = tl.load(W + cols[None, :], mask=cmask[None, :], other=0.0).to(COMPUTE) + offset
    if HAS_Z:
        z = tl.load(Z + offs, mask=mask, other=0.0).to(COMPUTE)
    if HAS_R:
        x = x + r.to(COMPUTE)
        # The residual stream keeps the sum in its own dtype, and the norm reads what is stored, as the
        # unfused `h = x + r; norm(h)` does.
        h = x.to(H.dtype.element_ty)
        tl.store(H + offs, h, mask=mask)
        x = h.to(COMPUTE)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # (BLOCK_M,)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * w
    if HAS_Z:
        y = y * (z * tl.sigmoid(z))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _norm_bwd_load(DY, DH, H, Z, RSTD, rows, cols, M, D, HAS_DH: tl.constexpr, HAS_Z: tl.constexpr):
    """One row block's inputs as stored (converted where used): issued a block ahead of their use."""
    rmask = rows < M
    mask = rmask[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    rstd = tl.load(RSTD + rows[:, None], mask=rmask[:, None], other=0.0)
    h = tl.load(H + offs, mask=mask, other=0.0)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    dh = tl.load(DH + offs, mask=mask, other=0.0) if HAS_DH else dy
    z = tl.load(Z + offs, mask=mask, other=0.0) if HAS_Z else dy
    return rstd, h, dy, dh, z


@triton.jit
def _norm_bwd_kernel(
    DY, DH, H, W, Z, RSTD, DX, DZ, DW,
    M, D, offset, n_prog,
    HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_Z: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_W:
        w = tl.load(W + cols[None, :], mask=cmask[None, :], other=0.0).to(COMPUTE) + offset
    # dw summed over this program's rows elementwise in a tile (one cross-row sum at the end, not one per block)
    dw = tl.zeros([BLOCK_M, BLOCK_D], dtype=COMPUTE)
    step = n_prog * BLOCK_M
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rstd, n_h, n_dy, n_dh, n_z = _norm_bwd_load(DY, DH, H, Z, RSTD, rows, cols, M, D, HAS_DH, HAS_Z)
    for _ in range(pid * BLOCK_M, M, step):
        rstd, h, dy, dh, z = n_rstd, n_h, n_dy, n_dh, n_z
        # the next block's loads go out before this block's arithmetic and its row sums
        n_rstd, n_h, n_dy, n_dh, n_z = _norm_bwd_load(DY, DH, H, Z, RSTD, rows + step, cols, M, D, HAS_DH, HAS_Z)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        rstd = rstd.to(COMPUTE)
        xhat = h.to(COMPUTE) * rstd
        dy = dy.to(COMPUTE)
        if HAS_Z:
            z = z.to(COMPUTE)
            sig = tl.sigmoid(z)
            n = xhat * w if HAS_W else xhat
            # d silu(z)/dz = sig (1 + z (1 - sig))
            tl.store(DZ + offs, (dy * n * sig * (1.0 + z * (1.0 - sig))).to(DZ.dtype.element_ty), mask=mask)
            dy = dy * z * sig
        if HAS_W:
            dw += dy * xhat
            dy = dy * w
        c = tl.sum(dy * xhat, axis=1) / D  # (BLOCK_M,)
        dx = (dy - xhat * c[:, None]) * rstd
        if HAS_DH:
            dx += dh.to(COMPUTE)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        rows += step
    if HAS_W:
        tl.store(DW + pid * D + cols, tl.sum(dw, axis=0), mask=cmask)


def norm_fwd(x, residual, weight, z, eps: float, offset: float, out_dtype: torch.dtype | None = None):
    """x, residual, z: (M, D) contiguous; weight: (D,) or None. -> y (in out_dtype, default h's), h (empty
    without residual), rstd (M,)."""
    M, D = x.shape
    h_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    y = torch.empty((M, D), dtype=out_dtype or h_dtype, device=x.device)
    h = torch.empty((M, D) if residual is not None else (0,), dtype=h_dtype, device=x.device)
    cdt = compute_dtype(x, residual, z)
    rstd = torch.empty(M, dtype=torch.float64 if cdt == tl.float64 else torch.float32, device=x.device)
    BLOCK_D = next_pow2(D)
    BLOCK_M = min(row_block(BLOCK_D), next_pow2(M))
    check_interpreted(_norm_fwd_kernel, x.device)
    _norm_fwd_kernel[(triton.cdiv(M, BLOCK_M),)](
        x, residual, weight, z, y, h, rstd, M, D, eps, offset,
        HAS_R=residual is not None, HAS_W=weight is not None, HAS_Z=z is not None,
        COMPUTE=cdt, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=warps(BLOCK_M * BLOCK_D),
    )
    return y, h, rstd


def norm_bwd(dy, dh, h, weight, z, rstd, offset: float):
    """Gradients of `norm_fwd`: dx (M, D) in h's dtype (residual grad included), dw (D,) fp32 or empty,
    dz (M, D) or empty. ``h`` is the normalised input (the sum when there was a residual)."""
    M, D = h.shape
    dx = torch.empty((M, D), dtype=h.dtype, device=h.device)
    dz = torch.empty_like(z) if z is not None else h.new_empty(0)
    cdt = compute_dtype(h, dy, z)
    BLOCK_D = next_pow2(D)
    BLOCK_M = min(row_block(BLOCK_D), next_pow2(M))
    n_prog = num_programs(h.device, triton.cdiv(M, BLOCK_M))
    acc_dtype = torch.float64 if cdt == tl.float64 else torch.float32
    dw_part = torch.empty((n_prog, D) if weight is not None else (0,), dtype=acc_dtype, device=h.device)
    check_interpreted(_norm_bwd_kernel, h.device)
    _norm_bwd_kernel[(n_prog,)](
        dy, dh, h, weight, z, rstd, dx, dz, dw_part, M, D, offset, n_prog,
        HAS_DH=dh is not None, HAS_W=weight is not None, HAS_Z=z is not None,
        COMPUTE=cdt, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=warps(BLOCK_M * BLOCK_D),
    )
    dw = dw_part.sum(0) if weight is not None else dw_part
    return dx, dw, dz
