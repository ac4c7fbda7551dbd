"""RMSNorm as torch custom ops (forward, backward) with fake implementations, an autograd.Function, and
the public `rms_norm` that picks the backend.

The custom ops are opaque to torch.compile (it traces their fake implementations for shapes), so a
compiled model calls the Triton kernels without graph breaks, on the GPU and under the interpreter alike.
(``torch.library.triton_op`` would let Inductor see inside, but its fake mode runs the kernel body, which
the interpreter cannot do on fake tensors; these kernels are already fused, so nothing is lost.)
"""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.norm.reference import rms_norm_reference


@torch.library.custom_op("hybridtron::rms_norm_fwd", mutates_args=())
def _fwd(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, z: torch.Tensor | None,
    eps: float, offset: float, out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.norm.triton_kernels import norm_fwd

    return norm_fwd(x, residual, weight, z, eps, offset, out_dtype)


@_fwd.register_fake
def _(x, residual, weight, z, eps, offset, out_dtype):
    dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    rdtype = torch.float64 if torch.float64 in (x.dtype, dtype, getattr(z, "dtype", None)) else torch.float32
    h = x.new_empty(x.shape if residual is not None else (0,), dtype=dtype)
    return x.new_empty(x.shape, dtype=out_dtype or dtype), h, x.new_empty(x.shape[0], dtype=rdtype)


@torch.library.custom_op("hybridtron::rms_norm_bwd", mutates_args=())
def _bwd(
    dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
    z: torch.Tensor | None, rstd: torch.Tensor, offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.norm.triton_kernels import norm_bwd

    return norm_bwd(dy, dh, h, weight, z, rstd, offset)


@_bwd.register_fake
def _(dy, dh, h, weight, z, rstd, offset):
    dw = h.new_empty(weight.shape if weight is not None else (0,), dtype=rstd.dtype)
    dz = torch.empty_like(z) if z is not None else h.new_empty(0)
    return torch.empty_like(h), dw, dz


class RMSNormFunction(torch.autograd.Function):
    """(x, residual, weight, z) -> (y, h); h is empty without a residual. Inputs are (M, D) contiguous; y is
    in out_dtype, or h's dtype when None."""

    @staticmethod
    def forward(ctx, x, residual, weight, z, eps, offset, out_dtype=None):
        y, h, rstd = torch.ops.hybridtron.rms_norm_fwd(x, residual, weight, z, eps, offset, out_dtype)
        ctx.save_for_backward(h if residual is not None else x, weight, z, rstd)
        ctx.offset = offset
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
        ctx.set_materialize_grads(False)
        if residual is None:
            ctx.mark_non_differentiable(h)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, z, rstd = ctx.saved_tensors
        if ctx.dtypes[1] is None:  # no residual: h was an empty placeholder (compiled graphs still pass it a grad)
            dh = None
        if dy is None:  # only the residual output was used
            dy = torch.zeros_like(h)
        dx, dw, dz = torch.ops.hybridtron.rms_norm_bwd(dy.contiguous(), None if dh is None else dh.contiguous(),
                                                       h, weight, z, rstd, ctx.offset)
        x_dtype, r_dtype = ctx.dtypes
        d_res = dx.to(r_dtype) if r_dtype is not None else None
        dw = dw.to(weight.dtype) if weight is not None else None
        return dx.to(x_dtype), d_res, dw, dz if z is not None else None, None, None, None


def _rows(t: torch.Tensor | None, D: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, D).contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension: ``norm(x [+ residual]) * (weight + offset) [* silu(z)]``.

    weight (D,) or None (gainless); offset 1.0 for the zero-centred gain ``1 + w``. A scale-vector
    reparameterisation passes its effective gain (e.g. magnitude * direction, a (D,) tensor built by
    autograd from its parameters) with offset 0: the kernel sees one vector, and no per-token activation
    is kept for it. With ``residual`` returns ``(y, x + residual)``. out_dtype: y's dtype (default: that of
    x + residual); e.g. the autocast dtype when every consumer of y is a projection under autocast, which
    would round y to it anyway: the kernel writes it once, in half the bytes, and no cast reads it back.
    backend: model.kernels.norm.
    """
    if pick_for("norm", backend, x, weight, residual, z) == "reference":
        return rms_norm_reference(x, weight, eps, offset, residual, z, out_dtype)
    D = x.shape[-1]
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}; it must be ({D},), the last dim of x")
    for name, t in (("residual", residual), ("z", z)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"rms_norm: {name} has shape {tuple(t.shape)}, x has {tuple(x.shape)}; they must match")
    y, h = RMSNormFunction.apply(_rows(x, D), _rows(residual, D), weight, _rows(z, D), float(eps), float(offset),
                                 out_dtype)
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))
