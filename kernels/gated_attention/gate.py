"""The sigmoid output gate ``attn * sigmoid(gate)`` as one fused Triton pass each way, for the attention
backends whose kernels cannot take the gate (torch SDPA, flex attention; ``sdpa.py``, ``flex.py``).

Torch custom ops (forward, backward) with fake implementations and an autograd.Function, as in
``kernels/norm/op.py``: opaque to torch.compile, which traces the fake implementations for shapes. Where our
Triton kernels cannot run (no triton; a CPU tensor without TRITON_INTERPRET=1) and for tensor-parallel
DTensors, `sigmoid_gate` is `reference.apply_gate`, the same formula in eager torch.
"""

from __future__ import annotations

import math

import torch

from hybridtron.kernels import backend
from hybridtron.kernels.backend import _constant_under_compile, is_distributed
from hybridtron.kernels.gated_attention.reference import apply_gate

GATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.library.custom_op("hybridtron::sigmoid_gate_fwd", mutates_args=())
def _fwd(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    from hybridtron.kernels.gated_attention.gate_kernels import gate_fwd

    return gate_fwd(attn, gate)


@_fwd.register_fake
def _(attn, gate):
    return torch.empty_like(attn)


@torch.library.custom_op("hybridtron::sigmoid_gate_bwd", mutates_args=())
def _bwd(dout: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_attention.gate_kernels import gate_bwd

    return gate_bwd(dout, attn, gate)


@_bwd.register_fake
def _(dout, attn, gate):
    return torch.empty_like(attn), torch.empty_like(gate)


class SigmoidGateFunction(torch.autograd.Function):
    """(attn (M, D), gate (M, D) | (M,), contiguous) -> attn * sigmoid(gate) (M, D). Saves attn and gate (the
    attention backend keeps attn for its own backward: no new activation); sigmoid(gate) is recomputed."""

    @staticmethod
    def forward(ctx, attn, gate):
        ctx.save_for_backward(attn, gate)
        return torch.ops.hybridtron.sigmoid_gate_fwd(attn, gate)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        attn, gate = ctx.saved_tensors
        return torch.ops.hybridtron.sigmoid_gate_bwd(dout.contiguous(), attn, gate)


@_constant_under_compile
def _triton_runs(device_type: str) -> bool:
    """Our Triton kernels can run on this device type: a constant to torch.compile (no guard, no graph break).
    Asked each eager call (a few microseconds: an environment read) rather than cached, so that what changes the
    answer -- tests setting TRITON_INTERPRET, bench/compile_report.py standing in for a GPU -- is seen; and
    through the module, where compile_report patches it."""
    return backend.triton_unavailable_reason(device_type) is None


def sigmoid_gate(attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``attn * sigmoid(gate)``: attn (..., H, D); gate (..., H, D) elementwise or (..., H) headwise (one per
    head, broadcast over D); None returns attn. Computed in fp32 (fp64 for fp64 inputs); the output in attn's
    dtype, attn's gradient in attn's dtype and gate's in gate's. One fused Triton pass forward and one backward
    where `triton_unavailable_reason(attn.device)` is None, else (and for DTensors) `reference.apply_gate`."""
    if gate is None:
        return attn
    if gate.shape not in (attn.shape, attn.shape[:-1]):
        raise ValueError(
            f"sigmoid_gate: gate has shape {tuple(gate.shape)}; it must be attn's shape {tuple(attn.shape)} "
            f"(elementwise) or {tuple(attn.shape[:-1])} (headwise, one per head)"
        )
    if gate.device != attn.device:
        raise ValueError(f"sigmoid_gate: gate is on {gate.device}, attn on {attn.device}; move them to one device")
    for name, t in (("attn", attn), ("gate", gate)):
        if t.dtype not in GATE_DTYPES:
            raise ValueError(f"sigmoid_gate: {name} is {t.dtype}; use float16, bfloat16, float32 or float64")
    if is_distributed(attn) or is_distributed(gate) or not _triton_runs(attn.device.type):
        return apply_gate(attn, gate)
    D = attn.shape[-1]
    # (M, D) rows: a view when attn's leading dims collapse, else one copy. torch's flash, memory-efficient and
    # cuDNN SDPA write their output in q's memory layout (per torch's source; not measured here), so for our
    # transposed (B, T, H, D) q the view back collapses; the CPU's SDPA and flex write (B, H, T, D): a copy.
    M = math.prod(attn.shape[:-1])
    rows = attn.reshape(M, D).contiguous()
    g = gate.reshape(M, D) if gate.shape == attn.shape else gate.reshape(M)
    return SigmoidGateFunction.apply(rows, g.contiguous()).view(attn.shape)
