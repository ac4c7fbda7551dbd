"""GatedLM: the project's one decoder-only LM, assembled per layer from a mixer and a feed-forward.

Layer i is ``x + mixer(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``. The mixer
is gated attention (``self_attn``) or a Gated DeltaNet (``linear_attn``) by ``model.layer_pattern``;
the feed-forward (``mlp``) is SwiGLU, a mixture of experts or a structured SwiGLU (``model/ffn.py``).

Parameter names follow transformers' Qwen3.5 text model (``qwen3_5_text`` / ``qwen3_5_moe``) minus its
``model.`` prefix, so export is a rename plus folds: embed_tokens, layers.{i}.{input_layernorm,
self_attn.* | linear_attn.*, post_attention_layernorm, mlp.*}, norm, lm_head. With tied embeddings
there is no lm_head module at all (HF's tie_word_embeddings=True also stores none).

Fused kernels (``model.kernels``, kernels/): every RMSNorm gets ``model.kernels.norm`` here; the
post-mixer residual add runs inside the FFN norm's kernel; the loss is the fused linear + cross-entropy
(``model.kernels.cross_entropy``), which never makes the (B, T, V) logits on the triton backend. None of
this changes a parameter's name or shape.

Initialisation convention: ``init_weights`` visits modules in registration order; a module that
defines ``init_weights(std, out_std)`` initialises its own direct parameters and buffers, every other
nn.Linear / nn.Embedding is N(0, std) (output projections N(0, out_std)), norms reset to identity.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.kernels.cross_entropy import linear_cross_entropy
from hybridtron.model.attention import GatedAttention
from hybridtron.model.ffn import build_ffn
from hybridtron.model.mlp import SwiGLU
from hybridtron.model.norm import RMSNorm, build_norm
from hybridtron.model.rotary import RotaryEmbedding
from hybridtron.model.scale import norm_kwargs

# Projections writing into the residual stream: their init is scaled down with depth (GPT-2).
OUT_PROJ_NAMES = ("o_proj", "down_proj", "out_proj")


@dataclass
class DecodeCache:
    """Incremental-decoding state: per layer, attention's keys/values or the delta-rule mixer's
    convolution window and recurrent state (each module keeps its own keys in its dict); ``pos`` is
    the number of positions already consumed."""

    layers: list[dict] = field(default_factory=list)
    pos: int = 0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_type = cfg.layer_types()[layer_idx]
        # Under model.scale.branch_specific these two carry no gain: each projection reading them has its own
        # in_scale. A MoE feed-forward keeps its norm's gain (its experts' inputs have no scales).
        self.input_layernorm = build_norm(
            cfg.norm_type, cfg.d_model, cfg.norm_eps, **norm_kwargs(cfg, feeds_linear=True, branched=True)
        )
        if self.mixer_type == "A":
            self.self_attn = GatedAttention(cfg)
        else:
            from hybridtron.model.gated_deltanet import GatedDeltaNet

            self.linear_attn = GatedDeltaNet(cfg)
        self.post_attention_layernorm = build_norm(
            cfg.norm_type, cfg.d_model, cfg.norm_eps,
            **norm_kwargs(cfg, feeds_linear=True, branched=not cfg.moe.is_moe_layer(layer_idx)),
        )
        self.mlp = build_ffn(cfg, layer_idx)
        # Both norms feed only nn.Linear projections (the mixers' q/k/v/gates, a SwiGLU's gate/up) unless scale
        # vectors multiply first or the FFN is MoE / structured: there they write the autocast dtype directly.
        plain = not (cfg.scale.two_sided or cfg.scale.branch_specific)
        self.input_layernorm.autocast_output = plain
        self.post_attention_layernorm.autocast_output = plain and type(self.mlp) is SwiGLU
        # The residual add and the second norm in one pass. Set off from outside by tensor parallel
        # (train/parallel/parallelize.py), whose plan rewrites that norm's one input (a sequence shard).
        self.fused_residual = True

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cache: dict | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.mixer_type == "A":
            h = self.self_attn(h, cos, sin, attn_mask, cache=cache, doc_ids=doc_ids)
        else:
            h = self.linear_attn(h, doc_ids=doc_ids, cache=cache)
        if not self.fused_residual:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        h, x = self.post_attention_layernorm(h, residual=x)  # x + h and its norm in one pass
        return x + self.mlp(h)


class GatedLM(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed_tokens = nn.Embedding(vocab_size, cfg.d_model)
        # One rotary table shared by all layers; it has no parameters, so it is no part of the layer list.
        self.rotary = RotaryEmbedding(cfg.resolved_head_dim(), cfg.rotary_fraction, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg.norm_type, cfg.d_model, cfg.norm_eps, **norm_kwargs(cfg, feeds_linear=True))
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, vocab_size, bias=False)
        # Context parallel (set from outside, train/parallel/context_parallel.py): input_ids are then one piece of each
        # sequence, and its positions start where the hooks say.
        self.context_parallel = None
        # Tensor parallel (set from outside, train/parallel/tensor_parallel.py): the loss over a head split by vocabulary
        # rows, (normed h, head shard, labels, z_loss, backend) -> loss.
        self.vocab_parallel_loss = None
        self.loss_backend = cfg.kernels.cross_entropy
        for m in self.modules():
            if getattr(m, "kernel_op", None) == "norm":
                m.kernel_backend = cfg.kernels.norm

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` from meta, too).

        Matrices and the embedding ~ N(0, init_std); projections into the residual stream ~ N(0, init_std /
        sqrt(2 n_layers)) so its variance does not grow with depth (GPT-2). Each part (the embedding, every
        layer, the final norm, the head) draws from its own random stream, seeded from the torch seed and the
        part's name: a part's weights do not depend on which other parts exist, so a pipeline rank that builds
        only its stages gets the weights the whole model would have (and a tied head's copy equals the
        embedding). Within a part, modules are visited in registration order.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        base = torch.initial_seed()
        parts = [(name, m) for name, m in self.named_children() if name != "layers" and m is not None]
        parts += [(f"layers.{i}", m) for i, m in enumerate(self.layers) if m is not None]
        cuda = sorted({p.device.index or 0 for p in self.parameters() if p.device.type == "cuda"})
        for part_name, part in parts:
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed((base + zlib.crc32(part_name.encode())) % 2**63)
                for name, module in part.named_modules(prefix=part_name):
                    if hasattr(module, "init_weights"):
                        module.init_weights(std=std, out_std=out_std)
                    elif isinstance(module, (nn.Linear, nn.Embedding)):
                        nn.init.normal_(module.weight, mean=0.0, std=out_std if name.endswith(OUT_PROJ_NAMES) else std)
                    elif isinstance(module, (RMSNorm, RotaryEmbedding)):
                        module.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: DecodeCache | None = None,
        loss_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V), or with labels (B, T) the mean cross-entropy over
        labels != -100 (labels[t] is the target for position t: the caller shifts) plus the MoE
        auxiliary losses. doc_ids (B, T) keeps attention and recurrent state within a document.
        cache: from `new_cache`, extended in place, for incremental decoding: input_ids are then the
        tokens after those already in the cache. loss_weight: a scalar multiplying the cross-entropy
        (not the auxiliary losses): the trainer's weight of this micro-batch's tokens in the global batch
        (train/step.py)."""
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.pos
        cp = self.context_parallel
        if cp is not None:  # input_ids are this rank's piece of each sequence: rotary at its global positions
            cp.begin(doc_ids)
            cos, sin = (x[cp.positions(T, x.device)] for x in self.rotary(cp.n * T))
        else:
            cos, sin = self.rotary(start + T)
            cos, sin = cos[start:], sin[start:]
        h = self.embed_tokens(input_ids)  # (B, T, d)
        # Documents travel as ids: the fused kernels take their bounds, and only the reference attention
        # builds a (T x T) mask, in the layer that needs it.
        for i, layer in enumerate(self.layers):
            if layer is not None:  # None: a layer this model was built without (a pipeline cut, the planner)
                h = layer(h, cos, sin, None, doc_ids, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.pos = start + T
        out = self.output(h, labels)
        if labels is None:
            return out
        return (out if loss_weight is None else out * loss_weight) + self.aux_loss()

    def output(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's hidden states -> logits (B, T, V), or with labels the language-model loss (mean
        cross-entropy, plus the z-loss when model.lm_z_loss > 0) without the MoE auxiliary losses."""
        h = self.norm(h)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        z_loss = self.cfg.lm_z_loss
        if labels is not None and self.vocab_parallel_loss is not None:  # tensor parallel: vocabulary split over ranks
            return self.vocab_parallel_loss(h, head, labels, z_loss, self.loss_backend)
        if labels is not None:
            # triton: chunked, the (B, T, V) logits never exist; reference: the logits, then the loss (kernels/
            # cross_entropy). Both in fp32: under bf16 autocast the logits alone would be too coarse.
            return linear_cross_entropy(h.flatten(0, 1), head, labels.flatten(), z_loss=z_loss,
                                        backend=self.loss_backend)
        return F.linear(h, head)  # (B, T, V)

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the auxiliary losses (MoE balance, router z-loss) of the last forward, already weighted."""
        return sum((m.aux_loss for m in self.layers.modules() if getattr(m, "aux_loss", None) is not None), 0.0)

    def new_cache(self) -> DecodeCache:
        """An empty decoding cache, filled by the first forward that gets it."""
        return DecodeCache([{} for _ in self.layers])

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once). exclude_embeddings drops the input
        embedding table, which is a lookup, not a matmul; an untied lm_head stays counted."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n

    def num_active_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters one token uses: a MoE layer counts its router, top_k experts and shared expert."""
        n = self.num_params(exclude_embeddings)
        for m in self.layers.modules():
            if hasattr(m, "active_params_per_token"):
                n -= sum(p.numel() for p in m.parameters()) - m.active_params_per_token()
        return n

