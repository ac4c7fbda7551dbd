"""Pure-torch SwiGLU activation ``silu(gate) * up``, the formula the fused kernel is tested against.
As ``F.silu(gate) * up`` in the inputs' dtype (two roundings in bf16; the kernel rounds once)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
