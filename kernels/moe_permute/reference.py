"""Pure-torch MoE token permute / unpermute, the formulas the fused kernels are tested against (and what
model/moe.py computes on the reference backend).

Assignment a = token * k + j is token a // k's j-th expert choice (the flat top-k indices). ``order`` lists
the assignments sorted by expert (stable: by token within an expert), so each expert's rows are one
contiguous slice; ``pos`` is its inverse (assignment a sits at row pos[a] of the sorted rows).

    permute:    xs[r] = x[order[r] // k]                                  (N k, d)
    unpermute:  y[n]  = sum_j ys[pos[n k + j]] * w[n k + j]               (N, d)
"""

from __future__ import annotations

import torch


def sort_assignments(flat_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N k,) expert of each assignment -> (order, pos): the assignments grouped by expert and its inverse."""
    order = torch.argsort(flat_idx, stable=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, pos


def permute_reference(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x (N, d) -> (N k, d): the token row of every assignment, in expert order."""
    return x[order // top_k]


def unpermute_reference(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """ys (N k, d) in expert order, weights (N k,) per assignment -> (N, d): each token's weighted sum of its
    k rows, in ys's dtype (the weights are rounded to it first, the sum is in it: bf16 rounds twice)."""
    ys = ys * weights.flatten()[order, None].to(ys.dtype)
    y = torch.empty_like(ys).index_copy(0, order, ys)  # back to assignment order
    return y.view(-1, top_k, ys.shape[-1]).sum(1)
