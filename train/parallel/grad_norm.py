"""The global gradient norm and clipping over every rank's pieces: FSDP and tensor-parallel shards (DTensors on
different meshes), experts held by expert-parallel ranks, and pipeline stages on other ranks."""

from __future__ import annotations

import math

import torch


def clip_grad_norm(params, max_norm: float, counted=None, sum_other_ranks=None) -> float:
    """Clip the gradients of ``params`` by their global 2-norm and return it. ``counted``: the parameters whose
    gradients make up the norm (default all; a pipeline's tied copy counts once); ``sum_other_ranks``: adds the
    squared norms of ranks holding other parameters (pipeline stages). Gradients may be DTensors on different
    meshes (FSDP over dp, experts over ep): each mesh's norm is taken whole, then they are combined."""

    params = [p for p in params if p.grad is not None]
    counted = params if counted is None else [p for p in counted if p.grad is not None]
    by_mesh = _by_mesh(counted)
    if len(by_mesh) <= 1 and sum_other_ranks is None and counted is params:  # one kind: torch's own, as always
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    square = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        square += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    total = math.sqrt(sum_other_ranks(square) if sum_other_ranks is not None else square)
    coef = (max_norm / (total + 1e-6)) if max_norm else 1.0
    if math.isfinite(total) and coef < 1.0:
        for grads in _by_mesh(params).values():  # one fused multiply per kind of tensor
            torch._foreach_mul_(grads, coef)
    return total


def _by_mesh(params) -> dict[int, list[torch.Tensor]]:
    out: dict[int, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    return out
