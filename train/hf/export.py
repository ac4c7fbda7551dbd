"""``hybridtron export``: a checkpoint as a Hugging Face model directory that transformers loads.

Targets, by what the model is (`choose_target`: a native class wherever one is exact):

- ``qwen3_5_text`` (Qwen3_5ForCausalLM): gated attention (or none, as zero gate rows), with or without
  Gated DeltaNet layers, dense or structured feed-forwards;
- ``qwen3_5_moe_text`` (Qwen3_5MoeForCausalLM): the same with a MoE on every layer, each with a shared
  expert, softmax router and renormalised top-k;
- ``qwen3_next`` (Qwen3NextForCausalLM): the same MoE on some layers only (``mlp_only_layers``) or without
  renormalised top-k (``norm_topk_prob``); its DeltaNet input projections are fused per key head;
- ``qwen3`` (Qwen3ForCausalLM): ungated attention-only models with QK-norm and full rotary; ``llama``
  without QK-norm;
- ``hybridtron`` (HybridtronForCausalLM, custom code): what no transformers class holds (`custom_features`):
  Gated DeltaNet with negative eigenvalues (beta in (0, 2)), DeltaProduct or HAX's sparse attention
  branch (model.deltanet.sparse_attention; its weights keep our names, ``linear_attn.hax.*``); MoE with the
  auxiliary-loss-free router bias, a sigmoid router or no shared expert. The directory then also holds
  ``configuration_hybridtron.py`` and ``modeling_hybridtron.py`` (train/hf/export_custom/, Qwen3.5's
  classes with the mixer and the MoE block replaced; torch and transformers only) with ``auto_map``
  entries in config.json, and loads with ``trust_remote_code=True``. Weight names are Qwen3.5(-MoE)'s.

Exact folds on the way (each a linear-algebra identity, listed in the report): scale vectors into the
plain weights (`fold_scale_vectors`), structured FFN factors (and a live self-guided dense guide) into
one matrix (`dense_state_dict`), a headwise gate expanded to Qwen3.5's elementwise gate rows inside
q_proj, no gate as zero gate rows with o_proj doubled (sigmoid(0) = 1/2), Qwen3-Next's fused DeltaNet
projections (a row permutation), and norm gains written in the target's convention (Qwen3.5 stores ``w``
of ``1 + w``; Qwen3 and Llama the gain itself). What no target expresses exactly is refused in one line
naming the option and the nearest exact setting: QK-norm off with gates, DeltaNet or MoE layers; partial
rotary without QK-norm.

The weights go through the transformers class itself (``load_state_dict(strict=True)`` on a model built
from the written config, then ``save_pretrained``, which shards above ``max_shard_size`` and writes the
index), so a layout mismatch is an error here, not a silent difference later. The export then loads the
result with ``AutoModelForCausalLM`` (the custom code from the written directory) and measures the
largest logit difference against our model on random tokens (full forward and transformers' cached
decoding; for MoE it reports how many experts the batch routed to); everything is written to a temporary
directory and renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from hybridtron.atomic import new_dirs_removed_on_failure, reclaim_scratch, scratch_name
from hybridtron.configs import ConfigError, JobConfig, ModelConfig, load_config
from hybridtron.data_pipeline import load_tokenizer
from hybridtron.model import GatedLM, fold_scale_vectors
from hybridtron.train.checkpoint import honour_umask, is_disk_full
from hybridtron.train.errors import DiskFullError

PARITY_TOLERANCE = 1e-4  # max |logit difference| in float32 that the export accepts


class ExportError(ConfigError):
    """A model or checkpoint that cannot be exported faithfully; the message names the feature."""


@dataclass
class ExportReport:
    target: str
    architecture: str
    params: int
    folded: list[str] = field(default_factory=list)
    max_logit_diff: float | None = None
    out_dir: Path | None = None
    custom_code: list[str] = field(default_factory=list)  # the features that need our modeling code
    experts_chosen: list[int] = field(default_factory=list)  # per MoE layer: distinct experts the check routed to
    why: str = ""  # what made this class the exact choice

    def lines(self) -> list[str]:
        out = [f"target: {self.target} ({self.architecture}), {self.params / 1e6:.2f}M parameters"
               + (f": {self.why}" if self.why else "")]
        if self.custom_code:
            out.append(f"custom code: transformers has no class for {' and '.join(self.custom_code)}, so the "
                       f"directory carries configuration_hybridtron.py and modeling_hybridtron.py (torch and "
                       f"transformers only); load it with AutoModelForCausalLM.from_pretrained(DIR, "
                       f"trust_remote_code=True)")
        out.append("folded: " + ("; ".join(self.folded) if self.folded else "nothing (plain layout)"))
        if self.max_logit_diff is not None:
            out.append(f"parity: max |logit difference| vs hybridtron = {self.max_logit_diff:.2e} (float32, "
                       f"random tokens, full forward and transformers' cached decoding; tolerance "
                       f"{PARITY_TOLERANCE:.0e})" + (f"; MoE routing exercised: {min(self.experts_chosen)}-"
                                                     f"{max(self.experts_chosen)} distinct experts chosen per MoE layer"
                                                     if self.experts_chosen else ""))
        return out


# ---- what can go where -------------------------------------------------------------------------------
def custom_features(cfg: ModelConfig) -> list[str]:
    """What no transformers class holds, so the export writes our custom code: Gated DeltaNet options Qwen3.5
    has no counterpart for, and MoE options neither Qwen3.5-MoE nor Qwen3-Next has. Empty: a native class."""
    d, m = cfg.deltanet, cfg.moe
    out = []
    if "L" in cfg.layer_types():  # the options act on delta-rule layers only: an attention-only model ignores them
        out += (["model.deltanet.neg_eigval=true (beta in (0, 2))"] if d.neg_eigval else []) + (
            [f"model.deltanet.n_householder={d.n_householder} (DeltaProduct)"] if d.n_householder > 1 else []) + (
            [f"model.deltanet.sparse_attention={d.sparse_attention} (HAX sparse attention in the Gated DeltaNet "
             f"mixer)"] if d.sparse_attention != "none" else [])
        if "A" not in cfg.layer_types():
            out.append(f"model.layer_pattern={cfg.layer_pattern} without an attention layer (transformers' Qwen3.5 "
                       f"cannot decode with its cache when no layer is attention)")
    if m.n_experts:
        if m.bias_update_rate:
            out.append("model.moe.bias_update_rate>0 (the auxiliary-loss-free router bias chooses the experts)")
        if m.router != "softmax":
            out.append(f"model.moe.router={m.router}")
        if not m.shared_expert_hidden:
            out.append("model.moe.shared_expert_hidden=0 (MoE without a shared expert)")
    return out


def target_reason(cfg: ModelConfig, target: str) -> str:
    """Why ``target`` is the class for this model (the export prints it with the target)."""
    m = cfg.moe
    if target == "hybridtron":
        return "no transformers class holds the model exactly (see 'custom code' below)"
    if target == "qwen3_next":
        why = ([f"MoE on layers {moe_layers(cfg)} of 0..{cfg.n_layers - 1} only"]
               if len(moe_layers(cfg)) != cfg.n_layers else []) + (["norm_topk_prob=false"] if not m.norm_topk_prob
                                                                      else [])
        return f"{' and '.join(why)}, which Qwen3-Next holds (Qwen3.5-MoE: MoE on every layer, renormalised top-k)"
    if target == "qwen3_5_moe_text":
        return "MoE on every layer, shared expert, softmax router, renormalised top-k"
    if target in ("qwen3", "llama"):
        return "ungated attention only, full rotary, " + ("QK-norm" if target == "qwen3" else "no QK-norm")
    return "attention" + (" and Gated DeltaNet" if "L" in cfg.layer_types() else "") + " with dense feed-forwards"


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layers) if cfg.moe.is_moe_layer(i)]


def choose_target(cfg: ModelConfig) -> str:
    """The transformers model_type for this config, or ExportError naming what has no exact equivalent and the
    nearest option that has one."""
    m = cfg.moe
    types = cfg.layer_types()
    if cfg.attn_gate == "none" and "L" not in types and not m.n_experts:
        if cfg.rotary_fraction == 1.0:
            return "qwen3" if cfg.qk_norm else "llama"
        if not cfg.qk_norm:
            raise ExportError(f"model.rotary_fraction={cfg.rotary_fraction} with model.qk_norm=false cannot be "
                              f"exported exactly: Llama rotates the whole head and Qwen3.5 (partial rotary) always "
                              f"normalises queries and keys; train with rotary_fraction=1 or qk_norm=true")
        # partial rotary: Qwen3.5 with zero gate rows (plain_state)
    if not cfg.qk_norm:
        raise ExportError("model.qk_norm=false with gated attention, Gated DeltaNet or MoE layers cannot be exported "
                          "exactly: every target class for them (Qwen3.5, Qwen3.5-MoE, our custom code) normalises "
                          "queries and keys; train with model.qk_norm=true")
    if custom_features(cfg):
        return "hybridtron"
    if not m.n_experts:
        return "qwen3_5_text"
    # Qwen3.5-MoE: experts on every layer, renormalised top-k. Qwen3-Next also has dense layers between MoE
    # layers (mlp_only_layers) and norm_topk_prob; it is otherwise the same model with fused projections.
    return "qwen3_5_moe_text" if len(moe_layers(cfg)) == cfg.n_layers and m.norm_topk_prob else "qwen3_next"


ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "hybridtron": "HybridtronForCausalLM"}
CUSTOM_TARGETS = ("hybridtron",)  # written with our modeling code: loading needs trust_remote_code=True
# Qwen3.5's attention, gated DeltaNet and norm convention (Qwen3-Next fuses the DeltaNet's input projections)
QWEN35_LAYOUT = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "hybridtron")


def hf_config(cfg: ModelConfig, vocab_size: int, target: str, tok) -> object:
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.resolved_head_dim(),
        intermediate_size=cfg.resolved_ffn_hidden(), max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        initializer_range=cfg.init_std,
    )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if target in ("qwen3", "llama"):
        if cfg.rotary_fraction != 1.0:
            raise ExportError(f"model.rotary_fraction={cfg.rotary_fraction}: {target} rotates the whole head; only "
                              f"Qwen3.5 has partial rotary (use gated attention, or rotary_fraction=1)")
        cls = transformers.Qwen3Config if target == "qwen3" else transformers.LlamaConfig
        return cls(rope_parameters=rope, attention_bias=False, **common)
    hk, hv, dk, dv = cfg.deltanet.resolved(cfg)
    qwen = dict(
        rope_parameters={**rope, "partial_rotary_factor": cfg.rotary_fraction},
        layer_types=[{"A": "full_attention", "L": "linear_attention"}[t] for t in cfg.layer_types()],
        linear_conv_kernel_dim=cfg.deltanet.conv_size, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_num_key_heads=hk, linear_num_value_heads=hv,
    )
    if target == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig(**common, **qwen)
    if target == "hybridtron":  # train/hf/export_custom/: the very files written next to the weights
        from hybridtron.train.hf.export_custom.configuration_hybridtron import HybridtronConfig

        m = cfg.moe
        moe = dict(
            num_experts=m.n_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_hidden or
            cfg.resolved_ffn_hidden(), shared_expert_intermediate_size=m.shared_expert_hidden, moe_router=m.router,
            norm_topk_prob=m.norm_topk_prob, moe_router_bias_update_rate=m.bias_update_rate,
            router_aux_loss_coef=m.aux_loss_coef,
            mlp_only_layers=[i for i in range(cfg.n_layers) if not m.is_moe_layer(i)]) if m.n_experts else {}
        d = cfg.deltanet
        sparse = dict(linear_sparse_attention=d.sparse_attention, linear_sparse_keys=d.sparse_keys,
                      linear_sparse_dim=d.sparse_dim or dk, linear_lsh_bits=d.lsh_bits) if (
            d.sparse_attention != "none" and "L" in cfg.layer_types()) else {}
        hf = HybridtronConfig(**common, **qwen, linear_allow_neg_eigval=d.neg_eigval,
                              linear_num_householder=d.n_householder, **sparse, **moe)
        hf.auto_map = {"AutoConfig": "configuration_hybridtron.HybridtronConfig",
                       "AutoModelForCausalLM": "modeling_hybridtron.HybridtronForCausalLM"}
        return hf
    m = cfg.moe
    if target == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **common, **qwen, moe_intermediate_size=m.expert_hidden or cfg.resolved_ffn_hidden(),
            shared_expert_intermediate_size=m.shared_expert_hidden, num_experts=m.n_experts,
            num_experts_per_tok=m.top_k, norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.aux_loss_coef,
            decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if not m.is_moe_layer(i)])
    return transformers.Qwen3_5MoeTextConfig(
        **common, **qwen, moe_intermediate_size=m.expert_hidden or cfg.resolved_ffn_hidden(),
        shared_expert_intermediate_size=m.shared_expert_hidden, num_experts=m.n_experts,
        num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef,
    )


# ---- weights ---------------------------------------------------------------------------------------------
def plain_state(model: GatedLM, target: str) -> tuple[dict[str, torch.Tensor], ModelConfig, list[str]]:
    """Our state dict with every reparameterisation ``target`` lacks folded: (state, the plain config it loads
    into, folds)."""
    cfg, folded = model.cfg, []
    if cfg.scale.any:
        state = fold_scale_vectors(model)
        on = [k for k in ("branch_specific", "two_sided", "magnitude_direction") if getattr(cfg.scale, k)]
        folded.append(f"scale vectors ({', '.join(on)}) into norm and projection weights")
        cfg = replace(cfg, scale=replace(cfg.scale, branch_specific=False, two_sided=False, magnitude_direction=False))
    elif cfg.ffn.kind != "dense":
        from hybridtron.model.structured_ffn import dense_state_dict

        state = dense_state_dict(model)
        folded.append(f"{cfg.ffn.kind} FFN factors pre-multiplied into dense gate/up/down_proj")
        cfg = replace(cfg, ffn=replace(cfg.ffn, kind="dense", self_guided=False))
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    keep_bias = target in CUSTOM_TARGETS and cfg.moe.bias_update_rate > 0  # our MoE block chooses with it
    for k in [k for k in state if k.endswith(".expert_bias") and not keep_bias]:
        if state[k].abs().max() > 0 and cfg.moe.bias_update_rate:  # unused without bias updates
            raise ExportError(f"{k} is nonzero: the router bias has no place in {target}")
        del state[k]
    if cfg.attn_gate == "none" and target in QWEN35_LAYOUT:
        H, D = cfg.n_heads, cfg.resolved_head_dim()
        for k in [k for k in state if k.endswith("self_attn.q_proj.weight")]:
            q = state[k].view(H, D, -1)  # zero gate rows: sigmoid(0) = 1/2 on every channel, undone by o_proj x 2
            state[k] = torch.cat([q, torch.zeros_like(q)], dim=1).reshape(2 * H * D, -1)
            o = k.replace("q_proj", "o_proj")
            state[o] = state[o] * 2.0
        folded.append("ungated attention as zero gate rows in q_proj (sigmoid(0) = 1/2) and o_proj x 2 (exact: "
                      "powers of two)")
        cfg = replace(cfg, attn_gate="elementwise")
    if cfg.attn_gate == "headwise":
        H, D = cfg.n_heads, cfg.resolved_head_dim()
        for k in [k for k in state if k.endswith("self_attn.gate_proj.weight")]:
            g = state.pop(k)  # (H, d): one gate per head -> the same row for each of the head's D channels
            qk = k.replace("gate_proj", "q_proj")
            q = state[qk].view(H, D, -1)
            state[qk] = torch.cat([q, g[:, None, :].expand(H, D, g.shape[-1])], dim=1).reshape(2 * H * D, -1)
        folded.append("headwise attention gates expanded to elementwise gate rows in q_proj")
        cfg = replace(cfg, attn_gate="elementwise")
    return state, cfg, folded


ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def to_hf_names(state: dict[str, torch.Tensor], cfg: ModelConfig, target: str) -> dict[str, torch.Tensor]:
    """Prefix with ``model.`` (lm_head stays top level) and convert norm gains to the target's convention."""
    qwen35 = target in QWEN35_LAYOUT
    ours_zero = cfg.norm_type == "rmsnorm_zero_centered"
    out = {}
    for k, v in state.items():
        if k.endswith(ZERO_CENTRED_NORMS) or k == "norm.weight":  # block, QK and final norms (not the GDN's)
            if qwen35 and not ours_zero:
                v = v - 1.0  # gain g -> w with g = 1 + w
            elif not qwen35 and ours_zero:
                v = v + 1.0
        out[k if k.startswith("lm_head.") else f"model.{k}"] = v.contiguous()
    if target == "qwen3_next":
        out = fuse_qwen3_next_projections(out, cfg)
    return out


