"""Gathered sparse attention (the HAX branch of the Gated DeltaNet mixer, model/hax.py): each query attends to
its own short list of key positions. Triton kernels beside the pure-torch reference."""

from hybridtron.kernels.hax_attention.op import HaxAttentionFunction, hax_attention
from hybridtron.kernels.hax_attention.reference import hax_attention_reference

__all__ = ["HaxAttentionFunction", "hax_attention", "hax_attention_reference"]
