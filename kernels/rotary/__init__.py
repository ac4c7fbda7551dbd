"""Fused rotary embedding of q and k (+ QK-norm): Triton kernel beside the pure-torch reference."""

from hybridtron.kernels.rotary.op import RotaryQKFunction, rotary_qk
from hybridtron.kernels.rotary.reference import rotary_qk_reference, rotate_reference

__all__ = ["RotaryQKFunction", "rotary_qk", "rotary_qk_reference", "rotate_reference"]
