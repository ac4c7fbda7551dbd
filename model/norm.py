"""RMSNorm in the two parameterisations the configs offer.

``plain``:          y = x / rms(x) * w          (w init 1; Llama, Qwen3)
``zero_centered``:  y = x / rms(x) * (1 + w)    (w init 0; Qwen3-Next, Qwen3.5)

The zero-centred form has the same function at init but lets weight decay pull the gain towards 1
instead of towards 0. Both compute in fp32 and multiply by the gain before casting back, as Qwen3.5
does, so a bf16 input loses precision only once.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Either form is the identity gain at init.
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least; fp64 stays fp64 (tests)
        xf = x.to(dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = self.weight.to(dtype)
        if self.zero_centered:
            gain = 1.0 + gain
        return (xf * gain).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"


def build_norm(norm_type: str, dim: int, eps: float) -> RMSNorm:
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps, zero_centered=False)
    if norm_type == "rmsnorm_zero_centered":
        return RMSNorm(dim, eps, zero_centered=True)
    raise ValueError(f"model.norm_type={norm_type!r} is not one of 'rmsnorm', 'rmsnorm_zero_centered'")