def fuse_qwen3_next_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3.5's four Gated DeltaNet input projections -> Qwen3-Next's two, grouped by key head: ``in_proj_qkvz``
    holds per key head g [q_g | k_g | v of its r = Hv/Hk value heads | z of them], ``in_proj_ba`` per key head
    [b of its value heads | a of them] (a row permutation: exact). The conv1d keeps Qwen3.5's [q | k | v] order."""
    hk, hv, dk, dv = cfg.deltanet.resolved(cfg)
    r = hv // hk
    for qkv_name in [k for k in state if k.endswith("linear_attn.in_proj_qkv.weight")]:
        pre = qkv_name.removesuffix("in_proj_qkv.weight")
        qkv = state.pop(qkv_name)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv])
        z = state.pop(pre + "in_proj_z.weight")
        b, a = state.pop(pre + "in_proj_b.weight"), state.pop(pre + "in_proj_a.weight")
        d = qkv.shape[-1]
        state[pre + "in_proj_qkvz.weight"] = torch.cat(
            [q.view(hk, dk, d), k.view(hk, dk, d), v.view(hk, r * dv, d), z.view(hk, r * dv, d)], dim=1).reshape(-1, d)
        state[pre + "in_proj_ba.weight"] = torch.cat([b.view(hk, r, d), a.view(hk, r, d)], dim=1).reshape(-1, d)
    return state


