"""The model section of the job config: one LM assembled per layer from a mixer and a feed-forward.

Layer ``i`` is ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``. The mixer is gated attention (``A``)
or a Gated DeltaNet (``L``, for linear attention) by ``layer_pattern``; the feed-forward is SwiGLU, a
mixture of experts (``moe``) or a structured low-rank/block layer (``ffn``); ``scale`` switches on the
scale-vector reparameterisations of every projection. Sub-sections are dataclasses of their own, so a
dotted override reaches them: ``--model.moe.n_experts 8``, ``--model.deltanet.neg_eigval true``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hybridtron.configs.base import ConfigError

# Letters of model.layer_pattern, and the full names transformers' Qwen3.5 config uses in layer_types.
MIXER_NAMES = {"A": "full_attention", "L": "linear_attention"}


@dataclass
class DeltaNetConfig:
    """Gated DeltaNet mixer (Yang et al.), in transformers' Qwen3.5 layout; ``L`` layers use it."""

    n_k_heads: int = 0  # query/key heads; 0: model.n_heads
    n_v_heads: int = 0  # value heads (GVA: a multiple of n_k_heads); 0: n_k_heads
    k_head_dim: int = 0  # 0: the attention head_dim
    v_head_dim: int = 0  # 0: k_head_dim
    conv_size: int = 4  # causal depthwise convolution width over q, k, v
    # beta = 2 sigmoid(b) instead of sigmoid(b): transition eigenvalues in (-1, 1) (Grazzi et al.), which
    # lets the layer track state such as parity.
    neg_eigval: bool = False
    n_householder: int = 1  # DeltaProduct's n_h (Siems et al.): Householder steps per token; 1 = Gated DeltaNet
    chunk_size: int = 64  # training form: chunked WY/UT algorithm over blocks of this many steps
    algo: Literal["chunk", "recurrent"] = "chunk"  # recurrent: token-by-token (slow; a reference)
    # A single-head sparse attention branch inside the mixer (model/hax.py): "hax" (Zhan et al.: LSH buckets +
    # learned key selection), "lsh" or "key_selection" alone, "window" (the last sparse_keys keys, a
    # context-independent baseline); "none": off.
    sparse_attention: Literal["none", "hax", "lsh", "key_selection", "window"] = "none"
    sparse_keys: int = 64  # keys per query at most, split evenly between the branch's sources
    sparse_dim: int = 0  # q/k width of the branch; 0: k_head_dim
    lsh_bits: int = 8  # sign bits of the random projection: 2^lsh_bits buckets
    ranking_loss_weight: float = 0.1  # weight of the key scorer's ranking loss (added to the LM loss in training)

    def resolved(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(n_k_heads, n_v_heads, k_head_dim, v_head_dim) with the 0 defaults filled in."""
        hk = self.n_k_heads or cfg.n_heads
        hv = self.n_v_heads or hk
        dk = self.k_head_dim or cfg.resolved_head_dim()
        dv = self.v_head_dim or dk
        return hk, hv, dk, dv

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("n_k_heads", "n_v_heads", "k_head_dim", "v_head_dim"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.deltanet.{name}={getattr(self, name)} must be >= 0 (0 = derived)")
        hk, hv, _, _ = self.resolved(cfg)
        if hv % hk:
            raise ConfigError(
                f"model.deltanet.n_v_heads={hv} is not a multiple of model.deltanet.n_k_heads={hk}; each key head "
                f"serves n_v_heads / n_k_heads value heads, so choose n_v_heads among the multiples of {hk}"
            )
        if self.conv_size < 1:
            raise ConfigError(f"model.deltanet.conv_size={self.conv_size} must be >= 1")
        if self.n_householder < 1:
            raise ConfigError(f"model.deltanet.n_householder={self.n_householder} must be >= 1 (1 = Gated DeltaNet)")
        if self.chunk_size < 1:
            raise ConfigError(f"model.deltanet.chunk_size={self.chunk_size} must be >= 1")
        if self.sparse_attention != "none":
            sources = 2 if self.sparse_attention == "hax" else 1
            if self.sparse_keys < sources:
                raise ConfigError(f"model.deltanet.sparse_keys={self.sparse_keys} must be >= {sources} for "
                                  f"sparse_attention={self.sparse_attention} (one key per source at least)")
            if not 1 <= self.lsh_bits <= 30 or self.sparse_dim < 0 or self.ranking_loss_weight < 0:
                raise ConfigError(f"model.deltanet: lsh_bits={self.lsh_bits} must be in [1, 30], sparse_dim="
                                  f"{self.sparse_dim} >= 0 (0 = k_head_dim), ranking_loss_weight="
                                  f"{self.ranking_loss_weight} >= 0")


@dataclass
class MoEConfig:
    """Dropless top-k token-choice mixture of SwiGLU experts (Qwen3.5-MoE layout)."""

    n_experts: int = 0  # 0: no MoE layers (every feed-forward is dense)
    top_k: int = 2
    expert_hidden: int = 0  # each expert's SwiGLU width; 0: model.ffn_hidden
    shared_expert_hidden: int = 0  # width of the always-on shared expert (sigmoid-gated); 0: none
    router: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to 1
    aux_loss_coef: float = 0.01  # Switch-style load-balancing loss; 0: off
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE); 0: off
    # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k
    # choice only, moved by this step towards the mean load after every optimizer step; 0: off.
    bias_update_rate: float = 0.0
    every: int = 1  # layer i is MoE when (i + 1) % every == 0 (Qwen's decoder_sparse_step) ...
    layers: list[int] = field(default_factory=list)  # ... unless this lists the MoE layers explicitly
    backend: Literal["native", "megablocks"] = "native"
    # Where the token rows are put into expert order for the gate_up projection: "permute" (the measured default)
    # writes them (kernels/moe_permute) and the grouped GEMM reads them; "gemm" gathers them in the gate_up GEMM's
    # operand loads (kernels/moe_gemm: Triton, on model.kernels.moe's switch; its reference is the permute path).
    gather: Literal["permute", "gemm"] = "permute"

    def is_moe_layer(self, i: int) -> bool:
        if self.n_experts == 0:
            return False
        return i in self.layers if self.layers else (i + 1) % self.every == 0

    def validate(self, cfg: ModelConfig) -> None:
        if self.n_experts < 0:
            raise ConfigError(f"model.moe.n_experts={self.n_experts} must be >= 0 (0 = no MoE)")
        if self.n_experts == 0:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} must be between 1 and model.moe.n_experts={self.n_experts}"
            )
        if self.expert_hidden < 0 or self.shared_expert_hidden < 0:
            raise ConfigError("model.moe.expert_hidden and model.moe.shared_expert_hidden must be >= 0")
        if self.every < 1:
            raise ConfigError(f"model.moe.every={self.every} must be >= 1")
        bad = [i for i in self.layers if not 0 <= i < cfg.n_layers]
        if bad:
            raise ConfigError(
                f"model.moe.layers lists layer {bad[0]}, but the model has layers 0..{cfg.n_layers - 1}"
            )
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.moe.{name}={getattr(self, name)} must be >= 0")


@dataclass
class StructuredFFNConfig:
    """Structured feed-forward matrices (Wei et al., "Building on Efficient Foundations")."""

    kind: Literal["dense", "lowrank", "blockdense", "blockshuffle"] = "dense"
    rank: int = 0  # lowrank / blockdense: inner rank; 0: half of min(in, out) of each matrix
    n_blocks: int = 4  # blockdense / blockshuffle: diagonal blocks; must divide both widths
    dense_first_layer: bool = True  # keep layer 0's FFN dense
    # Self-guided training: a dense weight initialised to the structured product trains beside it,
    # y = alpha W x + (1 - alpha) structured(x), alpha decaying 1 -> 0 (cosine) over this fraction of
    # train.max_steps; then the dense weights leave the model and the optimizer.
    self_guided: bool = False
    self_guided_fraction: float = 0.5

    def validate(self, cfg: ModelConfig) -> None:
        if self.kind == "dense":
            return
        if self.rank < 0:
            raise ConfigError(f"model.ffn.rank={self.rank} must be >= 0 (0 = half the smaller width)")
        d, h = cfg.d_model, cfg.resolved_ffn_hidden()
        if self.kind in ("lowrank", "blockdense") and self.rank > min(d, h):
            raise ConfigError(
                f"model.ffn.rank={self.rank} exceeds min(d_model, ffn_hidden)={min(d, h)}; a rank above a "
                f"matrix's smaller side is no compression: choose a rank <= {min(d, h)}"
            )
        if self.kind in ("blockdense", "blockshuffle"):
            if self.n_blocks < 1 or d % self.n_blocks or h % self.n_blocks:
                raise ConfigError(
                    f"model.ffn.n_blocks={self.n_blocks} must divide both d_model={d} and ffn_hidden={h}; "
                    f"choose a common divisor"
                )
            if self.kind == "blockdense" and self.rank and self.rank % self.n_blocks:
                raise ConfigError(
                    f"model.ffn.rank={self.rank} must be a multiple of model.ffn.n_blocks={self.n_blocks} "
                    f"for blockdense (each block maps to rank / n_blocks channels)"
                )
        if not 0.0 < self.self_guided_fraction <= 1.0:
            raise ConfigError(f"model.ffn.self_guided_fraction={self.self_guided_fraction} must be in (0, 1]")


@dataclass
class ScaleVectorConfig:
    """Scale-vector strategy (Wang et al., "Negligible in Size, Significant in Effect")."""

    # (i) one input scale per consuming projection (q, k, v, gate, up, ...) instead of the shared norm gain.
    branch_specific: bool = False
    # (ii) scales on both sides of every projection: diag(s_out) W diag(s_in).
    two_sided: bool = False
    # (iii) every scale vector as magnitude * unit-norm direction.
    magnitude_direction: bool = False
    # The paper's weight-decay rule: decay Input-Norm scales (those feeding a linear map), none on
    # Output-Norm scales (those applied to a map's output). Off: train.decay_norms decides for all.
    decay_rule: bool = False

    @property
    def any(self) -> bool:
        return self.branch_specific or self.two_sided or self.magnitude_direction


KernelBackend = Literal["auto", "reference", "triton", "sdpa", "flex", "flash-attn", "fla", "causal-conv1d"]


@dataclass
class KernelConfig:
    """Which implementation runs each fused op (kernels/backend.py). auto: the fastest correct one on the
    device -- on CUDA, for attention, the delta rule and the short convolution, measured at each shape class
    among ours and the installed peers (kernels/tune.py), for the other ops our Triton kernels; on the CPU the
    pure-torch reference. An explicit backend that cannot run on the run's device, or that cannot take the model
    (a chunk size, a head dim), is refused before anything is built -- never replaced: train/parallel/layout.py
    asks kernels/backend.py, also for the backend auto would take.
    Changing these changes neither the parameters nor the checkpoint layout, only how they are computed."""

    norm: KernelBackend = "auto"  # RMSNorm (+ residual add), gated RMSNorm of the delta-rule mixer
    rotary: KernelBackend = "auto"  # rotary embedding of q and k (with the QK-norm fused)
    swiglu: KernelBackend = "auto"  # silu(gate) * up
    attention: KernelBackend = "auto"  # gated attention: triton, sdpa, flex, flash-attn, reference
    cross_entropy: KernelBackend = "auto"  # LM head matmul + loss in chunks (the logits never exist whole)
    conv: KernelBackend = "auto"  # GDN's short causal depthwise conv + SiLU: triton, causal-conv1d, fla, reference
    moe: KernelBackend = "auto"  # MoE token permute (expert-sorted gather) / unpermute (weighted combine)
    delta_rule: KernelBackend = "auto"  # GDN's gated delta rule (chunked, decoding): triton, fla, reference
    hax: KernelBackend = "auto"  # gathered sparse attention of the HAX branch (model.deltanet.sparse_attention)


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: the tokenizer's size rounded up to vocab_multiple
    vocab_multiple: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // n_heads
    ffn_hidden: int = 0  # 0: 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 512  # length of the rotary table
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0  # fraction of head_dim that is rotated (Qwen3.5 uses 0.25)
    qk_norm: bool = True
    attn_gate: Literal["elementwise", "headwise", "none"] = "elementwise"
    norm_type: Literal["rmsnorm", "rmsnorm_zero_centered"] = "rmsnorm"
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    # z-loss on the LM head (PaLM): + coef * logsumexp(logits)^2 per counted token, keeping the log-partition
    # near 0 (bf16 logits stay precise); 1e-4 is PaLM's value. 0: off.
    lm_z_loss: float = 0.0
    doc_mask: bool = False  # no attention and no recurrent state across packed documents
    # Mixer per layer: a string repeated to n_layers ("LLLA": three Gated DeltaNet layers per attention
    # layer, the Qwen3-Next ratio), or an explicit per-layer list of letters or Qwen3.5 layer_types names.
    layer_pattern: str | list[str] = "A"
    deltanet: DeltaNetConfig = field(default_factory=DeltaNetConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    ffn: StructuredFFNConfig = field(default_factory=StructuredFFNConfig)
    scale: ScaleVectorConfig = field(default_factory=ScaleVectorConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def resolved_ffn_hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return int(math.ceil(8 * self.d_model / 3 / 64) * 64)

    def layer_types(self) -> list[str]:
        """One letter per layer, 'A' (gated attention) or 'L' (Gated DeltaNet); see `validate` for errors."""
        full = {v: k for k, v in MIXER_NAMES.items()}
        if isinstance(self.layer_pattern, str):
            letters = list(self.layer_pattern)
            if letters and len(letters) != self.n_layers and self.n_layers % len(letters) == 0:
                letters = letters * (self.n_layers // len(letters))
        else:
            letters = [full.get(x, x) for x in self.layer_pattern]
        return letters

    def resolve_vocab(self, tokenizer_vocab: int) -> int:
        """The embedding size for a tokenizer of ``tokenizer_vocab`` ids."""
        if self.vocab_size:
            if self.vocab_size < tokenizer_vocab:
                raise ConfigError(
                    f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids; "
                    f"set it to at least {tokenizer_vocab} or to 0 (derive from the tokenizer)"
                )
            return self.vocab_size
        m = self.vocab_multiple
        return (tokenizer_vocab + m - 1) // m * m

    def _validate_pattern(self) -> None:
        allowed = sorted(MIXER_NAMES) + sorted(MIXER_NAMES.values())
        p = self.layer_pattern
        if isinstance(p, str):
            if not p:
                raise ConfigError("model.layer_pattern is empty; give e.g. 'A' (all attention) or 'LLLA'")
            if len(p) != self.n_layers and self.n_layers % len(p):
                raise ConfigError(
                    f"model.layer_pattern={p!r} has length {len(p)}, which neither equals nor divides "
                    f"model.n_layers={self.n_layers}; give a pattern whose length divides {self.n_layers}"
                )
        elif len(p) != self.n_layers:
            raise ConfigError(
                f"model.layer_pattern lists {len(p)} layers but model.n_layers={self.n_layers}; "
                f"an explicit list names every layer"
            )
        for i, letter in enumerate(self.layer_types()):
            if letter not in MIXER_NAMES:
                raise ConfigError(
                    f"model.layer_pattern: layer {i} has mixer {letter!r}, which is unknown; allowed: {allowed} "
                    f"(A = gated attention, L = Gated DeltaNet)"
                )

    def validate(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "vocab_multiple"):
            v = getattr(self, name)
            if v <= 0:
                raise ConfigError(f"model.{name}={v} must be a positive integer")
        if self.vocab_size < 0 or self.head_dim < 0 or self.ffn_hidden < 0:
            raise ConfigError("model.vocab_size, model.head_dim and model.ffn_hidden must be >= 0 (0 = derived)")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                f"choose n_heads among the divisors of d_model or set model.head_dim explicitly"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}; "
                f"grouped-query attention needs n_heads to be a multiple of n_kv_heads"
            )
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ConfigError(f"model.rotary_fraction={self.rotary_fraction} must be in (0, 1]")
        rot = int(self.resolved_head_dim() * self.rotary_fraction)
        if rot < 2 or rot % 2:
            raise ConfigError(
                f"model.rotary_fraction={self.rotary_fraction} rotates {rot} of head_dim="
                f"{self.resolved_head_dim()} channels; that must be an even number >= 2"
            )
        if self.lm_z_loss < 0:
            raise ConfigError(f"model.lm_z_loss={self.lm_z_loss} must be >= 0 (0 = off)")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("model.rope_theta, model.norm_eps and model.init_std must be positive")
        self._validate_pattern()
        self.deltanet.validate(self)
        self.moe.validate(self)
        self.ffn.validate(self)
        if self.moe.n_experts and self.ffn.kind != "dense":
            # Both replace the same sub-layer; a dense layer under a MoE placement would be structured.
            moe_layers = [i for i in range(self.n_layers) if self.moe.is_moe_layer(i)]
            if len(moe_layers) == self.n_layers:
                raise ConfigError(
                    f"model.ffn.kind={self.ffn.kind} has no layer to act on: model.moe puts experts on every "
                    f"layer; set model.moe.every > 1 or model.moe.layers, or model.ffn.kind=dense"
                )
        if self.scale.any and self.ffn.kind != "dense":
            raise ConfigError(
                f"model.scale.* reparameterises plain projections, and model.ffn.kind={self.ffn.kind} has none "
                f"in its feed-forward; use one of the two per run (model.ffn.kind=dense or all model.scale.* false)"
            )
