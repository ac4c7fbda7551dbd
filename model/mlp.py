"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), names as in Llama/Qwen."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from .linear import make_linear


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, cfg: ModelConfig | None = None):
        super().__init__()
        cfg = cfg or ModelConfig()
        self.gate_proj = make_linear(cfg, d_model, hidden, after_norm=True)
        self.up_proj = make_linear(cfg, d_model, hidden, after_norm=True)
        self.down_proj = make_linear(cfg, hidden, d_model, residual_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
