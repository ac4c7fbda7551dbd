"""The custom-code export (``trust_remote_code=True``): Gated DeltaNet with negative eigenvalues,
DeltaProduct and HAX's sparse attention branch, which transformers' Qwen3.5 lacks. Judged like the native exports, by transformers loading
the directory (the modeling code is the copy written there): logits against ours in float32, greedy
generation through transformers' own ``generate`` and cache against our decoder, transformers' cached
decoding against its own full forward, tokenizer encodings; the directory loads without hybridtron."""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridtron.configs import DeltaNetConfig, ModelConfig, MoEConfig, load_config
from hybridtron.data_pipeline.tokenizer import load_tokenizer
from hybridtron.model import GatedLM
from hybridtron.model.moe import MoE
from hybridtron.train.hf.export import export_model
from hybridtron.train.sample import generate

from .test_export import assert_same_greedy

transformers = pytest.importorskip("transformers", reason="transformers is a dependency; install the project")

V = 320
TEXT = "Grüße aus Köln! 你好，世界。 def f(x):\n    return x ** 2  # ✓"
PROMPT = [5, 17, 42, 8]
SMALL_DN = dict(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=8)


def build(cfg: ModelConfig) -> GatedLM:
    # init_std 0.2: logits far from uniform, so greedy generation is a long non-repeating sequence and a
    # wrong token anywhere shows (at 0.02 every model here repeats one token, with tied embeddings the last
    # one), while the logits (|max| 5 to 11) keep float32 parity at 3.5e-5 or less, inside 1e-4 (at 0.3: 7.5e-5).
    cfg = replace(cfg, init_std=0.2, vocab_size=0)
    torch.manual_seed(0)
    model = GatedLM(cfg, V)
    model.init_weights()
    with torch.no_grad():  # gains, A_log, dt_bias off their initial values: each must be mapped
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for m in model.modules():  # router biases as training leaves them: they change the experts chosen
            if isinstance(m, MoE) and m.bias_update_rate:
                m.expert_bias.copy_(torch.randn(m.n_experts) * 0.5)
    return model.eval()


def tiny_deltaproduct() -> ModelConfig:
    """The model section of configs/tiny_deltaproduct.yaml: LLLA, neg_eigval, n_h = 2, chunk 32."""
    return load_config("tiny_deltaproduct").model


HAX_KINDS = ("hax", "lsh", "key_selection", "window")


def small_hax(kind: str) -> ModelConfig:
    """HAX with a budget of 8 keys and 8 buckets, so that the checks' 32 to 64 tokens choose among keys (the
    preset's 64 keys would take all of them); with "lsh", DeltaProduct too (the branch reads the values of the
    first of the two delta steps)."""
    return ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
                       layer_pattern="LA", deltanet=DeltaNetConfig(**SMALL_DN, sparse_attention=kind, sparse_keys=8,
                                                                   lsh_bits=3, n_householder=2 if kind == "lsh" else 1))


CASES = {
    "neg_eigval_hybrid": lambda: ModelConfig(
        d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="LLA",
        norm_type="rmsnorm_zero_centered", rotary_fraction=0.25,
        deltanet=DeltaNetConfig(**SMALL_DN, neg_eigval=True, chunk_size=16)),
    "tiny_deltaproduct": tiny_deltaproduct,
    # MoE with what no transformers class holds: the router bias (on layers 1 and 3 only, no renormalisation),
    # a sigmoid router without a shared expert, DeltaProduct together with MoE; and the tiny_moe preset.
    "moe_router_bias_partial": lambda: ModelConfig(
        d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="LA",
        deltanet=DeltaNetConfig(**SMALL_DN), moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=24,
                                                           shared_expert_hidden=16, every=2, norm_topk_prob=False,
                                                           bias_update_rate=0.01)),
    "moe_sigmoid_no_shared_gate_none": lambda: ModelConfig(
        d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="LA",
        attn_gate="none", deltanet=DeltaNetConfig(**SMALL_DN),
        moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=24, router="sigmoid")),
    "deltaproduct_moe": lambda: ModelConfig(
        d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="LA",
        deltanet=DeltaNetConfig(**SMALL_DN, n_householder=2),
        moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32, shared_expert_hidden=16)),
    "tiny_moe": lambda: load_config("tiny_moe").model,
    "deltaproduct3_untied_headwise": lambda: ModelConfig(
        d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="LA",
        tie_embeddings=False, attn_gate="headwise", deltanet=DeltaNetConfig(**SMALL_DN, n_householder=3)),
    # HAX (model/hax.py): the tiny_hax preset (Gated DeltaNet only: transformers' Qwen3.5 cannot decode with a
    # cache without an attention layer, our text model can) and each kind of the branch on a small model.
    "tiny_hax": lambda: load_config("tiny_hax").model,
    "gdn_only": lambda: ModelConfig(  # no attention layer: Qwen3.5's text model cannot decode it with a cache
        d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64, layer_pattern="L",
        deltanet=DeltaNetConfig(**SMALL_DN)),
    **{f"hax_{kind}": functools.partial(small_hax, kind) for kind in HAX_KINDS},
}


