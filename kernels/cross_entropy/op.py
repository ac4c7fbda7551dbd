"""Fused linear + cross-entropy: a torch custom op (with a fake implementation) over the chunked loop, an
autograd.Function, the public `linear_cross_entropy`, and the vocabulary-parallel variant.

The custom op returns the loss and, when gradients are wanted, dh and dW computed in the same pass; the
backward multiplies them by the incoming gradient (a scalar). See kernels/norm/op.py for why custom ops.
"""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.cross_entropy.chunked import AllReduce, chunked_linear_cross_entropy
from hybridtron.kernels.cross_entropy.reference import linear_cross_entropy_reference


@torch.library.custom_op("hybridtron::linear_cross_entropy", mutates_args=())
def _fused(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, z_loss: float, chunk_size: int,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return chunked_linear_cross_entropy(h, weight, labels, ignore_index=ignore_index, z_loss=z_loss,
                                        chunk_size=chunk_size, compute_grad=compute_grad, impl="triton")


@_fused.register_fake
def _(h, weight, labels, ignore_index, z_loss, chunk_size, compute_grad):
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    loss = h.new_empty((), dtype=acc)
    if not compute_grad:
        return loss, h.new_empty(0), h.new_empty(0)
    return loss, torch.empty_like(h), torch.empty_like(weight)


def _scaled(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's dh, dW times the incoming (scalar) gradient, in place: a backward runs once, and a copy
    of dW (vocabulary x d) is what the fused op exists to avoid. The usual gradient, 1, costs nothing more."""
    dh, dw = ctx.saved_tensors
    return dh.mul_(grad.to(dh.dtype)), dw.mul_(grad.to(dw.dtype))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index, z_loss, chunk_size, compute_grad):
        loss, dh, dw = torch.ops.hybridtron.linear_cross_entropy(h, weight, labels, ignore_index, z_loss, chunk_size,
                                                                 compute_grad)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dh, dw = _scaled(ctx, grad)
        return dh, dw, None, None, None, None, None


def _autocast(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The matmul's operands as autocast would give them to F.linear (a custom op is not autocast)."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return h.to(dtype), weight.to(dtype)
    if h.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: h is {h.dtype} and weight {weight.dtype}; cast one of them, or run "
                         f"under autocast")
    return h, weight


def _wants_grad(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Gradients are computed in the forward pass, so it must know whether anyone will ask for them
    (inside autograd.Function.forward grad mode is always off)."""
    return torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)


def _check(h, weight, labels):
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: h {tuple(h.shape)} must be (N, d) and weight {tuple(weight.shape)} "
                         f"(V, d) with the same d")
    if labels.shape != (h.shape[0],):
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} must be (N,) = ({h.shape[0]},)")


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` against ``labels`` (rows with ``ignore_index``
    left out), plus ``z_loss * lse^2`` (PaLM's z-loss) averaged the same way. h (N, d), weight (V, d),
    labels (N,) int64. On the triton backend the logits are made and consumed in chunks of ``chunk_size``
    rows (0: about d/V of the rows), never whole. backend: model.kernels.cross_entropy."""
    _check(h, weight, labels)
    if pick_for("cross_entropy", backend, h, weight) == "reference":
        return linear_cross_entropy_reference(h, weight, labels, ignore_index=ignore_index, z_loss=z_loss)
    h, weight = _autocast(h, weight)
    return LinearCrossEntropyFunction.apply(h.contiguous(), weight.contiguous(), labels.contiguous(),
                                            int(ignore_index), float(z_loss), int(chunk_size), _wants_grad(h, weight))


class _VocabParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, vocab_start, all_reduce, ignore_index, z_loss, chunk_size, impl, compute_grad):
        loss, dh, dw = chunked_linear_cross_entropy(
            h, weight, labels, ignore_index=ignore_index, z_loss=z_loss, chunk_size=chunk_size,
            compute_grad=compute_grad, impl=impl, vocab_start=vocab_start, all_reduce=all_reduce)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dh, dw = _scaled(ctx, grad)
        return dh, dw, None, None, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(
    h: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    all_reduce: AllReduce,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """The same loss with the vocabulary split over tensor-parallel ranks: ``weight_shard`` holds rows
    [vocab_start, vocab_start + V_local) of the head, ``h`` and ``labels`` are the same on every rank, and
    ``all_reduce(t, op)`` ("max" or "sum") combines a tensor over those ranks and returns it. Every rank gets
    the full loss; backward gives every rank the full dh and its own shard's dW. Neither the full logits nor
    a full-vocabulary chunk exists anywhere. The triton backend runs the chunk steps as Triton kernels, the
    reference backend as torch (both chunked: the loss needs the ranks' statistics combined). Not traced by
    torch.compile (the collectives are the caller's)."""
    _check(h, weight_shard, labels)
    impl = "torch" if pick_for("cross_entropy", backend, h, weight_shard) == "reference" else "triton"
    h, weight_shard = _autocast(h, weight_shard)
    return _VocabParallelFunction.apply(h.contiguous(), weight_shard.contiguous(), labels.contiguous(),
                                        int(vocab_start), all_reduce, int(ignore_index), float(z_loss),
                                        int(chunk_size), impl, _wants_grad(h, weight_shard))
