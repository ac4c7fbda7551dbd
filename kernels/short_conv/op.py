"""Short causal depthwise convolution + SiLU as torch custom ops with fake implementations, an
autograd.Function, and the public `short_conv` that picks the backend (see kernels/norm/op.py for why
custom ops rather than triton_op)."""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for, starts_from_cu_seqlens
from hybridtron.kernels.limits import MAX_K
from hybridtron.kernels.shape_classes import conv_shape
from hybridtron.kernels.short_conv.checks import check_shapes as _check
from hybridtron.kernels.short_conv.reference import short_conv_reference


@torch.library.custom_op("hybridtron::short_conv_fwd", mutates_args=())
def _fwd(x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None, past: torch.Tensor | None) -> torch.Tensor:
    from hybridtron.kernels.short_conv.triton_kernels import short_conv_fwd

    return short_conv_fwd(x, w, doc_ids, past)


@_fwd.register_fake
def _(x, w, doc_ids, past):
    return torch.empty_like(x)


@torch.library.custom_op("hybridtron::short_conv_bwd", mutates_args=())
def _bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None,
         past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.short_conv.triton_kernels import short_conv_bwd

    return short_conv_bwd(dy, x, w, doc_ids, past)


@_bwd.register_fake
def _(dy, x, w, doc_ids, past):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(past) if past is not None else x.new_empty(0)


class ShortConvFunction(torch.autograd.Function):
    """(x (B, T, C), w (C, K), doc_ids (B, T) int64 or None, past (B, K-1, C) or None) -> silu(conv), all
    contiguous. Saves the inputs only: the backward recomputes the pre-activation."""

    @staticmethod
    def forward(ctx, x, w, doc_ids, past):
        ctx.save_for_backward(x, w, doc_ids, past)
        return torch.ops.hybridtron.short_conv_fwd(x, w, doc_ids, past)

    @staticmethod
    def backward(ctx, dy):
        x, w, doc_ids, past = ctx.saved_tensors
        dx, dw, dpast = torch.ops.hybridtron.short_conv_bwd(dy.contiguous(), x, w, doc_ids, past)
        return dx, dw, None, dpast if past is not None else None


def short_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None,
               past: torch.Tensor | None = None, *, backend: str = "auto",
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal_conv(x, weight, doc_ids, past))`` (kernels/short_conv/reference.py): the depthwise causal
    convolution over earlier inputs of the same document, then SiLU. x (B, T, C); weight (C, 1, K);
    doc_ids (B, T) or None; past (B, K-1, C) or None. The kernel's output is in x's dtype (a bf16 activation
    with an fp32 filter under autocast gives bf16, as conv1d does). backend: model.kernels.conv (auto: on CUDA the
    fastest correct of triton, causal-conv1d and fla at the call's shape class, kernels/tune.py; a call with
    ``past`` -- decoding -- runs our kernel whichever was chosen).
    cu_seqlens: packed sequences in one row (B = 1) as cumulative lengths, instead of doc_ids (past continues
    the first)."""
    if cu_seqlens is not None:
        if doc_ids is not None or x.shape[0] != 1:
            raise ValueError(f"short_conv: cu_seqlens describes one packed row (B = 1) in place of doc_ids; got "
                             f"B={x.shape[0]}{' and doc_ids' if doc_ids is not None else ''}")
        doc_ids = starts_from_cu_seqlens(cu_seqlens, x.shape[1], "short_conv").long().cumsum(1)
    K = _check(x, weight, doc_ids, past)
    # A class is measured without a decoding window (past) only: decoding steps run our kernel whatever auto chose.
    shape = conv_shape(x, weight, doc_ids is not None) if past is None else None
    chosen = pick_for("conv", backend, x, weight, past, shape=shape)
    if chosen in ("causal-conv1d", "fla") and past is None:
        from hybridtron.kernels.short_conv.peers import peer_short_conv

        return peer_short_conv(x, weight, doc_ids, backend=chosen)  # (a peer auto measured may take a wide filter)
    if chosen != "reference":  # our kernel (decoding steps too, whichever peer auto chose)
        if K > MAX_K and chosen == "triton" and backend == "auto":
            chosen = "reference"
        elif K > MAX_K:
            raise ValueError(f"short_conv: the Triton kernel takes filter widths 1-{MAX_K}, not {K} (its window is "
                             f"registers); choose model.kernels.conv=reference or auto for wider filters")
    if chosen == "reference":
        return short_conv_reference(x, weight, doc_ids, past)
    w = weight.reshape(weight.shape[0], K).contiguous()
    ids = None if doc_ids is None else doc_ids.to(torch.int64).contiguous()
    return ShortConvFunction.apply(x.contiguous(), w, ids, None if past is None else past.contiguous())