# ---- the export --------------------------------------------------------------------------------------
def reference_kernels(cfg: JobConfig) -> list[tuple[str, str]]:
    """Overrides that put every kernel choice of the run on the pure-torch reference: a run trained on a GPU
    with an explicit ``model.kernels.<op>`` (triton, fla, flash-attn, ...) or ``model.moe.backend=megablocks``
    names backends the CPU cannot run, and the export computes in float32 on the CPU anyway. The kernels
    change neither the parameters nor their layout, only how they are computed."""
    out = [(f"model.kernels.{f.name}", "reference") for f in fields(cfg.model.kernels)
           if getattr(cfg.model.kernels, f.name) not in ("auto", "reference")]
    if cfg.model.moe.backend != "native":
        out.append(("model.moe.backend", "native"))
    return out


def load_for_export(ckpt: Path, cfg: JobConfig, log=print) -> tuple[JobConfig, GatedLM]:
    """The checkpoint's model exactly as ``sample`` and ``eval`` load it (train/build.py: the self-guided
    guide as saved, the mix weight of the checkpoint's step), in float32 on the CPU with the reference kernels
    whatever backends the run chose (`reference_kernels`; logged when that changes any). ``cfg``: the
    checkpoint's config."""
    from hybridtron.train.build import load_for_inference

    changed = reference_kernels(cfg)
    if changed:
        log("export computes with the pure-torch reference on the CPU: " + ", ".join(
            f"{k}={v}" for k, v in changed) + " (the run's kernel choices do not change the weights)")
    cfg, model, _tok, _device = load_for_inference(ckpt, [("train.device", "cpu"), *changed])
    return cfg, model.float().eval()


