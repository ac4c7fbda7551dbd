"""The feed-forward of layer i, chosen by config: SwiGLU, a mixture of experts, or a structured SwiGLU."""

from __future__ import annotations

from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.model.mlp import SwiGLU


def build_ffn(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    if cfg.moe.is_moe_layer(layer_idx):
        from hybridtron.model.moe import MoE

        return MoE(cfg)
    if cfg.ffn.kind != "dense" and not (layer_idx == 0 and cfg.ffn.dense_first_layer):
        from hybridtron.model.structured_ffn import StructuredSwiGLU

        return StructuredSwiGLU(cfg)
    return SwiGLU(cfg.d_model, cfg.resolved_ffn_hidden(), cfg)
