"""Each tuned op's shape class from a call's tensors: what ``auto``'s decision on CUDA is keyed by (kernels/tune.py).

A shape class is ``(op, ((name, value), ...))`` of plain Python values, so `backend.pick` can take it as a
constant under torch.compile: the dtype the op computes in (the autocast dtype under autocast), the batch, the
sequence length rounded up to a power of two, head counts and dims, the gate, documents or not, and whether
gradients are wanted. The ops import this module; their tuning cases (kernels/tune_cases.py) import the ops.
"""

from __future__ import annotations

import torch


def bucket(T: int) -> int:
    """The sequence-length bucket: the next power of two, at least 64."""
    return max(64, 1 << max(int(T) - 1, 0).bit_length())


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype an op computes ``t`` in: the autocast dtype under autocast (the ops cast to it), else its own."""
    dev = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def grad_wanted(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def gate_kind(q: torch.Tensor, gate: torch.Tensor | None) -> str:
    return "none" if gate is None else "elementwise" if gate.dim() == q.dim() else "headwise"


def attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: str, docs: bool) -> tuple:
    """q (B, T, H, D) or packed (N, H, D); k, v (..., KV, D); gate: "none", "headwise" or "elementwise"."""
    B, T = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    return ("attention", (("dtype", _dt(compute_dtype(q))), ("B", int(B)), ("T", bucket(T)), ("H", int(q.shape[-2])),
                          ("KV", int(k.shape[-2])), ("D", int(q.shape[-1])), ("gate", gate), ("docs", bool(docs)),
                          ("grad", grad_wanted(q, k, v))))


def delta_rule_shape(q, k, v, g, beta, initial_state, output_final_state: bool, docs: bool, chunk_size: int) -> tuple:
    """Shapes as the reference's (kernels/gated_delta_rule/reference.py): q (B, T, Hk, Dk), k (B, T, n_h, Hk, Dk),
    v (B, T, n_h, Hv, Dv). ``state``: an initial state is given or the final one wanted (prefill, context pieces)."""
    B, T, Hk, Dk = q.shape
    n_h, Hv, Dv = v.shape[2], v.shape[3], v.shape[4]
    return ("delta_rule", (("dtype", _dt(compute_dtype(q))), ("B", int(B)), ("T", bucket(T)), ("Hk", int(Hk)),
                           ("Hv", int(Hv)), ("Dk", int(Dk)), ("Dv", int(Dv)), ("n_h", int(n_h)),
                           ("chunk", int(chunk_size)), ("docs", bool(docs)),
                           ("state", initial_state is not None or bool(output_final_state)),
                           ("grad", grad_wanted(q, k, v, g, beta, initial_state))))


def conv_shape(x: torch.Tensor, weight: torch.Tensor, docs: bool) -> tuple:
    """x (B, T, C); weight (C, 1, K)."""
    B, T, C = x.shape
    return ("conv", (("dtype", _dt(compute_dtype(x))), ("B", int(B)), ("T", bucket(T)), ("C", int(C)),
                     ("K", int(weight.shape[-1])), ("docs", bool(docs)), ("grad", grad_wanted(x, weight))))