def export_tokenizer(tok_dir: Path, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(tok_dir)
    if tok.kind != "hf":
        raise ExportError(f"tokenizer in {tok_dir} is a SentencePiece model; export supports HF tokenizers "
                          f"(data.tokenizer.kind=bpe) for now")
    names = {i: tok._hf.id_to_token(i) for i in (tok.bos_id, tok.eos_id, tok.pad_id)}
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token=names[tok.bos_id], eos_token=names[tok.eos_id],
        pad_token=names[tok.pad_id], split_special_tokens=True, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)


@torch.no_grad()
def parity(model: GatedLM, hf_dir: Path, vocab: int, seed: int = 0, trust_remote_code: bool = False) -> dict:
    """Largest |logit difference| between ``model`` and the directory as transformers loads it (the custom code,
    if any, is the copy in ``hf_dir``) on random tokens: the full forward, and transformers' cached decoding (a
    prompt, single tokens, then a multi-token continuation, through its own cache) against our full forward.
    Also how many distinct experts each MoE layer chose on that batch (the routing the check exercised)."""
    from transformers import AutoModelForCausalLM

    from hybridtron.model.moe import MoE
    from hybridtron.train.hf.torch_paths import import_with_torch_paths

    import_with_torch_paths()  # a CPU check: transformers' torch paths, not fla's or causal-conv1d's GPU kernels
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    if trust_remote_code:
        drop_remote_code_copy(type(hf))
    T = min(64, model.cfg.max_seq_len)
    x = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))
    chosen: list[int] = []
    hooks = [m.register_forward_hook(lambda m, inp, _out: chosen.append(
        int(m.route(inp[0].reshape(-1, inp[0].shape[-1]))[3].unique().numel())))
        for m in model.modules() if isinstance(m, MoE)]
    try:
        ref = model(x)
    finally:
        for h in hooks:
            h.remove()
    full = float((hf(x).logits - ref).abs().max())
    h = T // 2
    out = hf(x[:, :h], use_cache=True)
    pieces = [out.logits]
    for t in range(h, min(h + 3, T)):
        out = hf(x[:, t : t + 1], use_cache=True, cache=out.cache)
        pieces.append(out.logits)
    if h + 3 < T:
        pieces.append(hf(x[:, h + 3 :], use_cache=True, cache=out.cache).logits)
    cached = float((torch.cat(pieces, dim=1) - ref).abs().max())
    return {"max_logit_diff": max(full, cached), "full": full, "cached": cached, "experts_chosen": chosen}


