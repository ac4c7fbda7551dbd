"""SwiGLU activation as torch custom ops with fake implementations, an autograd.Function, and the public
`swiglu` that picks the backend (see kernels/norm/op.py for why custom ops rather than triton_op)."""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.swiglu.reference import swiglu_reference


@torch.library.custom_op("hybridtron::swiglu_fwd", mutates_args=())
def _fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from hybridtron.kernels.swiglu.triton_kernels import swiglu_fwd

    return swiglu_fwd(gate, up)


@_fwd.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("hybridtron::swiglu_bwd", mutates_args=())
def _bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.swiglu.triton_kernels import swiglu_bwd

    return swiglu_bwd(dy, gate, up)


@_bwd.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.ops.hybridtron.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return torch.ops.hybridtron.swiglu_bwd(dy.contiguous(), gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up``, elementwise; backend: model.kernels.swiglu."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if pick_for("swiglu", backend, gate, up) == "reference":
        return swiglu_reference(gate, up)
    return SwiGLUFunction.apply(gate.contiguous(), up.contiguous())
