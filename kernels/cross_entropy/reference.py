"""Pure-torch LM-head cross-entropy: the whole logits matrix, then the loss. The formula the chunked,
fused op is tested against, and the ``reference`` backend.

``loss = mean over rows with label != ignore_index of (lse - logit[label] + z_loss * lse^2)``, with
``lse = logsumexp(logits)`` in fp32 at least; the logits themselves come from the matmul in the inputs'
dtype (bf16 under autocast), as in the unfused model. No valid row: NaN, as ``F.cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """h (N, d), weight (V, d), labels (N,) -> scalar loss."""
    logits = F.linear(h, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index)
    if z_loss:
        valid = labels != ignore_index
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + z_loss * (lse.square() * valid).sum() / valid.sum()
    return loss
