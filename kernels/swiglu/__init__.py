"""Fused SwiGLU activation: Triton kernels beside the pure-torch reference."""

from .op import SwiGLUFunction, swiglu
from .reference import swiglu_reference

__all__ = ["SwiGLUFunction", "swiglu", "swiglu_reference"]
