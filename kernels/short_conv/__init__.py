"""Short causal depthwise convolution + SiLU (the Gated DeltaNet q/k/v convolution): Triton kernels beside
the pure-torch reference."""

from .op import ShortConvFunction, short_conv
from .reference import causal_conv, short_conv_reference

__all__ = ["ShortConvFunction", "causal_conv", "short_conv", "short_conv_reference"]
