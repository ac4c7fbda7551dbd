"""Grouped-query self-attention with QK-norm, partial rotary and an output gate.

The gate is that of "Gated Attention for Large Language Models" (Qiu et al., 2025): the attention
output of each head is multiplied by sigmoid(x W_g), x being the normed block input, before o_proj.

- ``elementwise``: one gate per channel. As in transformers' Qwen3-Next / Qwen3.5 the gate is fused
  into q_proj: its output, viewed as (..., n_heads, 2 * head_dim), holds [query | gate] per head.
  Keeping that layout makes the HF export a rename.
- ``headwise``: one gate per head from a separate ``gate_proj`` (n_heads, d_model); no HF counterpart.
- ``none``: the ungated baseline (q_proj is n_heads * head_dim wide).

``model.kernels.attention`` picks how attention and gate are computed (kernels/backend.py): ``reference``
is SDPA then the gate, below; ``triton`` is our gated flash attention (kernels/gated_attention: causal,
grouped-query, documents as per-token bounds, the gate fused into its epilogue); ``sdpa``, ``flex`` and
``flash-attn`` are torch's SDPA (cuDNN where it applies), torch's flex attention and flash-attn's (varlen)
kernel, each then the gate in one fused pass; ``auto`` on CUDA the fastest of them that agrees with the
reference at the call's shape class (kernels/tune.py). Same parameters and outputs for all. Decoding with a
KV cache (queries shorter than keys) always runs the SDPA path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.gated_attention import gated_attention
from hybridtron.kernels.shape_classes import attention_shape
from hybridtron.model.linear import make_linear
from hybridtron.model.norm import build_norm
from hybridtron.model.rotary import apply_rotary_qk
from hybridtron.model.scale import norm_kwargs


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool, True where query t may attend key s:
    s <= t and doc_ids[s] == doc_ids[t]. The diagonal is always True, so no row is empty."""
    T = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal)[:, None]


def doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) bool, True where a new document begins (never at t = 0: nothing
    precedes it in the row, so a call continues the cached document)."""
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def _doc_numbers(doc_ids: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """(B, T) documents numbered 0, 1, ... from the first position, a new one wherever doc_ids change."""
    if doc_ids is None:
        return torch.zeros(B, T, dtype=torch.long, device=device)
    return doc_starts(doc_ids).long().cumsum(1)


def doc_ids_from_mask(attn_mask: torch.Tensor) -> torch.Tensor:
    """Inverse of `doc_causal_mask`: (B, 1, T, T) -> (B, T) document ids (0, 1, ... per row). Row t's first
    visible key is its document's first token. Only for masks from `doc_causal_mask`."""
    first = attn_mask[:, 0].to(torch.uint8).argmax(-1)  # (B, T): argmax returns the first maximum
    starts = first == torch.arange(first.shape[1], device=first.device)
    return starts.cumsum(1)


