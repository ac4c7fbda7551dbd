"""MoE expert kernels: a grouped GEMM that gathers its token rows through the expert order (the permutation
fused into the gate_up projection's operand loads) with its backward, and the SwiGLU activation on the packed
[gate | up] projection; Triton kernels beside the pure-torch reference."""

from hybridtron.kernels.moe_gemm.op import GatheredLinearFunction, SwiGLUPackedFunction, gathered_linear, swiglu_packed
from hybridtron.kernels.moe_gemm.reference import gathered_linear_reference, swiglu_packed_reference

__all__ = ["GatheredLinearFunction", "SwiGLUPackedFunction", "gathered_linear", "gathered_linear_reference",
           "swiglu_packed", "swiglu_packed_reference"]
