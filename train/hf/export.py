"""``hybridtron export``: a checkpoint as a Hugging Face model directory that transformers loads.

Targets, by what the model is:

- ``qwen3_5_text`` (Qwen3_5ForCausalLM): gated attention, with or without Gated DeltaNet layers, dense
  or structured feed-forwards;
- ``qwen3_5_moe_text`` (Qwen3_5MoeForCausalLM): the same with a MoE on every layer, each with a shared
  expert, softmax router and renormalised top-k;
- ``qwen3`` (Qwen3ForCausalLM): ungated attention-only models with QK-norm; ``llama`` without QK-norm;
- ``hybridtron`` (HybridtronForCausalLM, custom code): a ``qwen3_5_text`` model whose Gated DeltaNet
  layers have what Qwen3.5 lacks, negative eigenvalues (beta in (0, 2)) or DeltaProduct. The directory
  then also holds ``configuration_hybridtron.py`` and ``modeling_hybridtron.py`` (train/hf/export_custom/,
  Qwen3.5's classes with the mixer replaced; torch and transformers only) with ``auto_map`` entries in
  config.json, and loads with ``trust_remote_code=True``. Weight names are those of ``qwen3_5_text``.

Exact folds on the way (each a linear-algebra identity, listed in the report): scale vectors into the
plain weights (`fold_scale_vectors`), structured FFN factors (and a live self-guided dense guide) into
one matrix (`dense_state_dict`), a headwise gate expanded to Qwen3.5's elementwise gate rows inside
q_proj, and norm gains written in the target's convention (Qwen3.5 stores ``w`` of ``1 + w``; Qwen3 and
Llama the gain itself). What no target expresses is refused by name with the way out: MoE layouts
Qwen3.5-MoE cannot express, negative eigenvalues or DeltaProduct together with MoE, ungated attention
in a hybrid.

The weights go through the transformers class itself (``load_state_dict(strict=True)`` on a model built
from the written config, then ``save_pretrained``, which shards above ``max_shard_size`` and writes the
index), so a layout mismatch is an error here, not a silent difference later. The export then loads the
result with ``AutoModelForCausalLM`` (the custom code from the written directory) and measures the
largest logit difference against our model on random tokens; everything is written to a temporary
directory and renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybridtron.configs import ConfigError, JobConfig, ModelConfig, load_config
from hybridtron.data_pipeline import load_tokenizer
from hybridtron.model import GatedLM, fold_scale_vectors

from ..checkpoint import honour_umask

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

    def lines(self) -> list[str]:
        out = [f"target: {self.target} ({self.architecture}), {self.params / 1e6:.2f}M parameters"]
        if self.custom_code:
            out.append(f"custom code: transformers has no class for {' and '.join(self.custom_code)}, so the "
                       f"directory carries configuration_hybridtron.py and modeling_hybridtron.py (torch and "
                       f"transformers only); load it with AutoModelForCausalLM.from_pretrained(DIR, "
                       f"trust_remote_code=True)")
        out.append("folded: " + ("; ".join(self.folded) if self.folded else "nothing (plain layout)"))
        if self.max_logit_diff is not None:
            out.append(f"parity: max |logit difference| vs hybridtron = {self.max_logit_diff:.2e} (float32, "
                       f"random tokens; tolerance {PARITY_TOLERANCE:.0e})")
        return out


# ---- what can go where -------------------------------------------------------------------------------
def custom_features(cfg: ModelConfig) -> list[str]:
    """The Gated DeltaNet options Qwen3.5 has no counterpart for (exported with custom code)."""
    d = cfg.deltanet
    if "L" not in cfg.layer_types():
        return []  # the options act on delta-rule layers only: an attention-only model ignores them
    return (["model.deltanet.neg_eigval=true (beta in (0, 2))"] if d.neg_eigval else []) + (
        [f"model.deltanet.n_householder={d.n_householder} (DeltaProduct)"] if d.n_householder > 1 else [])


def choose_target(cfg: ModelConfig) -> str:
    """The transformers model_type for this config, or ExportError naming what has no equivalent."""
    m = cfg.moe
    types = cfg.layer_types()
    if "L" in types and cfg.deltanet.sparse_attention != "none":
        raise ExportError(f"model.deltanet.sparse_attention={cfg.deltanet.sparse_attention} cannot be exported yet: "
                          f"transformers has no such mixer and the custom-code export does not carry the sparse "
                          f"attention branch (model/hax.py) with its key selection and cache; use the checkpoint with "
                          f"hybridtron (sample, eval) or train without model.deltanet.sparse_attention")
    custom = custom_features(cfg)
    if custom and m.n_experts:
        raise ExportError(f"{' and '.join(custom)} with MoE layers cannot be exported yet: the custom-code export "
                          f"(trust_remote_code) covers Qwen3.5-style dense or structured feed-forwards only; export a "
                          f"model without model.moe, or one trained without these Gated DeltaNet options")
    if m.n_experts:
        moe_layers = [i for i in range(cfg.n_layers) if m.is_moe_layer(i)]
        problems = []
        if len(moe_layers) != cfg.n_layers:
            problems.append(f"MoE on layers {moe_layers} only (qwen3_5_moe puts experts on every layer)")
        if not m.shared_expert_hidden:
            problems.append("no shared expert (model.moe.shared_expert_hidden=0)")
        if m.router != "softmax" or not m.norm_topk_prob:
            problems.append(f"router={m.router}, norm_topk_prob={m.norm_topk_prob} (qwen3_5_moe: softmax, renormalised)")
        if m.bias_update_rate:
            problems.append("auxiliary-loss-free router biases (model.moe.bias_update_rate > 0) change the expert choice")
        if problems:
            raise ExportError("this MoE cannot be expressed as transformers' qwen3_5_moe: " + "; ".join(problems))
    if cfg.attn_gate == "none" and "L" not in types and not m.n_experts:
        return "qwen3" if cfg.qk_norm else "llama"
    if cfg.attn_gate == "none":
        raise ExportError("model.attn_gate=none with Gated DeltaNet or MoE layers: transformers' Qwen3.5 always gates "
                          "attention; train with model.attn_gate=elementwise or headwise")
    if not cfg.qk_norm:
        raise ExportError("model.qk_norm=false with gated attention: transformers' Qwen3.5 always has QK-norm")
    if custom:
        return "hybridtron"
    return "qwen3_5_moe_text" if m.n_experts else "qwen3_5_text"


ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "hybridtron": "HybridtronForCausalLM"}
CUSTOM_TARGETS = ("hybridtron",)  # written with our modeling code: loading needs trust_remote_code=True
QWEN35_LAYOUT = ("qwen3_5_text", "qwen3_5_moe_text", "hybridtron")  # Qwen3.5 names and norm convention




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
        from .export_custom.configuration_hybridtron import HybridtronConfig

        hf = HybridtronConfig(**common, **qwen, linear_allow_neg_eigval=cfg.deltanet.neg_eigval,
                        linear_num_householder=cfg.deltanet.n_householder)
        hf.auto_map = {"AutoConfig": "configuration_hybridtron.HybridtronConfig",
                       "AutoModelForCausalLM": "modeling_hybridtron.HybridtronForCausalLM"}
        return hf
    m = cfg.moe
    return transformers.Qwen3_5MoeTextConfig(
        **common, **qwen, moe_intermediate_size=m.expert_hidden or cfg.resolved_ffn_hidden(),
        shared_expert_intermediate_size=m.shared_expert_hidden, num_experts=m.n_experts,
        num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef,
    )


# ---- weights ---------------------------------------------------------------------------------------------
def plain_state(model: GatedLM) -> tuple[dict[str, torch.Tensor], ModelConfig, list[str]]:
    """Our state dict with every reparameterisation folded: (state, the plain config it loads into, folds)."""
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
    for k in [k for k in state if k.endswith(".expert_bias")]:
        if state[k].abs().max() > 0:  # choose_target refused bias updates; a nonzero bias would change routing
            raise ExportError(f"{k} is nonzero: the router bias has no place in transformers' Qwen3.5-MoE")
        del state[k]
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
    return out


# ---- the export --------------------------------------------------------------------------------------
def load_for_export(ckpt: Path) -> tuple[JobConfig, GatedLM]:
    """The checkpoint's model exactly as ``sample`` and ``eval`` load it (train/build.py: the self-guided
    guide as saved, the mix weight of the checkpoint's step), in float32 on the CPU."""
    from ..build import load_for_inference

    cfg, model, _tok, _device = load_for_inference(ckpt, [("train.device", "cpu")])
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
def parity(model: GatedLM, hf_dir: Path, vocab: int, seed: int = 0, trust_remote_code: bool = False) -> float:
    """Largest |logit difference| between ``model`` and the directory as transformers loads it (the custom
    code, if any, is the copy in ``hf_dir``)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    if trust_remote_code:
        drop_remote_code_copy(type(hf))
    x = torch.randint(0, vocab, (2, min(64, model.cfg.max_seq_len)), generator=torch.Generator().manual_seed(seed))
    return float((hf(x).logits - model(x)).abs().max())


def drop_remote_code_copy(cls: type) -> None:
    """transformers imports remote code from a copy in its modules cache (``transformers_modules/<directory
    name>/<hash>/``, under ~/.cache/huggingface by default). The copy made for the export's temporary
    directory would stay there for good, one per export; remove it once the class is imported. Only a
    folder holding nothing but our two files is removed."""
    import inspect

    from .export_custom import FILES

    named = Path(inspect.getfile(cls)).parent.parent  # transformers_modules/<directory name>
    if named.parent.name == "transformers_modules" and {f.name for f in named.rglob("*.py")} <= {"__init__.py", *FILES}:
        shutil.rmtree(named, ignore_errors=True)


def export(ckpt: Path, out: Path, *, max_shard_size: str = "5GB", check: bool = True, log=print) -> ExportReport:
    """Write the Hugging Face directory ``out`` for checkpoint directory ``ckpt`` (see the module docstring)."""
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory (nothing was written)")
    cfg = load_config(str(ckpt / "config.yaml"))
    choose_target(cfg.model)  # refuse before loading any weights
    _cfg, model = load_for_export(ckpt)
    return export_model(model, ckpt / "tokenizer", out, max_shard_size=max_shard_size, check=check, log=log,
                        source=str(ckpt))


def export_model(model: GatedLM, tokenizer_dir: Path, out: Path, *, max_shard_size: str = "5GB", check: bool = True,
                 log=print, source: str = "") -> ExportReport:
    """Export an in-memory model (float32, eval) with the tokenizer saved in ``tokenizer_dir``."""
    import transformers

    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory (nothing was written)")
    target = choose_target(model.cfg)
    state, plain_cfg, folded = plain_state(model)
    hf_cfg = hf_config(plain_cfg, model.vocab_size, target, load_tokenizer(tokenizer_dir))
    hf_cfg.architectures = [ARCHITECTURES[target]]
    hf_state = to_hf_names(state, plain_cfg, target)
    if plain_cfg.tie_embeddings:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    custom = target in CUSTOM_TARGETS
    with torch.device("meta"):
        if custom:
            from .export_custom.modeling_hybridtron import HybridtronForCausalLM

            hf_model = HybridtronForCausalLM(hf_cfg)
        else:
            hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_model.load_state_dict(hf_state, strict=True, assign=True)
    if plain_cfg.tie_embeddings:
        hf_model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf_model.save_pretrained(tmp, max_shard_size=max_shard_size)
        for f in tmp.glob("*.safetensors"):
            honour_umask(f)
        if custom:
            from .export_custom import FILES, HERE

            for name in FILES:
                shutil.copyfile(HERE / name, tmp / name)
        export_tokenizer(tokenizer_dir, tmp)
        report = ExportReport(target, ARCHITECTURES[target], model.num_params(), folded,
                              custom_code=custom_features(model.cfg))  # [] for every native target
        if check:
            report.max_logit_diff = parity(model, tmp, model.vocab_size, trust_remote_code=custom)
            if not report.max_logit_diff <= PARITY_TOLERANCE:
                raise ExportError(f"exported model differs from the checkpoint: max |logit difference| "
                                  f"{report.max_logit_diff:.2e} > {PARITY_TOLERANCE:.0e}; nothing was written to {out}")
        (tmp / "hybridtron_export.json").write_text(json.dumps(
            {"source": source, "target": target, "custom_code": report.custom_code, "folded": folded,
             "max_logit_diff": report.max_logit_diff}, indent=1))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.out_dir = out
    for line in report.lines():
        log(line)
    return report


def resolve_checkpoint(path: Path) -> Path:
    """A run directory (its latest checkpoint) or a checkpoint directory, of one process or sharded (``dcp/``,
    loaded whole on this one CPU process whatever layout wrote it)."""
    from ..checkpoint import DEEPSPEED, SHARDED, CheckpointManager

    if (path / "config.yaml").is_file() and ((path / "model.safetensors").is_file() or (path / SHARDED).is_dir()
                                             or (path / DEEPSPEED).is_dir()):
        return path
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise ExportError(f"{path} is neither a checkpoint directory nor a run directory with checkpoints; "
                          f"pass RUN_DIR or RUN_DIR/checkpoints/step_N")
    return latest
