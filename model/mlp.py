"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), names as in Llama/Qwen. The activation goes through the
backend switch (``model.kernels.swiglu``: the fused Triton kernel in kernels/swiglu or the torch reference)."""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.kernels.swiglu import swiglu
from hybridtron.model.linear import make_linear


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, cfg: ModelConfig | None = None):
        super().__init__()
        cfg = cfg or ModelConfig()
        self.gate_proj = make_linear(cfg, d_model, hidden, after_norm=True)
        self.up_proj = make_linear(cfg, d_model, hidden, after_norm=True)
        self.down_proj = make_linear(cfg, hidden, d_model, residual_out=True)
        self.kernel_backend = cfg.kernels.swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend=self.kernel_backend))
