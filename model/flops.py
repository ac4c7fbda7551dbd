"""Training FLOPs per token of GatedLM, counted from its matmuls.

Convention: a (m x k) @ (k x n) matmul is 2 m k n FLOPs; training is 3x the forward (backward =
2x forward: grads w.r.t. inputs and weights). Counted: every projection at its real width (the fused
elementwise gate doubles q_proj, the headwise gate adds n_heads outputs, k/v use n_kv_heads), the
SwiGLU's three matrices, the lm_head (tied or not, it is a matmul), and attention's QK^T and AV.
For those, a causal query sees on average about half the sequence, so per token we count
2 (QK^T, AV) * 2 * n_heads * head_dim * seq_len / 2; document masking, which skips more, is ignored
(an upper bound then). Not counted: the embedding lookup, norms, rotary, softmax, gating, residuals.
"""

from __future__ import annotations

from ..configs import ModelConfig


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    d, H, KV, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim()
    q_out = {"elementwise": 2 * H * D, "headwise": H * D + H, "none": H * D}[cfg.attn_gate]
    proj = d * q_out + 2 * d * KV * D + H * D * d  # q(+gate), k, v, o: multiply-adds per token
    attn = 2 * H * D * seq_len / 2  # QK^T and AV over the causal half
    mlp = 3 * d * cfg.resolved_ffn_hidden()
    forward = 2 * (cfg.n_layers * (proj + attn + mlp) + d * vocab_size)
    return 3.0 * forward
