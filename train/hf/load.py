"""``hybridtron train --init-from hf:DIR``: continued pretraining from a local Hugging Face checkpoint.

The inverse of ``train/hf/export.py`` for the architectures it writes: ``qwen3_5_text`` / ``qwen3_5``
(Qwen3.5 dense and hybrid), ``qwen3_5_moe_text`` / ``qwen3_5_moe``, ``qwen3_next``, ``qwen3``, ``llama`` and
``hybridtron`` (our custom-code export: Qwen3.5 plus negative eigenvalues / DeltaProduct / HAX sparse
attention and MoE with our router options, read from its config.json; its Python files are never run here). The HF config becomes the model section (norms in
the target's own convention, so every tensor is copied bit for bit and an export of the imported model
reproduces the files' tensors exactly); the directory's ``tokenizer.json`` becomes the run's tokenizer
(``data.tokenizer.kind=pretrained``). Training settings that HF configs do not carry (document
masking, chunk sizes, MoE loss weights, HAX's ranking loss weight) stay as configured.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from hybridtron.configs import ConfigError, DeltaNetConfig, JobConfig, ModelConfig, MoEConfig

SUPPORTED = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "qwen3", "llama", "hybridtron")


class HFImportError(ConfigError):
    """A Hugging Face directory that cannot become a hybridtron model; the message says why."""


def read_hf_config(hf_dir: Path) -> dict:
    f = hf_dir / "config.json"
    if not f.is_file():
        raise HFImportError(f"--init-from hf:{hf_dir}: no config.json there; point at a Hugging Face model directory")
    try:
        raw = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFImportError(f"{f} is not valid JSON ({e}); re-download or re-export the model") from None
    if raw.get("model_type") in ("qwen3_5", "qwen3_5_moe") and "text_config" in raw:
        raw = {**raw["text_config"], "tie_word_embeddings": raw.get("tie_word_embeddings", False)}
    if raw.get("model_type") not in SUPPORTED:
        raise HFImportError(f"{f}: model_type {raw.get('model_type')!r} is not supported; supported: {SUPPORTED}")
    return raw


def model_config_from_hf(raw: dict, base: ModelConfig) -> ModelConfig:
    """The model section for HF config ``raw``; fields HF does not describe are taken from ``base``."""
    mt = raw["model_type"]
    # hybridtron: Qwen3.5 plus delta-rule and MoE options; Qwen3-Next: Qwen3.5's layers, fused DeltaNet projections
    qwen35 = mt.startswith("qwen3_5") or mt in ("hybridtron", "qwen3_next")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise HFImportError(f"rope_type {rope.get('rope_type')!r} is not supported (plain rotary only)")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    cfg = replace(
        base,
        vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_layers=raw["num_hidden_layers"],
        n_heads=raw["num_attention_heads"], n_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=head_dim, ffn_hidden=raw["intermediate_size"],
        max_seq_len=max(base.max_seq_len, 16), rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1e4))),
        rotary_fraction=float(rope.get("partial_rotary_factor", 1.0)), norm_eps=float(raw["rms_norm_eps"]),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=float(raw.get("initializer_range", base.init_std)),
        qk_norm=mt != "llama", attn_gate="elementwise" if qwen35 else "none",
        norm_type="rmsnorm_zero_centered" if qwen35 else "rmsnorm",
        layer_pattern=[{"full_attention": "A", "linear_attention": "L"}[t] for t in raw["layer_types"]]
        if qwen35 else "A",
    )
    if qwen35:
        cfg = replace(cfg, deltanet=replace(
            base.deltanet if isinstance(base.deltanet, DeltaNetConfig) else DeltaNetConfig(),
            n_k_heads=raw["linear_num_key_heads"], n_v_heads=raw["linear_num_value_heads"],
            k_head_dim=raw["linear_key_head_dim"], v_head_dim=raw["linear_value_head_dim"],
            conv_size=raw["linear_conv_kernel_dim"], neg_eigval=bool(raw.get("linear_allow_neg_eigval", False)),
            n_householder=int(raw.get("linear_num_householder", 1)), **sparse_attention_from_hf(raw)))
    if mt.startswith("qwen3_5_moe"):
        cfg = replace(cfg, moe=replace(
            base.moe if base.moe.n_experts else MoEConfig(), n_experts=raw["num_experts"],
            top_k=raw["num_experts_per_tok"], expert_hidden=raw["moe_intermediate_size"],
            shared_expert_hidden=raw["shared_expert_intermediate_size"], router="softmax", norm_topk_prob=True,
            bias_update_rate=0.0, every=1, layers=[]))
    elif mt == "qwen3_next" and raw.get("num_experts"):
        n, step, dense = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
        moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        cfg = replace(cfg, moe=replace(
            base.moe if base.moe.n_experts else MoEConfig(), n_experts=raw["num_experts"],
            top_k=raw["num_experts_per_tok"], expert_hidden=raw["moe_intermediate_size"],
            shared_expert_hidden=raw["shared_expert_intermediate_size"], router="softmax",
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)), bias_update_rate=0.0, every=1,
            layers=moe if len(moe) != n else []))
    elif mt == "hybridtron" and raw.get("num_experts"):
        n, dense = raw["num_hidden_layers"], set(raw.get("mlp_only_layers") or [])
        cfg = replace(cfg, moe=replace(
            base.moe if base.moe.n_experts else MoEConfig(), n_experts=raw["num_experts"],
            top_k=raw["num_experts_per_tok"], expert_hidden=raw["moe_intermediate_size"],
            shared_expert_hidden=raw.get("shared_expert_intermediate_size", 0), router=raw.get("moe_router", "softmax"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            bias_update_rate=float(raw.get("moe_router_bias_update_rate", 0.0)), every=1,
            layers=[i for i in range(n) if i not in dense] if dense else []))
    else:
        cfg = replace(cfg, moe=replace(cfg.moe, n_experts=0))
    cfg = replace(cfg, ffn=replace(cfg.ffn, kind="dense"),
                  scale=replace(cfg.scale, branch_specific=False, two_sided=False, magnitude_direction=False))
    cfg.validate()
    return cfg


def sparse_attention_from_hf(raw: dict) -> dict:
    """model.deltanet's HAX fields for a ``hybridtron`` export's ``linear_sparse_*`` (the ranking loss weight is
    a training setting and stays as configured); none for every other config."""
    kind = raw.get("linear_sparse_attention") or "none"
    if kind == "none":
        return {"sparse_attention": "none"}
    from hybridtron.model.hax import SOURCES

    if kind not in SOURCES:
        raise HFImportError(f"linear_sparse_attention={kind!r} in config.json is not one of {', '.join(SOURCES)}; "
                            f"re-export the model")
    # (defaults: HybridtronConfig's, for a config.json written without them)
    return {"sparse_attention": kind, "sparse_keys": int(raw.get("linear_sparse_keys", 64)),
            "sparse_dim": int(raw.get("linear_sparse_dim", 0)), "lsh_bits": int(raw.get("linear_lsh_bits", 8))}


def read_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"--init-from hf:{hf_dir}: no *.safetensors files there (PyTorch .bin is not supported)")
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> ours (drop ``model.``; the norm gains are already in our config's convention)."""
    out = {}
    for k, v in hf_state.items():
        if k.startswith("mtp.") or k.startswith("model.visual."):
            continue
        name = k.removeprefix("model.language_model.").removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        out[name] = v
    return fuse_experts(split_qwen3_next_projections(out, cfg))


