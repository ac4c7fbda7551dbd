"""Pure-torch RMSNorm in every form the fused kernel covers; the formula the kernel is tested against.

``y = (h / sqrt(mean(h^2) + eps)) * (w + offset) [* silu(z)]`` with ``h = x [+ residual]``, computed in fp32
at least (fp64 stays fp64) and returned in h's dtype, or in ``out_dtype`` when given (one rounding: what a
consumer's cast of the h-dtype output would give). ``offset`` is 1 for the zero-centred gain ``1 + w``;
``weight`` None is a gainless norm. With a residual the sum ``h`` is returned too (the new residual stream),
rounded to its dtype before it is normalised, as the unfused model does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    dtype = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(dtype)
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        gain = weight.to(dtype)
        y = y * (gain + offset if offset else gain)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = y.to(out_dtype or h.dtype)
    return y if residual is None else (y, h)
