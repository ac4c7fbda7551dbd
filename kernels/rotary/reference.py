"""Pure-torch rotary embedding of q and k (partial rotary fraction, rotate-half pairing), optionally after
the per-head QK-norm; the formula the fused kernel is tested against.

Channel i < rot/2 pairs with channel i + rot/2 and turns by the table's angle for its position; channels
past ``rot = 2 * cos.shape[-1]`` pass through. The QK-norm is RMSNorm over head_dim with gain
``weight + offset`` (None: gainless). Each step computes in fp32 at least and rounds to the input's dtype,
as the unfused model does.
"""

from __future__ import annotations

import torch

from hybridtron.kernels.norm.reference import rms_norm_reference


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D), cos/sin (T, rot/2) -> x rotated, in x.dtype."""
    half = cos.shape[-1]
    rot = 2 * half
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)  # (T, 1, rot/2): broadcast over B and H
    xf = x.to(dtype)
    x1, x2, rest = xf[..., :half], xf[..., half:rot], xf[..., rot:]
    # Each pair (x1_i, x2_i) turns by the 2x2 rotation [[cos, -sin], [sin, cos]].
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


def rotary_qk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norm: bool = False,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    if norm:
        q = rms_norm_reference(q, q_weight, eps, offset)
        k = rms_norm_reference(k, k_weight, eps, offset)
    return rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)
