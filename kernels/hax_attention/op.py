"""Gathered sparse attention as torch custom ops with fake implementations, an autograd.Function, and the
public `hax_attention` that picks the backend (see kernels/norm/op.py for why custom ops rather than
triton_op)."""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.hax_attention.reference import hax_attention_reference


@torch.library.custom_op("hybridtron::hax_attention_fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    from hybridtron.kernels.hax_attention.triton_kernels import hax_attention_fwd

    return hax_attention_fwd(q, k, v, idx, scale)


@_fwd.register_fake
def _(q, k, v, idx, scale):
    return q.new_empty(*idx.shape[:2], v.shape[-1])


@torch.library.custom_op("hybridtron::hax_attention_bwd", mutates_args=())
def _bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.hax_attention.triton_kernels import hax_attention_bwd

    return hax_attention_bwd(do, q, k, v, idx, scale)


@_bwd.register_fake
def _(do, q, k, v, idx, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class HaxAttentionFunction(torch.autograd.Function):
    """(q (B, T, D), k (B, L, D), v (B, L, E), idx (B, T, S) int32, scale) -> (B, T, E), all contiguous. Saves
    the inputs only: the backward recomputes the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, idx, scale):
        ctx.save_for_backward(q, k, v, idx)
        ctx.scale = scale
        return torch.ops.hybridtron.hax_attention_fwd(q, k, v, idx, scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v, idx = ctx.saved_tensors
        dq, dk, dv = torch.ops.hybridtron.hax_attention_bwd(do.contiguous(), q, k, v, idx, ctx.scale)
        return dq, dk, dv, None, None


def _check(q, k, v, idx) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or idx.dim() != 3:
        raise ValueError(f"hax_attention: q, k, v and idx must be 3-D (B, T, D), (B, L, D), (B, L, E), (B, T, S); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(idx.shape)}")
    B, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != D or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"hax_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be ({B}, L, {D}) and "
                         f"({B}, L, E) for q {tuple(q.shape)}")
    if idx.shape[:2] != (B, T) or idx.is_floating_point():
        raise ValueError(f"hax_attention: idx is {idx.dtype} {tuple(idx.shape)}; it must be integer key positions "
                         f"of shape ({B}, {T}, S), -1 for an empty slot")


def hax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, scale: float | None = None,
                  *, backend: str = "auto") -> torch.Tensor:
    """Each query attends to its own list of key positions (kernels/hax_attention/reference.py). q (B, T, D);
    k (B, L, D); v (B, L, E); idx (B, T, S) integer in [-1, L), -1 = empty slot, no position twice in a row's
    list; scale: the logit scale, D^-1/2 when None. -> (B, T, E) in q's dtype. backend: model.kernels.hax."""
    _check(q, k, v, idx)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if pick_for("hax", backend, q, k, v) == "reference":
        return hax_attention_reference(q, k, v, idx, scale)
    return HaxAttentionFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                      idx.to(torch.int32).contiguous(), scale)