def export_case(case: str, tok_dir: Path, out: Path, log=lambda _: None):
    model = build(CASES[case]())
    return model, export_model(model, tok_dir, out, log=log)


def remote_code_copies() -> set[str]:
    """The folders in transformers' modules cache (one per directory loaded with remote code)."""
    from transformers.dynamic_module_utils import HF_MODULES_CACHE

    return {p.name for p in (Path(HF_MODULES_CACHE) / "transformers_modules").glob("*") if p.is_dir()}


def import_roots(path: Path) -> set[str]:
    """Top-level modules a file imports (relative imports as '.name')."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("." + (node.module or "") if node.level else node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("case", sorted(CASES))
def test_custom_export_matches_in_logits_generation_and_cached_decoding(case, tok_dir, tmp_path):
    out = tmp_path / "hf"
    logs = []
    cached_before = remote_code_copies()
    model, report = export_case(case, tok_dir, out, log=logs.append)
    # The parity check's copy of the code (made under the temporary directory's name) does not stay cached.
    assert remote_code_copies() <= cached_before
    assert report.target == "hybridtron" and report.architecture == "HybridtronForCausalLM"
    dn = model.cfg.deltanet
    said = next(line for line in logs if line.startswith("custom code:"))
    assert "trust_remote_code=True" in said
    assert ("neg_eigval=true" in said) == dn.neg_eigval
    assert (f"n_householder={dn.n_householder} (DeltaProduct)" in said) == (dn.n_householder > 1)
    assert (f"sparse_attention={dn.sparse_attention} (HAX" in said) == (dn.sparse_attention != "none")
    assert report.max_logit_diff <= 1e-4 and any(line.startswith("parity: max |logit") for line in logs)
    m = model.cfg.moe
    if m.n_experts:  # the export's own check routed to several experts in every MoE layer
        assert len(report.experts_chosen) == sum(m.is_moe_layer(i) for i in range(model.cfg.n_layers))
        assert min(report.experts_chosen) > m.top_k, report.experts_chosen
        assert ("router bias chooses the experts" in said) == (m.bias_update_rate > 0)
        assert (f"router={m.router}" in said) == (m.router != "softmax")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "hybridtron" and cfg["architectures"] == ["HybridtronForCausalLM"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_hybridtron.HybridtronForCausalLM"
    assert (cfg["linear_allow_neg_eigval"], cfg["linear_num_householder"]) == (dn.neg_eigval, dn.n_householder)
    assert cfg.get("linear_sparse_attention", "none") == dn.sparse_attention
    for f in ("modeling_hybridtron.py", "configuration_hybridtron.py"):
        assert import_roots(out / f) <= {"torch", "transformers", ".configuration_hybridtron"}, f

    # The native loader refuses without trust_remote_code; with it, the directory's own code runs.
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()
    assert type(hf).__name__ == "HybridtronForCausalLM" and type(hf).__module__.startswith("transformers_modules")
    assert transformers.AutoConfig.from_pretrained(out, trust_remote_code=True).linear_num_householder == dn.n_householder

    x = torch.randint(0, V, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = hf(x).logits
        assert (full - model(x)).abs().max().item() <= 1e-4

        # transformers' cache: a prompt, three single-token steps, then a multi-token continuation.
        step = hf(x[:, :30], use_cache=True)
        cache, pieces = step.cache, [step.logits]
        for t in range(30, 33):
            step = hf(x[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(step.logits)
        pieces.append(hf(x[:, 33:], cache=cache, use_cache=True).logits)
        assert (torch.cat(pieces, dim=1) - full).abs().max().item() <= 1e-4

    ours = generate(model, PROMPT, 20, max_seq_len=model.cfg.max_seq_len, temperature=0.0)
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[0].tolist()
    assert_same_greedy(model, ours, theirs, hf.generation_config.eos_token_id)
    assert len(set(ours[len(PROMPT):])) >= 10  # a real sequence, not one repeated token
    # A left-padded batch (the mixer zeroes padded inputs) generates what each prompt does alone.
    short = [7, 9]
    batch = torch.tensor([PROMPT, [0, 0] + short])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    both = hf.generate(batch, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)[:, 4:]
    alone = hf.generate(torch.tensor([short]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 2:]
    assert both[0].tolist() == ours[4:12] and both[1].tolist() == alone.tolist()

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == load_tokenizer(tok_dir).encode(TEXT)


def test_the_comparison_catches_a_wrong_mixer(tok_dir, tmp_path):
    """The same directory read with beta = sigmoid(b) (Qwen3.5's rule), or with DeltaProduct's key steps
    swapped, is far outside the tolerance: the checks above can fail."""
    model, _ = export_case("tiny_deltaproduct", tok_dir, tmp_path / "hf")
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(x)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", dtype=torch.float32, trust_remote_code=True, linear_allow_neg_eigval=False)
        assert (hf(x).logits - ref).abs().max().item() > 1e-2
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                               trust_remote_code=True)
        mixer = hf.model.layers[0].linear_attn
        kd = mixer.key_dim
        for w in (mixer.in_proj_qkv.weight, mixer.conv1d.weight):  # [q | k_1 | k_2 | v..] -> [q | k_2 | k_1 | v..]
            w.copy_(torch.cat([w[:kd], w[2 * kd : 3 * kd], w[kd : 2 * kd], w[3 * kd :]]))
        assert (hf(x).logits - ref).abs().max().item() > 1e-2


def test_the_comparison_catches_a_missing_router_bias(tok_dir, tmp_path):
    """The MoE export read without its router bias (Qwen3.5-MoE's routing) is far outside the tolerance."""
    model, _ = export_case("moe_router_bias_partial", tok_dir, tmp_path / "hf")
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", dtype=torch.float32, trust_remote_code=True, moe_router_bias_update_rate=0.0)
        assert (hf(x).logits - model(x)).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind", HAX_KINDS)
def test_the_comparison_catches_a_wrong_or_missing_hax_branch(kind, tok_dir, tmp_path):
    """The export's own check (`parity`) on a HAX export whose directory is then changed: without the branch
    (its output vector zeroed), with half the key budget, with another LSH projection, with the key scorer's
    ranking reversed. Each is far outside the tolerance; the directory as written is inside it."""
    from safetensors.torch import load_file, save_file

    from hybridtron.train.hf.export import PARITY_TOLERANCE, parity

    model, _ = export_case(f"hax_{kind}", tok_dir, tmp_path / "hf")
    weights, config = tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "config.json"
    good, good_cfg = load_file(weights), json.loads(config.read_text())
    hax = "model.layers.0.linear_attn.hax."

    def measured(cfg=None, **tensors) -> float:
        save_file({**good, **{hax + k: v for k, v in tensors.items()}}, weights, metadata={"format": "pt"})
        config.write_text(json.dumps({**good_cfg, **(cfg or {})}))
        return parity(model, tmp_path / "hf", V, trust_remote_code=True)["max_logit_diff"]

    assert measured() <= PARITY_TOLERANCE
    assert measured(out_scale=torch.zeros_like(good[hax + "out_scale"])) > 1e-2
    assert measured({"linear_sparse_keys": 4}) > 1e-2
    if kind in ("hax", "lsh"):
        other = torch.randn(good[hax + "lsh_proj"].shape, generator=torch.Generator().manual_seed(5))
        assert measured(lsh_proj=other) > 1e-2
    if kind in ("hax", "key_selection"):
        assert measured(**{"scorer.4.weight": -good[hax + "scorer.4.weight"]}) > 1e-2


def test_export_refuses_a_directory_that_lost_the_hax_branch(tok_dir, tmp_path, monkeypatch):
    """The branch's output vector written as zeros: the export measures the difference and writes nothing."""
    from hybridtron.train.hf import export as export_module
    from hybridtron.train.hf.export import ExportError

    real = export_module.to_hf_names

    def without_branch(state, cfg, target):
        return {k: torch.zeros_like(v) if k.endswith("hax.out_scale") else v for k, v in real(state, cfg, target).items()}

    monkeypatch.setattr(export_module, "to_hf_names", without_branch)
    with pytest.raises(ExportError, match="exported model differs from the checkpoint"):
        export_case("hax_hax", tok_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_beam_search_reorders_the_hax_cache(tok_dir, tmp_path):
    """Beam search reorders transformers' cache between steps; the HAX branch's keys and values, which that cache
    holds for it, must follow (HybridtronForCausalLM._reorder_cache): cached beams equal uncached ones."""
    export_case("hax_hax", tok_dir, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                           trust_remote_code=True).eval()
    prompt = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(6))
    # no_repeat_ngram_size=1: without it this model's beams all repeat one token, so that beams swapped between
    # steps have the same keys and a cache left unordered gives the same result; the four beams and their scores
    # are compared (with the branch's cache left unordered, the seventh new token already differs).
    kw = dict(num_beams=4, num_return_sequences=4, max_new_tokens=16, min_new_tokens=16, do_sample=False,
              no_repeat_ngram_size=1, return_dict_in_generate=True, output_scores=True)
    cached, uncached = hf.generate(prompt, use_cache=True, **kw), hf.generate(prompt, use_cache=False, **kw)
    assert cached.sequences.tolist() == uncached.sequences.tolist()
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=1e-5)


@pytest.mark.slow
def test_the_exported_directory_loads_without_hybridtron(tok_dir, tmp_path):
    """A fresh interpreter where `import hybridtron` fails (and the checkout is off sys.path) loads the
    directory with trust_remote_code, and reproduces our logits and greedy generation."""
    model, _ = export_case("tiny_deltaproduct", tok_dir, tmp_path / "hf")
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.save({"x": x, "logits": model(x)}, tmp_path / "ours.pt")
    ours = generate(model, PROMPT, 20, max_seq_len=model.cfg.max_seq_len, temperature=0.0)
    script = textwrap.dedent(f"""
        import importlib.abc, json, sys
        class NoHybridtron(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "hybridtron":
                    raise ImportError("hybridtron is not installed here")
        sys.meta_path.insert(0, NoHybridtron())
        repo = {str(Path(__file__).resolve().parents[2])!r}
        sys.path = [p for p in sys.path if p not in ("", ".", repo)]
        import torch, transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, dtype=torch.float32,
                                                               trust_remote_code=True).eval()
        saved = torch.load({str(tmp_path / "ours.pt")!r})
        with torch.no_grad():
            diff = (hf(saved["x"]).logits - saved["logits"]).abs().max().item()
        ids = hf.generate(torch.tensor([{PROMPT}]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        print(json.dumps({{"diff": diff, "ids": ids[0].tolist(), "hybridtron": "hybridtron" in sys.modules}}))
    """)
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["hybridtron"]
    assert result["diff"] <= 1e-4
    assert_same_greedy(model, ours, result["ids"], load_tokenizer(tok_dir).eos_id)


@pytest.mark.parametrize("case", ["tiny_deltaproduct", "tiny_hax"])
def test_round_trip_of_a_custom_export_is_bit_exact(case, tok_dir, tmp_path):
    from safetensors.torch import load_file

    from hybridtron.train.hf.load import load_hf_weights, model_config_from_hf, read_hf_config

    model, _ = export_case(case, tok_dir, tmp_path / "a")
    # The rotary length comes from the run (as with --init-from), not from max_position_embeddings.
    cfg = model_config_from_hf(read_hf_config(tmp_path / "a"), ModelConfig(max_seq_len=model.cfg.max_seq_len))
    dn, want = cfg.deltanet, model.cfg.deltanet
    assert (dn.neg_eigval, dn.n_householder) == (want.neg_eigval, want.n_householder)
    assert (dn.sparse_attention, dn.sparse_keys, dn.lsh_bits) == (want.sparse_attention, want.sparse_keys, want.lsh_bits)
    imported = GatedLM(cfg, cfg.vocab_size)
    load_hf_weights(imported, tmp_path / "a")
    export_model(imported.eval(), tok_dir, tmp_path / "b", log=lambda _: None)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for f in ("config.json", "modeling_hybridtron.py", "configuration_hybridtron.py"):
        assert (tmp_path / "a" / f).read_text() == (tmp_path / "b" / f).read_text(), f


def test_with_qwen35_settings_the_custom_model_is_qwen35(tok_dir, tmp_path):
    """beta = sigmoid(b) and n_h = 1: HybridtronForCausalLM on a native export's weights gives transformers'
    own Qwen3_5ForCausalLM logits (the replaced mixer is Qwen3.5's plus the two options, nothing else)."""
    from hybridtron.train.hf.export_custom.configuration_hybridtron import HybridtronConfig
    from hybridtron.train.hf.export_custom.modeling_hybridtron import HybridtronForCausalLM

    cfg = replace(CASES["neg_eigval_hybrid"](), deltanet=DeltaNetConfig(**SMALL_DN))
    export_model(build(cfg), tok_dir, tmp_path / "hf", log=lambda _: None)
    native = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(native).__name__ == "Qwen3_5ForCausalLM"
    raw = {k: v for k, v in native.config.to_dict().items() if k not in ("model_type", "architectures")}
    ours = HybridtronForCausalLM(HybridtronConfig(**raw)).eval()
    ours.load_state_dict(native.state_dict(), strict=True)
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(x).logits - native(x).logits).abs().max().item() <= 1e-4  # two chunked algorithms in fp32
    with pytest.raises(ValueError, match="linear_num_householder=0 must be >= 1"):
        HybridtronConfig(**{**raw, "linear_num_householder": 0})