def first_token_attention(q: torch.Tensor, k: torch.Tensor, doc_ids: torch.Tensor | None) -> tuple[float, int]:
    """The attention-sink measure: how much attention probability queries put on the first token of their
    document (of the sequence without documents), summed over queries and heads, with the count of (query,
    head) pairs. A document's first query has nowhere else to look and is left out. q: (B, T, H, D) and
    k: (B, T, KV, D) as they enter attention (after rotary and QK-norm). Explicit scores: for evaluation only."""
    B, T, H, D = q.shape
    kk = k.repeat_interleave(H // k.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kk.float()) * D ** -0.5
    doc = _doc_numbers(doc_ids, B, T, q.device)
    pos = torch.arange(T, device=q.device)
    visible = (doc[:, :, None] == doc[:, None, :]) & (pos[None, :, None] >= pos[None, None, :])  # (B, T, S)
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    starts = doc_starts(doc_ids) if doc_ids is not None else torch.zeros(B, T, dtype=torch.bool, device=q.device)
    starts[:, 0] = True
    first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), dim=1).values  # (B, T): doc's first index
    on_first = probs.gather(-1, first[:, None, :, None].expand(B, H, T, 1)).squeeze(-1)  # (B, H, T)
    keep = ~starts[:, None, :].expand(B, H, T)
    return float(on_first[keep].sum()), int(keep.sum())


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.resolved_head_dim()
        self.gate = cfg.attn_gate
        self.kernel_backend = cfg.kernels.attention
        if self.gate not in ("elementwise", "headwise", "none"):
            raise ValueError(f"model.attn_gate={self.gate!r} is not one of 'elementwise', 'headwise', 'none'")
        q_width = self.n_heads * self.head_dim
        qk = dict(after_norm=True, feeds_norm=cfg.qk_norm)
        self.q_proj = make_linear(cfg, cfg.d_model, 2 * q_width if self.gate == "elementwise" else q_width, **qk)
        self.k_proj = make_linear(cfg, cfg.d_model, self.n_kv_heads * self.head_dim, **qk)
        self.v_proj = make_linear(cfg, cfg.d_model, self.n_kv_heads * self.head_dim, after_norm=True)
        if self.gate == "headwise":
            self.gate_proj = make_linear(cfg, cfg.d_model, self.n_heads, after_norm=True)
        self.o_proj = make_linear(cfg, q_width, cfg.d_model, residual_out=True)
        if cfg.qk_norm:
            # Over head_dim only (Qwen3), so one gain vector is shared by all heads.
            qk_norm_kw = norm_kwargs(cfg, feeds_linear=False)  # Output-Norm gains
            self.q_norm = build_norm(cfg.norm_type, self.head_dim, cfg.norm_eps, **qk_norm_kw)
            self.k_norm = build_norm(cfg.norm_type, self.head_dim, cfg.norm_eps, **qk_norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_backend = cfg.kernels.rotary  # QK-norm + rotary in one kernel on the triton backend
        # Set off from outside by tensor parallel (train/parallel/parallelize.py), whose plan hooks the QK-norms (their
        # inputs become head shards): they then run as modules and the kernel only rotates.
        self.fused_qk_norm = True
        self.context_parallel = None  # set from outside under context parallelism (train/parallel/context_parallel.py)
        self.sink_stats: list | None = None  # a list: each forward appends its first_token_attention (eval only)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, d_model), the normed block input; cos, sin: (T, rot_dim/2) rotary tables for the
        positions of x; attn_mask: None (plain causal) or (B, 1, T, T) bool from `doc_causal_mask`.
        cache: decoding state of this layer ({} at the first call): keys and values of earlier
        positions, extended in place, so each new token costs one query against the cache.
        doc_ids: (B, T), the documents of `attn_mask` without the T x T tensor (the fused kernels read
        it; given alone, the SDPA path builds the mask from it)."""
        B, T, _ = x.shape
        D = self.head_dim
        # Head counts come from the projections' widths: under tensor parallelism each rank holds a contiguous
        # block of whole heads (and of their kv groups), so the same code runs on its share.
        q = self.q_proj(x)
        if self.gate == "elementwise":
            q, gate = q.view(B, T, -1, 2 * D).split(D, dim=-1)  # each (B, T, H, D)
        else:
            q = q.view(B, T, -1, D)
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D)
        H = q.shape[2]

        if self.q_norm is not None and not self.fused_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary_qk(q, k, cos, sin, backend=self.rotary_backend)
        else:
            q, k = apply_rotary_qk(q, k, cos, sin, self.q_norm, self.k_norm, backend=self.rotary_backend)
        if self.sink_stats is not None and cache is None:  # evaluation asked for the attention-sink measure
            self.sink_stats.append(first_token_attention(q, k, doc_ids if doc_ids is not None else (
                doc_ids_from_mask(attn_mask) if attn_mask is not None else None)))

        if self.context_parallel is not None and cache is None:  # x is one piece of the sequence: ring attention
            out = self.context_parallel.attention(q, k, v, doc_ids, self.kernel_backend)  # all pieces' keys
        else:
            docs = doc_ids is not None or attn_mask is not None  # decoding (a cache) runs SDPA: nothing to measure
            shape = attention_shape(q, k, v, self.gate, docs) if cache is None else None
            backend = pick_for("attention", self.kernel_backend, q, k, v, shape=shape)
            if backend != "reference" and cache is None:
                gate_in = self.gate_proj(x) if self.gate == "headwise" else gate if self.gate == "elementwise" else None
                if doc_ids is None and attn_mask is not None:
                    doc_ids = doc_ids_from_mask(attn_mask)  # the kernels take documents as bounds, not a mask
                out = gated_attention(q, k, v, gate_in, doc_ids=doc_ids, backend=backend)  # (B, T, H, D), gated
                return self.o_proj(out.reshape(B, T, H * D))
            out = self._sdpa(q, k, v, attn_mask, doc_ids, cache)  # the reference, and decoding

        if self.gate == "elementwise":
            out = out * torch.sigmoid(gate)
        elif self.gate == "headwise":
            out = out * torch.sigmoid(self.gate_proj(x)).unsqueeze(-1)  # (B, T, H, 1)
        return self.o_proj(out.reshape(B, T, H * D))

    @staticmethod
    def _sdpa(q, k, v, attn_mask, doc_ids, cache):
        """torch's attention on (B, T, H, D) q and (B, T, KV, D) k, v; with a cache, the cached keys first."""
        B, T, H, KV = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if cache is not None and cache.get("k") is not None:
            # A call continues the cached document (as the delta rule's state and the convolution's window do):
            # documents are numbered from the cache's last one, a new one starting where doc_ids change.
            doc_q = cache["doc"][:, -1:] + _doc_numbers(doc_ids, B, T, q.device)
            doc_k = torch.cat([cache["doc"], doc_q], dim=1)
            k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            S = k.shape[1]  # query t (position S - T + t) sees keys up to itself, of its document
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            attn_mask, is_causal = ((doc_q[:, :, None] == doc_k[:, None, :]) & causal)[:, None], False
            cache["k"], cache["v"], cache["doc"] = k, v, doc_k
        else:
            if attn_mask is None and doc_ids is not None:
                attn_mask = doc_causal_mask(doc_ids)
            is_causal = attn_mask is None
            if cache is not None:  # the first call: documents numbered 0, 1, ... from its first position
                cache["k"], cache["v"], cache["doc"] = k, v, _doc_numbers(doc_ids, B, T, q.device)
        # SDPA wants (B, heads, T, D). enable_gqa maps query head h to kv head h // (H // KV), the
        # repeat_interleave grouping that transformers' repeat_kv uses too.
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, is_causal=is_causal and T > 1, enable_gqa=KV != H,
        ).transpose(1, 2)  # (B, T, H, D)
