"""Single-device model modules: the gated-attention LM and its parts."""

from hybridtron.kernels import backend, tune
from hybridtron.model.attention import GatedAttention, doc_causal_mask
from hybridtron.model.flops import flops_per_token
from hybridtron.model.gated_deltanet import GatedDeltaNet
from hybridtron.model.lm import Block, DecodeCache, GatedLM
from hybridtron.model.mlp import SwiGLU
from hybridtron.model.norm import RMSNorm, build_norm
from hybridtron.model.rotary import RotaryEmbedding, apply_rotary
from hybridtron.model.scale import ScaledLinear, fold_scale_vectors

__all__ = [
    "Block", "DecodeCache", "GatedAttention", "GatedDeltaNet", "GatedLM", "RMSNorm", "RotaryEmbedding", "ScaledLinear", "SwiGLU", "apply_rotary", "build_norm",
    "doc_causal_mask", "flops_per_token", "fold_scale_vectors",
]

# auto of the ops with peer libraries is decided on CUDA by kernels/tune.py's measurement, for every model's ops: the
# one place it is registered with the backend switch (which cannot import it back: tune builds on the switch)
backend.use_tuner(tune)
