"""Short causal depthwise convolution + SiLU (the Gated DeltaNet q/k/v convolution): Triton kernels beside
the pure-torch reference."""

from hybridtron.kernels.short_conv.op import ShortConvFunction, short_conv
from hybridtron.kernels.short_conv.reference import causal_conv, short_conv_reference

__all__ = ["ShortConvFunction", "causal_conv", "short_conv", "short_conv_reference"]
