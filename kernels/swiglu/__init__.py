"""Fused SwiGLU activation: Triton kernels beside the pure-torch reference."""

from hybridtron.kernels.swiglu.op import SwiGLUFunction, swiglu
from hybridtron.kernels.swiglu.reference import swiglu_reference

__all__ = ["SwiGLUFunction", "swiglu", "swiglu_reference"]