def test_an_attention_only_model_ignores_the_delta_rule_options(tok_dir, tmp_path):
    """neg_eigval / n_householder act on Gated DeltaNet layers only: without one the export stays native."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
                      deltanet=DeltaNetConfig(neg_eigval=True, n_householder=2))
    report = export_model(build(cfg), tok_dir, tmp_path / "hf", log=lambda _: None)
    assert report.target == "qwen3_5_text" and not (tmp_path / "hf" / "modeling_hybridtron.py").exists()


@pytest.mark.slow
def test_cli_export_of_a_deltaproduct_run(small_data_dir, cli_args, tmp_path, capsys):
    from hybridtron.cli import main

    run = tmp_path / "run"
    extra = ["--model.layer_pattern", "LA", "--model.doc_mask", "true", "--model.deltanet.chunk_size", "16",
             "--model.deltanet.neg_eigval", "true", "--model.deltanet.n_householder", "2",
             "--train.max_steps", "2", "--checkpoint.every", "2", "--train.eval_every", "0", "--train.warmup_steps", "1"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "target: hybridtron (HybridtronForCausalLM)" in printed
    assert "trust_remote_code=True" in printed and "parity: max |logit difference|" in printed
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("def main():", return_tensors="pt")["input_ids"]
    assert hf.generate(ids, max_new_tokens=5, do_sample=False).shape[1] == ids.shape[1] + 5
