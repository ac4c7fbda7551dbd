"""Fused rotary embedding of q and k (+ QK-norm): Triton kernel beside the pure-torch reference."""

from .op import RotaryQKFunction, rotary_qk
from .reference import rotary_qk_reference, rotate_reference

__all__ = ["RotaryQKFunction", "rotary_qk", "rotary_qk_reference", "rotate_reference"]
