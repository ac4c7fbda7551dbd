"""Rotary embedding of q and k (+ fused QK-norm) as torch custom ops with fake implementations, an
autograd.Function, and the public `rotary_qk` that picks the backend (see kernels/norm/op.py for why
custom ops rather than triton_op)."""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.rotary.reference import rotary_qk_reference


@torch.library.custom_op("hybridtron::rotary_qk_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, norm: bool, eps: float, offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.rotary.triton_kernels import rotary_fwd

    return rotary_fwd(q, k, cos, sin, q_weight, k_weight, norm, eps, offset)


@_fwd.register_fake
def _(q, k, cos, sin, q_weight, k_weight, norm, eps, offset):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("hybridtron::rotary_qk_bwd", mutates_args=())
def _bwd(
    dqo: torch.Tensor, dko: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, norm: bool, eps: float, offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.rotary.triton_kernels import rotary_bwd

    return rotary_bwd(dqo, dko, q, k, cos, sin, q_weight, k_weight, norm, eps, offset)


@_bwd.register_fake
def _(dqo, dko, q, k, cos, sin, q_weight, k_weight, norm, eps, offset):
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
    shape = q.shape[-1:] if q_weight is not None else (0,)
    return q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty(shape, dtype=acc), q.new_empty(shape, dtype=acc)


class RotaryQKFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, q_weight, k_weight, norm, eps, offset):
        qo, ko = torch.ops.hybridtron.rotary_qk_fwd(q, k, cos, sin, q_weight, k_weight, norm, eps, offset)
        # Without the norm the backward needs only the tables; q and k are kept for the norm's statistics.
        ctx.save_for_backward(q if norm else None, k if norm else None, cos, sin, q_weight, k_weight)
        ctx.meta = (norm, eps, offset, q.shape, k.shape, q.dtype, k.dtype)
        return qo, ko

    @staticmethod
    def backward(ctx, dqo, dko):
        q, k, cos, sin, q_weight, k_weight = ctx.saved_tensors
        norm, eps, offset, q_shape, k_shape, q_dtype, k_dtype = ctx.meta
        if q is None:  # no norm: only shapes matter (strides are read from these)
            q, k = dqo.new_empty(q_shape, dtype=q_dtype), dko.new_empty(k_shape, dtype=k_dtype)
        dq, dk, dqw, dkw = torch.ops.hybridtron.rotary_qk_bwd(
            dqo.contiguous(), dko.contiguous(), q, k, cos, sin, q_weight, k_weight, norm, eps, offset)
        dqw = dqw.to(q_weight.dtype) if q_weight is not None else None
        dkw = dkw.to(k_weight.dtype) if k_weight is not None else None
        return dq, dk, None, None, dqw, dkw, None, None, None


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norm: bool = False,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, T, H, D) and k (B, T, KV, D) by the tables cos, sin (T, rot/2); channels past rot pass
    through. With ``norm`` each head is first RMS-normalised over D with gain ``weight + offset`` (weights
    (D,) or None: gainless), the QK-norm, in the same kernel. backend: model.kernels.rotary."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rotary_qk: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, T, heads, D) with the "
                         f"same B, T and D")
    T, D = q.shape[1], q.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != T or 2 * cos.shape[1] > D:
        raise ValueError(f"rotary_qk: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be (T={T}, rot/2) with "
                         f"rot <= D={D}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_qk: give both q_weight and k_weight, or neither (a gainless QK-norm)")
    if pick_for("rotary", backend, q, k, q_weight, k_weight) == "reference":
        return rotary_qk_reference(q, k, cos, sin, norm=norm, q_weight=q_weight, k_weight=k_weight, eps=eps,
                                   offset=offset)
    return RotaryQKFunction.apply(_unit_stride(q), _unit_stride(k), _unit_stride(cos), _unit_stride(sin),
                                  q_weight, k_weight, bool(norm), float(eps), float(offset))
