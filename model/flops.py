"""Training FLOPs per token of GatedLM, counted from its matmuls (for MFU).

Convention: a (m x k) @ (k x n) matmul is 2 m k n FLOPs; training is 3x the forward (backward =
2x forward: grads w.r.t. inputs and weights). Every weight matrix of the layers (>= 2-D parameters:
projections, structured-FFN factors and blocks, experts, the depthwise convolution) is used exactly
once per token, so the weight matmuls cost 2 FLOPs per *active* parameter: a MoE layer counts its
router, its top_k experts and its shared expert only. The parameters are counted on a meta-device
model, so the count follows the layout exactly and costs no memory. Added to that:
- the lm_head (tied or not, it is a matmul of d_model x vocab);
- attention's QK^T and AV: a causal query sees on average about half the sequence, 2 * 2 * n_heads *
  head_dim * seq_len / 2 per token; document masking, which skips more, is ignored (an upper bound);
- the chunked delta rule, per value head and token with chunk C: QK^T and KK^T within the chunk
  (2 C Dk), the UT solve and the intra-chunk AV (about C (Dk + Dv) / 2 + C Dv), and three state
  products (q S, k S, the rank-C update: 3 Dk Dv); DeltaProduct runs that n_h times per token.
Not counted: the embedding lookup, norms, rotary, softmax, gating, residuals, conv of the state
window during decoding. Self-guided dense weights count while they exist (they are computed).
"""

from __future__ import annotations

import torch

from hybridtron.configs import ModelConfig

# layer_flops by (config, vocabulary, sequence length): it builds the model (on meta) to count, seconds for a
# 126-layer 405B, and the planner asks for every pipeline stage it builds
_COUNTED: dict[tuple, tuple[tuple[float, ...], float]] = {}


def layer_flops(cfg: ModelConfig, vocab_size: int, seq_len: int) -> tuple[list[float], float]:
    """Forward FLOPs per token of each layer, and of the output layer (lm_head), as counted above."""
    key = (repr(cfg), vocab_size, seq_len)
    if key not in _COUNTED:
        per_layer, head = _count(cfg, vocab_size, seq_len)
        _COUNTED[key] = tuple(per_layer), head
    per_layer, head = _COUNTED[key]
    return list(per_layer), head


def _count(cfg: ModelConfig, vocab_size: int, seq_len: int) -> tuple[list[float], float]:
    from hybridtron.model.lm import GatedLM

    with torch.device("meta"):
        model = GatedLM(cfg, vocab_size)
    H, D = cfg.n_heads, cfg.resolved_head_dim()
    _hk, hv, dk, dv = cfg.deltanet.resolved(cfg)
    C = min(cfg.deltanet.chunk_size, seq_len)
    delta_per_head = 2 * C * dk + C * (dk + dv) / 2 + C * dv + 3 * dk * dv
    mixer = {"A": 2 * H * D * seq_len / 2, "L": hv * cfg.deltanet.n_householder * delta_per_head}
    per_layer = []
    for layer, kind in zip(model.layers, cfg.layer_types(), strict=True):
        matmul = sum(p.numel() for p in layer.parameters() if p.ndim >= 2)
        for m in layer.modules():
            if hasattr(m, "active_params_per_token"):  # MoE: only the routed experts compute
                matmul -= sum(p.numel() for p in m.parameters() if p.ndim >= 2) - m.active_params_per_token()
        per_layer.append(2.0 * (matmul + mixer[kind]))
    return per_layer, 2.0 * cfg.d_model * vocab_size


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    per_layer, head = layer_flops(cfg, vocab_size, seq_len)
    return 3.0 * (sum(per_layer) + head)