def split_qwen3_next_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused Gated DeltaNet projections (``in_proj_qkvz``, ``in_proj_ba``, grouped by key head) ->
    Qwen3.5's four, which the model holds (the inverse of the export's row permutation)."""
    hk, hv, dk, dv = cfg.deltanet.resolved(cfg)
    r = hv // hk
    for name in [k for k in state if k.endswith("linear_attn.in_proj_qkvz.weight")]:
        pre = name.removesuffix("in_proj_qkvz.weight")
        qkvz = state.pop(name)
        d = qkvz.shape[-1]
        q, k, v, z = qkvz.view(hk, 2 * dk + 2 * r * dv, d).split([dk, dk, r * dv, r * dv], dim=1)
        state[pre + "in_proj_qkv.weight"] = torch.cat([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
        state[pre + "in_proj_z.weight"] = z.reshape(-1, d)
        b, a = state.pop(pre + "in_proj_ba.weight").view(hk, 2 * r, d).split([r, r], dim=1)
        state[pre + "in_proj_b.weight"], state[pre + "in_proj_a.weight"] = b.reshape(-1, d), a.reshape(-1, d)
    return state


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3.5-MoE files store experts one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the hub
    layout transformers writes on save); the model holds them stacked (``gate_up_proj`` (E, 2I, d) with
    gate rows first, ``down_proj`` (E, d, I)). Stack them; the order of e is kept."""
    per_expert = {}
    for k in list(state):
        parts = k.split(".")
        if len(parts) >= 6 and parts[-4] == "experts" and parts[-3].isdigit():
            prefix = ".".join(parts[:-3])
            per_expert.setdefault(prefix, {})[(int(parts[-3]), parts[-2])] = state.pop(k)
    for prefix, mats in per_expert.items():
        n = 1 + max(e for e, _ in mats)
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([mats[(e, "gate_proj")], mats[(e, "up_proj")]]) for e in range(n)])
        state[f"{prefix}.down_proj"] = torch.stack([mats[(e, "down_proj")] for e in range(n)])
    return state


def apply_init_from(cfg: JobConfig, spec: str) -> Path:
    """Point ``cfg`` at the HF model ``spec`` ('hf:DIR'): model section and tokenizer. Returns DIR."""
    if not spec.startswith("hf:"):
        raise HFImportError(f"--init-from {spec!r}: write hf:DIR (a local Hugging Face model directory)")
    hf_dir = Path(spec[3:]).expanduser()
    raw = read_hf_config(hf_dir)
    cfg.model = model_config_from_hf(raw, cfg.model)
    tok = hf_dir / "tokenizer.json"
    if not tok.is_file():
        raise HFImportError(f"--init-from hf:{hf_dir}: no tokenizer.json there; the run trains with the model's tokenizer")
    cfg.data.tokenizer = replace(cfg.data.tokenizer, kind="pretrained", path=str(tok))
    if cfg.data.seq_len > cfg.model.max_seq_len:
        cfg.model.max_seq_len = cfg.data.seq_len
    cfg.validate()
    return hf_dir


@torch.no_grad()
def load_hf_weights(model, hf_dir: Path) -> None:
    state = state_from_hf(read_hf_state(hf_dir), model.cfg)
    own = model.state_dict()
    if any(layer is None for layer in model.layers):  # a pipeline rank's part: the tensors of its stages
        state = {k: v for k, v in state.items() if k in own}
    missing = [k for k in own if k not in state and not k.endswith(".expert_bias")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise HFImportError(f"--init-from hf:{hf_dir}: weights do not match the model its config describes "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise HFImportError(f"--init-from hf:{hf_dir}: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
        own[k].copy_(v)
