"""Fused RMSNorm (+ residual add, zero-centred gain, silu gate): Triton kernels beside the pure-torch reference."""

from hybridtron.kernels.norm.op import RMSNormFunction, rms_norm
from hybridtron.kernels.norm.reference import rms_norm_reference

__all__ = ["RMSNormFunction", "rms_norm", "rms_norm_reference"]
