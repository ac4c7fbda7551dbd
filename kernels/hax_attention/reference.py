"""Pure-torch gathered sparse attention, the formula the Triton kernels are tested against.

Query t of row b attends to the keys ``idx[b, t, :]`` (positions into k and v; -1 marks an empty slot):

    p = softmax_s(scale * q[b, t] . k[b, idx[b, t, s]])   over the non-empty slots s
    out[b, t] = sum_s p_s v[b, idx[b, t, s]]

A query whose slots are all empty gets zeros. Each index should appear at most once per query (a repeated
key would be counted twice); model/hax.py builds the lists that way.
"""

from __future__ import annotations

import torch


def hax_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """q (B, T, D), k (B, L, D), v (B, L, E), idx (B, T, S) integer in [-1, L) -> (B, T, E) in q's dtype.
    Logits, softmax and the weighted sum run in fp32 at least (fp64 stays fp64)."""
    B, T, S = idx.shape
    f = torch.promote_types(q.dtype, torch.float32)
    valid = idx >= 0
    flat = idx.clamp(min=0).reshape(B, T * S, 1)
    kg = k.to(f).gather(1, flat.expand(B, T * S, k.shape[-1])).view(B, T, S, -1)
    vg = v.to(f).gather(1, flat.expand(B, T * S, v.shape[-1])).view(B, T, S, -1)
    logits = torch.einsum("btd,btsd->bts", q.to(f), kg) * scale
    logits = logits.masked_fill(~valid, float("-inf"))
    m = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(f).min)  # a row of -inf gives m = min, p = 0
    p = (logits - m).exp()
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(f).tiny)
    return torch.einsum("bts,btse->bte", p, vg).to(q.dtype)