def drop_remote_code_copy(cls: type) -> None:
    """transformers imports remote code from a copy in its modules cache (``transformers_modules/<directory
    name>/<hash>/``, under ~/.cache/huggingface by default). The copy made for the export's temporary
    directory would stay there for good, one per export; remove it once the class is imported. Only a
    folder holding nothing but our two files is removed."""
    import inspect

    from hybridtron.train.hf.export_custom import FILES

    named = Path(inspect.getfile(cls)).parent.parent  # transformers_modules/<directory name>
    if named.parent.name == "transformers_modules" and {f.name for f in named.rglob("*.py")} <= {"__init__.py", *FILES}:
        shutil.rmtree(named, ignore_errors=True)


class _Phase:
    """Which file of the export a failed write was writing. Its error often does not say: safetensors' names no file,
    and Python's ``write`` of an open file raises ENOSPC without its name. That file is then the one that appeared or
    changed in the scratch directory since the step began (a writer creates its file before it writes), else the
    step's ``default``."""

    def __init__(self, tmp: Path, default: str):
        self.tmp, self.default, self.before = tmp, default, {}

    def _files(self) -> dict[Path, tuple[int, int]]:
        out = {}
        with contextlib.suppress(OSError):  # (not made yet)
            for p in self.tmp.rglob("*"):
                with contextlib.suppress(OSError):
                    st = p.stat()
                    out[p] = (st.st_mtime_ns, st.st_size)
        return out

    def start(self, default: str) -> None:
        self.default, self.before = default, self._files()

    def failed(self, e: BaseException, out: Path) -> Path:
        """The file that was being written, named as it would be in ``out`` when in the export."""
        for name in (getattr(e, "filename2", None), getattr(e, "filename", None)):  # a copy's destination is 2nd
            if isinstance(name, (str, os.PathLike)) and name:
                p = Path(os.fsdecode(name))
                return out / p.relative_to(self.tmp) if p.is_relative_to(self.tmp) else p
        now = self._files()
        changed = [p for p, st in now.items() if self.before.get(p) != st and p.is_file()]
        if changed:
            return out / max(changed, key=lambda p: now[p]).relative_to(self.tmp)
        return out / (self.default or "")


