"""GatedLM: a pre-norm decoder-only LM with gated attention and SwiGLU.

Parameter names follow transformers' Qwen3.5 text model (``qwen3_5_text``) minus its ``model.``
prefix, so export is a rename: embed_tokens, layers.{i}.{input_layernorm, self_attn.*,
post_attention_layernorm, mlp.*}, norm, lm_head. With tied embeddings there is no lm_head module at
all (HF's tie_word_embeddings=True also stores none); the logits reuse embed_tokens.weight.
Extras without an HF counterpart: layers.{i}.self_attn.gate_proj (headwise gate only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from .attention import GatedAttention, doc_causal_mask
from .mlp import SwiGLU
from .norm import RMSNorm, build_norm
from .rotary import RotaryEmbedding


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = build_norm(cfg.norm_type, cfg.d_model, cfg.norm_eps)
        self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = build_norm(cfg.norm_type, cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.resolved_ffn_hidden())

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class GatedLM(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed_tokens = nn.Embedding(vocab_size, cfg.d_model)
        # One rotary table shared by all layers; it has no parameters, so it is no part of the layer list.
        self.rotary = RotaryEmbedding(cfg.resolved_head_dim(), cfg.rotary_fraction, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = build_norm(cfg.norm_type, cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` from meta, too).

        Matrices and the embedding ~ N(0, init_std); o_proj and down_proj ~ N(0, init_std / sqrt(2 n_layers))
        so the residual stream's variance does not grow with depth (GPT-2). Modules are visited in
        registration order, so the result is a function of the torch seed only.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_out = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_out else std)
            elif isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V), or with labels (B, T) the mean cross-entropy over
        labels != -100 (labels[t] is the target for position t: the caller shifts). doc_ids (B, T)
        restricts attention to earlier tokens of the same document."""
        cos, sin = self.rotary(input_ids.shape[1])
        attn_mask = doc_causal_mask(doc_ids) if doc_ids is not None else None
        h = self.embed_tokens(input_ids)  # (B, T, d)
        for layer in self.layers:
            h = layer(h, cos, sin, attn_mask)
        h = self.norm(h)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, head)  # (B, T, V)
        if labels is None:
            return logits
        # fp32 log-softmax: under bf16 autocast the logits arrive in bf16, too coarse for the loss.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once). exclude_embeddings drops the input
        embedding table, which is a lookup, not a matmul; an untied lm_head stays counted."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n
