"""Rotary position embedding with a partial rotary fraction.

Only the first ``rot_dim = int(head_dim * fraction)`` channels of each head are rotated; the rest
pass through unchanged (Qwen3.5 rotates 25%). Within the rotated slice the pairing is the
rotate-half convention of Llama/Qwen: channel i pairs with channel i + rot_dim/2 and turns by
angle pos * theta^(-2i/rot_dim). That pairing, not the interleaved (2i, 2i+1) one, is what makes
our q/k projections load into transformers' Qwen3.5 without a permutation.

`apply_rotary_qk` is what attention calls: QK-norm and rotation of q and k through the backend switch
(``model.kernels.rotary``; the Triton kernel in kernels/rotary does all four in one pass).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.kernels.rotary.reference import rotate_reference


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, fraction: float, max_seq_len: int, theta: float):
        super().__init__()
        self.rot_dim = int(head_dim * fraction)
        if self.rot_dim < 2 or self.rot_dim % 2:
            raise ValueError(
                f"rotary_fraction={fraction} of head_dim={head_dim} rotates {self.rot_dim} channels; need an even number >= 2"
            )
        self.max_seq_len = max_seq_len
        self.theta = theta
        # Tables are derived, not learned: non-persistent, so they stay out of state_dict (HF recomputes
        # them too) and `reset_parameters` rebuilds them after `to_empty` from the meta device.
        self.register_buffer("cos", torch.empty(max_seq_len, self.rot_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, self.rot_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.cos.is_meta:
            return
        # Angles in float64: fp32 rounding of inv_freq (relative ~6e-8) alone would shift the angle at
        # position 1e5 by ~6e-3 rad. The tables are stored fp32 (fp64 after `model.double()`); casting the
        # model to bf16 would round them too, so use autocast for bf16.
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float64, device=self.cos.device) / self.rot_dim
        inv_freq = self.theta**-exponents  # (rot_dim/2,)
        pos = torch.arange(self.max_seq_len, dtype=torch.float64, device=self.cos.device)
        angles = torch.outer(pos, inv_freq)  # (max_seq_len, rot_dim/2)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0..seq_len-1, each (seq_len, rot_dim/2). Blocks receive these
        tensors rather than this module, so a pipeline stage's inputs are plain tensors."""
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the rotary table of model.max_seq_len={self.max_seq_len} "
                f"positions; raise model.max_seq_len or shorten the sequence"
            )
        return self.cos[:seq_len], self.sin[:seq_len]

    def extra_repr(self) -> str:
        return f"rot_dim={self.rot_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by tables (T, rot/2); channels past rot_dim pass through.
    Computed in at least fp32 (fp64 stays fp64, for tests), returned in x.dtype. The formula lives beside
    the fused kernel (kernels/rotary/reference.py), which is tested against it."""
    return rotate_reference(x, cos, sin)


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: nn.Module | None = None,
    k_norm: nn.Module | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-norm (when the norms are given) then rotary on q (B, T, H, D) and k (B, T, KV, D), through the
    backend switch ``model.kernels.rotary``. Reference: the norm modules, then `apply_rotary` on each. Triton:
    one kernel for norm and rotation of both (kernels/rotary), reading the norms' effective gains."""
    from hybridtron.kernels.backend import pick_for
    from hybridtron.kernels.rotary import rotary_qk

    if pick_for("rotary", backend, q, k) == "reference":
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if q_norm is None:
        return rotary_qk(q, k, cos, sin, backend=backend)
    (qw, offset), (kw, _) = q_norm.kernel_gain(), k_norm.kernel_gain()
    return rotary_qk(q, k, cos, sin, norm=True, q_weight=qw, k_weight=kw, eps=q_norm.eps, offset=offset,
                     backend=backend)
