"""MoE token permute / unpermute as torch custom ops with fake implementations, autograd.Functions, and the
public `moe_permute` / `moe_unpermute` that pick the backend (see kernels/norm/op.py for why custom ops
rather than triton_op)."""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.moe_permute.reference import permute_reference, unpermute_reference


@torch.library.custom_op("hybridtron::moe_gather", mutates_args=())
def _gather(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    from hybridtron.kernels.moe_permute.triton_kernels import gather

    return gather(x, order, top_k)


@_gather.register_fake
def _(x, order, top_k):
    return x.new_empty(order.shape[0], x.shape[1])


@torch.library.custom_op("hybridtron::moe_combine", mutates_args=())
def _combine(ys: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, top_k: int) -> torch.Tensor:
    from hybridtron.kernels.moe_permute.triton_kernels import combine

    return combine(ys, pos, w, top_k)


@_combine.register_fake
def _(ys, pos, w, top_k):
    return ys.new_empty(pos.shape[0] // top_k, ys.shape[1])


@torch.library.custom_op("hybridtron::moe_combine_bwd", mutates_args=())
def _combine_bwd(dy: torch.Tensor, ys: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.moe_permute.triton_kernels import combine_bwd

    return combine_bwd(dy, ys, pos, w, top_k)


@_combine_bwd.register_fake
def _(dy, ys, pos, w, top_k):
    return torch.empty_like(ys), torch.empty_like(w)


class PermuteFunction(torch.autograd.Function):
    """(x (N, d), order, pos (N k,) int64, k) -> xs (N k, d); backward: dx[n] = sum of token n's k rows."""

    @staticmethod
    def forward(ctx, x, order, pos, top_k):
        ctx.save_for_backward(pos)
        ctx.top_k = top_k
        return torch.ops.hybridtron.moe_gather(x, order, top_k)

    @staticmethod
    def backward(ctx, dxs):
        (pos,) = ctx.saved_tensors
        return torch.ops.hybridtron.moe_combine(dxs.contiguous(), pos, None, ctx.top_k), None, None, None


class UnpermuteFunction(torch.autograd.Function):
    """(ys (N k, d) in expert order, pos (N k,) int64, w (N k,), k) -> y (N, d) = weighted sum per token."""

    @staticmethod
    def forward(ctx, ys, pos, w, top_k):
        ctx.save_for_backward(ys, pos, w)
        ctx.top_k = top_k
        return torch.ops.hybridtron.moe_combine(ys, pos, w, top_k)

    @staticmethod
    def backward(ctx, dy):
        ys, pos, w = ctx.saved_tensors
        dys, dw = torch.ops.hybridtron.moe_combine_bwd(dy.contiguous(), ys, pos, w, ctx.top_k)
        return dys, None, dw, None


def _check_plan(name: str, order: torch.Tensor, pos: torch.Tensor, top_k: int, n_rows: int, what: str) -> None:
    if top_k < 1:
        raise ValueError(f"{name}: top_k={top_k}; it must be >= 1")
    for t, tname in ((order, "order"), (pos, "pos")):
        if t.dim() != 1 or t.is_floating_point() or t.numel() % top_k:
            raise ValueError(f"{name}: {tname} is {t.dtype} {tuple(t.shape)}; it must be a 1-d integer tensor of "
                             f"N * top_k assignments (top_k={top_k}), as sort_assignments returns")
    if order.shape != pos.shape:
        raise ValueError(f"{name}: order {tuple(order.shape)} and pos {tuple(pos.shape)} must have the same length "
                         f"(pos is order's inverse: use both from one sort_assignments call)")
    if n_rows != order.numel() // top_k * (1 if what == "tokens" else top_k):
        raise ValueError(f"{name}: {n_rows} rows of {what}, but {order.numel()} assignments at top_k={top_k} need "
                         f"{order.numel() // top_k * (1 if what == 'tokens' else top_k)}")


def moe_permute(x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, top_k: int, *,
                backend: str = "auto") -> torch.Tensor:
    """x (N, d) -> (N k, d): the token row of every assignment in expert order, ``x[order // k]``.
    order, pos: `sort_assignments` of the flat top-k experts. backend: model.kernels.moe."""
    if x.dim() != 2:
        raise ValueError(f"moe_permute: x has shape {tuple(x.shape)}; it must be (N tokens, d)")
    _check_plan("moe_permute", order, pos, top_k, x.shape[0], "tokens")
    if pick_for("moe", backend, x) == "reference":
        return permute_reference(x, order, top_k)
    return PermuteFunction.apply(x.contiguous(), order.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous(),
                                 int(top_k))


def moe_unpermute(ys: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, top_k: int, *,
                  backend: str = "auto") -> torch.Tensor:
    """ys (N k, d) in expert order, weights (N, k) or (N k,) -> (N, d): ``sum_j ys[pos[n k + j]] * w[n, j]``, in
    ys's dtype. backend: model.kernels.moe."""
    if ys.dim() != 2:
        raise ValueError(f"moe_unpermute: ys has shape {tuple(ys.shape)}; it must be (N * top_k, d)")
    _check_plan("moe_unpermute", order, pos, top_k, ys.shape[0], "expert outputs")
    if weights.numel() != order.numel() or not weights.is_floating_point():
        raise ValueError(f"moe_unpermute: weights is {weights.dtype} {tuple(weights.shape)}; it must hold one float "
                         f"per assignment ({order.numel()}: (N, top_k) or flat)")
    if pick_for("moe", backend, ys) == "reference":
        return unpermute_reference(ys, order, weights, top_k)
    return UnpermuteFunction.apply(ys.contiguous(), pos.to(torch.int64).contiguous(),
                                   weights.reshape(-1).contiguous(), int(top_k))
