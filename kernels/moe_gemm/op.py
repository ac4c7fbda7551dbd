"""The MoE expert kernels as torch custom ops with fake implementations, autograd.Functions, and the public
`gathered_linear` / `swiglu_packed` that pick the backend (see kernels/norm/op.py for why custom ops rather
than triton_op)."""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.moe_gemm.reference import gathered_linear_reference, swiglu_packed_reference
from hybridtron.kernels.moe_permute import op as _permute_op  # noqa: F401  (registers hybridtron::moe_combine: the dx combine)


@torch.library.custom_op("hybridtron::moe_swiglu_fwd", mutates_args=())
def _swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    from hybridtron.kernels.moe_gemm.triton_kernels import swiglu_packed_fwd

    return swiglu_packed_fwd(h)


@_swiglu_fwd.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("hybridtron::moe_swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    from hybridtron.kernels.moe_gemm.triton_kernels import swiglu_packed_bwd

    return swiglu_packed_bwd(dy, h)


@_swiglu_bwd.register_fake
def _(dy, h):
    return h.new_empty(h.shape)


@torch.library.custom_op("hybridtron::moe_grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, order: torch.Tensor | None, weight: torch.Tensor, offsets: torch.Tensor, top_k: int,
                transpose: bool) -> torch.Tensor:
    from hybridtron.kernels.moe_gemm.triton_kernels import grouped_mm

    return grouped_mm(a, order, weight, offsets, top_k, transpose)


@_grouped_mm.register_fake
def _(a, order, weight, offsets, top_k, transpose):
    return a.new_empty(order.shape[0] if order is not None else a.shape[0], weight.shape[1 if transpose else 2])


@torch.library.custom_op("hybridtron::moe_grouped_wgrad", mutates_args=())
def _grouped_wgrad(dh: torch.Tensor, x: torch.Tensor, order: torch.Tensor | None, offsets: torch.Tensor,
                   top_k: int) -> torch.Tensor:
    from hybridtron.kernels.moe_gemm.triton_kernels import grouped_wgrad

    return grouped_wgrad(dh, x, order, offsets, top_k)


@_grouped_wgrad.register_fake
def _(dh, x, order, offsets, top_k):
    return x.new_empty(offsets.shape[0], dh.shape[1], x.shape[1])


class SwiGLUPackedFunction(torch.autograd.Function):
    """h (M, 2 I) [gate | up] -> silu(gate) * up (M, I); backward: d h as one (M, 2 I) tensor."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return torch.ops.hybridtron.moe_swiglu_fwd(h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return torch.ops.hybridtron.moe_swiglu_bwd(dy.contiguous(), h)


class GatheredLinearFunction(torch.autograd.Function):
    """(x (N, d), order, pos (N k,) int64, weight (E, out, d), offsets (E,) int32, k) -> h (N k, out), row r =
    x[order[r] // k] @ weight[e].T. Backward: dx by the grouped GEMM dh @ weight[e] into expert-ordered rows,
    summed per token by the permutation's combine kernel; dweight[e] = dh[rows of e]^T x[order[rows] // k] by the
    same gathered loads. Saves x, not the k-times larger permuted rows."""

    @staticmethod
    def forward(ctx, x, order, pos, weight, offsets, top_k):
        ctx.save_for_backward(x, order, pos, weight, offsets)
        ctx.top_k = top_k
        return torch.ops.hybridtron.moe_grouped_mm(x, order, weight, offsets, top_k, True)

    @staticmethod
    def backward(ctx, dh):
        x, order, pos, weight, offsets = ctx.saved_tensors
        dh = dh.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dxs = torch.ops.hybridtron.moe_grouped_mm(dh, None, weight, offsets, 1, False)
            dx = torch.ops.hybridtron.moe_combine(dxs, pos, None, ctx.top_k)
        if ctx.needs_input_grad[3]:
            dw = torch.ops.hybridtron.moe_grouped_wgrad(dh, x, order, offsets, ctx.top_k)
        return dx, None, None, dw, None, None


def swiglu_packed(h: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """h (M, 2 I), the [gate | up] halves of a fused gate_up projection -> ``silu(gate) * up`` (M, I), in one pass
    over h and no copy of its halves; the gradient is one (M, 2 I) tensor. backend: model.kernels.swiglu (the
    dense SwiGLU's switch: the same formula, rounded once in the compute dtype as kernels/swiglu does)."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu_packed: h has shape {tuple(h.shape)}; it must be (rows, 2 * hidden): the gate "
                         f"half, then the up half")
    if pick_for("swiglu", backend, h) == "reference":
        return swiglu_packed_reference(h)
    if h.stride(-1) != 1:  # the kernel reads any row stride, but each row's elements consecutive
        h = h.contiguous()
    return SwiGLUPackedFunction.apply(h)


def gathered_linear(x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, top_k: int, weight: torch.Tensor,
                    offsets: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The grouped GEMM of the permuted token rows without the permuted copy: x (N, d), order / pos from
    ``sort_assignments`` of the N k flat expert choices, weight (E, out, d) in x's dtype, offsets (E,) the running
    per-expert counts (``offsets[-1] = N k``: dropless) on x's device -> (N k, out), row r =
    ``x[order[r] // k] @ weight[e].T`` for the expert e whose rows hold r. What ``moe_permute`` then a grouped
    GEMM compute, with the gather in the GEMM's operand loads. No host synchronisation on the Triton backend.
    backend: model.kernels.moe."""
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"gathered_linear: x {tuple(x.shape)} must be (N, d) and weight {tuple(weight.shape)} "
                         f"(E, out, d) with the same d")
    if order.dim() != 1 or order.shape != pos.shape or top_k < 1 or order.numel() != x.shape[0] * top_k:
        raise ValueError(f"gathered_linear: order {tuple(order.shape)} and pos {tuple(pos.shape)} must both hold the "
                         f"N * top_k = {x.shape[0]} * {top_k} assignments (use both from one sort_assignments call)")
    if offsets.shape != (weight.shape[0],) or offsets.is_floating_point():
        raise ValueError(f"gathered_linear: offsets is {offsets.dtype} {tuple(offsets.shape)}; it must hold the "
                         f"running row count of each of the {weight.shape[0]} experts (counts.cumsum(0))")
    if x.dtype != weight.dtype:
        raise ValueError(f"gathered_linear: x is {x.dtype}, weight {weight.dtype}; cast the weight to the rows' "
                         f"dtype (MoE.run_experts does, once per forward)")
    if pick_for("moe", backend, x, weight) == "reference":
        return gathered_linear_reference(x, order, top_k, weight, offsets)
    return GatheredLinearFunction.apply(x.contiguous(), order.to(torch.int64).contiguous(),
                                        pos.to(torch.int64).contiguous(), weight.contiguous(),
                                        offsets.to(torch.int32).contiguous(), int(top_k))
