"""Single-device model modules: the gated-attention LM and its parts."""

from ..kernels import tune  # noqa: F401  (registers auto's measurement on CUDA with the backend switch: kernels/__init__)
from .attention import GatedAttention, doc_causal_mask
from .flops import flops_per_token
from .gated_deltanet import GatedDeltaNet
from .lm import Block, DecodeCache, GatedLM
from .mlp import SwiGLU
from .norm import RMSNorm, build_norm
from .rotary import RotaryEmbedding, apply_rotary
from .scale import ScaledLinear, fold_scale_vectors

__all__ = [
    "Block", "DecodeCache", "GatedAttention", "GatedDeltaNet", "GatedLM", "RMSNorm", "RotaryEmbedding", "ScaledLinear", "SwiGLU", "apply_rotary", "build_norm",
    "doc_causal_mask", "flops_per_token", "fold_scale_vectors",
]
