"""Gated flash attention over packed documents (causal, grouped-query, sigmoid output gate): Triton kernels
beside the pure-torch reference."""

from hybridtron.kernels.gated_attention.op import GatedAttentionFunction, cu_seqlens_from_bounds, gated_attention
from hybridtron.kernels.gated_attention.reference import doc_bounds, gated_attention_reference

__all__ = ["GatedAttentionFunction", "cu_seqlens_from_bounds", "doc_bounds", "gated_attention",
           "gated_attention_reference"]
