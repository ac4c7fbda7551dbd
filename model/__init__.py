"""Single-device model modules: the gated-attention LM and its parts."""

from ..kernels import backend, tune
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

# auto of the ops with peer libraries is decided on CUDA by kernels/tune.py's measurement, for every model's ops: the
# one place it is registered with the backend switch (which cannot import it back: tune builds on the switch)
backend.use_tuner(tune)
