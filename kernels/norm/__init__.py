"""Fused RMSNorm (+ residual add, zero-centred gain, silu gate): Triton kernels beside the pure-torch reference."""

from .op import RMSNormFunction, rms_norm
from .reference import rms_norm_reference

__all__ = ["RMSNormFunction", "rms_norm", "rms_norm_reference"]