def export(ckpt: Path, out: Path, *, max_shard_size: str = "5GB", check: bool = True, log=print) -> ExportReport:
    """Write the Hugging Face directory ``out`` for checkpoint directory ``ckpt`` (see the module docstring)."""
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory (nothing was written)")
    cfg = load_config(str(ckpt / "config.yaml"))
    choose_target(cfg.model)  # refuse before loading any weights
    _cfg, model = load_for_export(ckpt, cfg, log=log)
    return export_model(model, ckpt / "tokenizer", out, max_shard_size=max_shard_size, check=check, log=log,
                        source=str(ckpt))


def export_model(model: GatedLM, tokenizer_dir: Path, out: Path, *, max_shard_size: str = "5GB", check: bool = True,
                 log=print, source: str = "") -> ExportReport:
    """Export an in-memory model (float32, eval) with the tokenizer saved in ``tokenizer_dir``."""
    import transformers

    from hybridtron.train.hf.torch_paths import import_with_torch_paths

    # Before transformers builds any Qwen3.5-family class: building one imports its modeling module, which binds
    # fla's and causal-conv1d's kernels whenever they are importable, and those fail on the CPU's tensors.
    import_with_torch_paths()

    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory (nothing was written)")
    target = choose_target(model.cfg)
    state, plain_cfg, folded = plain_state(model, target)
    hf_cfg = hf_config(plain_cfg, model.vocab_size, target, load_tokenizer(tokenizer_dir))
    hf_cfg.architectures = [ARCHITECTURES[target]]
    hf_state = to_hf_names(state, plain_cfg, target)
    if plain_cfg.tie_embeddings:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    custom = target in CUSTOM_TARGETS
    with torch.device("meta"):
        if custom:
            from hybridtron.train.hf.export_custom.modeling_hybridtron import HybridtronForCausalLM

            hf_model = HybridtronForCausalLM(hf_cfg)
        else:
            hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_model.load_state_dict(hf_state, strict=True, assign=True)
    if plain_cfg.tie_embeddings:
        hf_model.tie_weights()
    tmp = scratch_name(out)
    phase = _Phase(tmp, "model.safetensors")  # what is being written, for a full disk's message
    # A failed export leaves no --out behind (it is made by the final rename), nor the parents it made for it (once
    # the finally below has removed tmp from the innermost)
    with new_dirs_removed_on_failure(out.parent):
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # our log lines say what is written and checked
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            reclaim_scratch(out.parent, log=log)  # an export killed midway left its whole directory there
            shutil.rmtree(tmp, ignore_errors=True)
            hf_model.save_pretrained(tmp, max_shard_size=max_shard_size)
            for f in tmp.glob("*.safetensors"):
                honour_umask(f)
            if custom:
                from hybridtron.train.hf.export_custom import FILES, HERE

                for name in FILES:
                    phase.start(name)
                    shutil.copyfile(HERE / name, tmp / name)
            phase.start("tokenizer.json")
            export_tokenizer(tokenizer_dir, tmp)
            phase.start("")
            report = ExportReport(target, ARCHITECTURES[target], model.num_params(), folded,
                                  why=target_reason(model.cfg, target),
                                  custom_code=custom_features(model.cfg))  # [] for every native target
            if check:
                measured = parity(model, tmp, model.vocab_size, trust_remote_code=custom)
                report.max_logit_diff, report.experts_chosen = measured["max_logit_diff"], measured["experts_chosen"]
                if not report.max_logit_diff <= PARITY_TOLERANCE:
                    raise ExportError(f"exported model differs from the checkpoint: max |logit difference| "
                                      f"{report.max_logit_diff:.2e} > {PARITY_TOLERANCE:.0e}; nothing was written to {out}")
            phase.start("hybridtron_export.json")
            (tmp / "hybridtron_export.json").write_text(json.dumps(
                {"source": source, "target": target, "custom_code": report.custom_code, "folded": folded,
                 "max_logit_diff": report.max_logit_diff, "experts_chosen": report.experts_chosen}, indent=1))
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
        except Exception as e:
            if not is_disk_full(e, out.parent if out.parent.exists() else None):
                raise
            file = phase.failed(e, out)
            where = out.parent if file.is_relative_to(out) else file.parent  # the export's files go to out's parent
            raise DiskFullError(f"no space left on device writing {file}; the partial export was removed: free space "
                                f"in {where}, then run the same command again") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if bars:
                transformers.utils.logging.enable_progress_bar()
    report.out_dir = out
    for line in report.lines():
        log(line)
    return report


def resolve_checkpoint(path: Path) -> Path:
    """A run directory (its latest checkpoint) or a checkpoint directory, of one process or sharded (``dcp/``,
    loaded whole on this one CPU process whatever layout wrote it)."""
    from hybridtron.train.checkpoint import DEEPSPEED, SHARDED, CheckpointManager

    if (path / "config.yaml").is_file() and ((path / "model.safetensors").is_file() or (path / SHARDED).is_dir()
                                             or (path / DEEPSPEED).is_dir()):
        return path
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise ExportError(f"{path} is neither a checkpoint directory nor a run directory with checkpoints; "
                          f"pass RUN_DIR or RUN_DIR/checkpoints/step_N")
    return latest
