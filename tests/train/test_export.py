"""Hugging Face export, judged by transformers itself: AutoModelForCausalLM / AutoTokenizer load the
directory without custom code, and logits, greedy generation (transformers' own generate and caches)
and tokenization match ours. Every foldable feature is exported and checked the same way."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from hybridtron.atomic import OLD_SCRATCH_AGE_S, parse_scratch, this_host
from hybridtron.configs import DeltaNetConfig, ModelConfig, MoEConfig, ScaleVectorConfig, StructuredFFNConfig
from hybridtron.data_pipeline.tokenizer import load_tokenizer
from hybridtron.model import GatedLM
from hybridtron.train.hf.export import ExportError, export_model
from hybridtron.train.sample import generate

transformers = pytest.importorskip("transformers", reason="transformers is a dependency; install the project")

V = 320
TEXT = "Grüße aus Köln! 你好，世界。 Привет, мир. def f(x):\n    return x ** 2  # ünïcödé ✓ <|eos|>"


def assert_same_greedy(model, ours: list[int], theirs: list[int], eos: int, tol: float = 1e-4) -> None:
    """Our greedy continuation of a prompt and transformers' (``min_new_tokens`` = all of them) are the same. They
    may part only where ours ends the text (``eos``: min_new_tokens forbids it to transformers there) or where our
    model's two best logits are tied within the export's parity ``tol`` (the summation orders may pick either)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            if a == eos:
                return
            with torch.no_grad():
                logits = model(torch.tensor([ours[:i]]))[0, -1]
            gap = abs(float(logits[a] - logits[b]))
            assert gap <= tol, f"greedy tokens part at {i}: {a} vs {b}, logits {gap:.2e} apart (not a tie)"
            return


def tiny(**kw) -> GatedLM:
    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
                deltanet=DeltaNetConfig(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=8))
    cfg = ModelConfig(**{**base, **kw})
    torch.manual_seed(0)
    model = GatedLM(cfg, V)
    model.init_weights()
    with torch.no_grad():  # off the identity: norm gains, scales and biases that start at 1 or 0 must be mapped
        for n, p in model.named_parameters():
            if p.ndim == 1 or n.endswith(("_m", "_d")):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


CASES = {
    "dense_gated": dict(layer_pattern="A"),
    "hybrid_qwen35": dict(layer_pattern="LA", norm_type="rmsnorm_zero_centered", rotary_fraction=0.25),
    "hybrid_untied": dict(layer_pattern="LLA", n_layers=3, tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-3),
    "moe": dict(layer_pattern="LA", moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32, shared_expert_hidden=16)),
    "headwise": dict(layer_pattern="LA", attn_gate="headwise"),
    "ungated_qwen3": dict(attn_gate="none", norm_type="rmsnorm_zero_centered"),
    "ungated_llama": dict(attn_gate="none", qk_norm=False),
    "scale_all": dict(layer_pattern="LA", scale=ScaleVectorConfig(branch_specific=True, two_sided=True,
                                                                  magnitude_direction=True)),
    "lowrank": dict(layer_pattern="LA", ffn=StructuredFFNConfig(kind="lowrank", rank=8, dense_first_layer=False)),
    "blockshuffle_guided": dict(ffn=StructuredFFNConfig(kind="blockshuffle", n_blocks=4, self_guided=True)),
    # Qwen3-Next: MoE on some layers (dense MLPs between), top-k weights not renormalised, Hv = 2 Hk (grouped
    # fused projections), ungated attention folded
    "moe_partial_next": dict(layer_pattern="LA", n_layers=4, moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=24,
                                                                           shared_expert_hidden=16, every=2)),
    "moe_no_renorm_next": dict(layer_pattern="LLA", n_layers=3, attn_gate="none", norm_type="rmsnorm_zero_centered",
                               rotary_fraction=0.5, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32,
                                                                  shared_expert_hidden=16, norm_topk_prob=False)),
    "hybrid_gate_none": dict(layer_pattern="LA", attn_gate="none"),
    "ungated_partial_rotary": dict(attn_gate="none", rotary_fraction=0.5),  # Qwen3.5 with zero gate rows
}
TARGETS = {"ungated_qwen3": "qwen3", "ungated_llama": "llama", "moe": "qwen3_5_moe_text",
           "moe_partial_next": "qwen3_next", "moe_no_renorm_next": "qwen3_next"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers_with_same_logits_and_generation(case, tok_dir, tmp_path):
    model = tiny(**CASES[case])
    if case == "blockshuffle_guided":
        from hybridtron.model.structured_ffn import set_self_guided_alpha

        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".dense"):
                    p.add_(torch.randn_like(p) * 0.05)
        set_self_guided_alpha(model, 0.3)  # mid-way: the export mixes guide and factors exactly
    out = tmp_path / "hf"
    report = export_model(model, tok_dir, out, log=lambda _: None)
    assert report.target == TARGETS.get(case, "qwen3_5_text")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == report.architecture
    x = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff < 1e-4, diff
    # Greedy generation through transformers' generate (KV / conv / recurrent caches) equals ours.
    prompt = [5, 17, 42, 8]
    ours = generate(model, prompt, 20, max_seq_len=64, temperature=0.0)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)[0].tolist()
    assert_same_greedy(model, ours, theirs, hf.generation_config.eos_token_id)
    meta = json.loads((out / "hybridtron_export.json").read_text())
    assert meta["max_logit_diff"] == pytest.approx(report.max_logit_diff) and meta["max_logit_diff"] < 1e-4


def test_the_comparison_catches_a_wrong_qwen3_next_grouping(tok_dir, tmp_path):
    """Qwen3-Next's fused DeltaNet projection with two key heads' rows swapped, or the dense MLP layers read as MoE
    layers, is far outside the tolerance: the parity above can fail."""
    model = tiny(**CASES["moe_partial_next"])
    logs = []
    export_model(model, tok_dir, tmp_path / "hf", log=logs.append)
    assert logs[0].startswith("target: qwen3_next (Qwen3NextForCausalLM)") and logs[0].endswith(
        "MoE on layers [1, 3] of 0..3 only, which Qwen3-Next holds (Qwen3.5-MoE: MoE on every layer, renormalised "
        "top-k)"), logs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        w = hf.model.layers[0].linear_attn.in_proj_qkvz.weight
        half = w.shape[0] // 2
        w.copy_(torch.cat([w[half:], w[:half]]))  # key head 0's block <-> key head 1's
        assert (hf(x).logits - model(x)).abs().max().item() > 1e-2
    assert type(hf.model.layers[0].mlp).__name__ == "Qwen3NextMLP"
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen3NextSparseMoeBlock"


def test_folds_are_reported(tok_dir, tmp_path):
    logs = []
    export_model(tiny(**CASES["scale_all"]), tok_dir, tmp_path / "a", log=logs.append)
    assert any("scale vectors (branch_specific, two_sided, magnitude_direction)" in line for line in logs)
    assert any(line.startswith("parity: max |logit difference|") for line in logs)
    logs.clear()
    export_model(tiny(**CASES["headwise"]), tok_dir, tmp_path / "b", log=logs.append)
    assert any("headwise attention gates expanded" in line for line in logs)


def test_tokenizer_loads_with_autotokenizer_and_encodes_the_same(tok_dir, tmp_path):
    export_model(tiny(), tok_dir, tmp_path / "hf", log=lambda _: None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_tokenizer(tok_dir)
    assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT)
    assert hf_tok.eos_token_id == ours.eos_id and hf_tok.bos_token_id == ours.bos_id
    assert hf_tok.decode(ours.encode(TEXT)) == TEXT


def test_large_models_are_sharded_with_an_index(tok_dir, tmp_path):
    model = tiny(layer_pattern="LA")
    export_model(model, tok_dir, tmp_path / "hf", max_shard_size="20KB", log=lambda _: None)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    x = torch.randint(0, V, (1, 16))
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(layer_pattern="LA", qk_norm=False), "model.qk_norm=false .* train with model.qk_norm=true"),
        (dict(qk_norm=False, moe=MoEConfig(n_experts=4, top_k=2, shared_expert_hidden=16)), "model.qk_norm=false"),
        (dict(attn_gate="none", rotary_fraction=0.5, qk_norm=False), "rotary_fraction=0.5 with model.qk_norm=false "
                                                                     ".* train with rotary_fraction=1 or qk_norm=true"),
    ],
)
def test_features_without_a_transformers_equivalent_are_refused_by_name(kw, message, tok_dir, tmp_path):
    with pytest.raises(ExportError, match=message):
        export_model(tiny(**kw), tok_dir, tmp_path / "hf", log=lambda _: None)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_refuses_a_non_empty_output_directory(tok_dir, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_model(tiny(), tok_dir, out, log=lambda _: None)
    assert (out / "keep.txt").read_text() == "mine"


def test_an_export_removes_what_killed_exports_left_and_says_so(tok_dir, tmp_path, monkeypatch, dead_pid, live_pid):
    from hybridtron.train.hf import export as ex

    host = this_host()
    killed = tmp_path / f".hf.tmp-{host}-{dead_pid}"  # what `hybridtron export` killed midway leaves
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    older = tmp_path / f".hf.tmp-{dead_pid}"  # the same from an older version, hours ago
    older.mkdir()
    os.utime(older, (time.time() - 2 * OLD_SCRATCH_AGE_S,) * 2)
    kept = [tmp_path / f".hf.tmp-{host}-{live_pid}", tmp_path / f".hf.tmp-node9-{dead_pid}"]  # running; elsewhere
    for p in kept:
        p.mkdir()
    writing = []
    real = ex.export_tokenizer
    monkeypatch.setattr(ex, "export_tokenizer", lambda src, dst: (writing.append(dst), real(src, dst)))
    logs = []
    export_model(tiny(), tok_dir, tmp_path / "hf", log=logs.append, check=False)
    assert parse_scratch(writing[0].name) == ("hf", host, os.getpid())  # this export's own, as the next one reads it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", *(p.name for p in kept)])
    assert logs[0].startswith(f"removed 2 scratch entries of dead processes in {tmp_path}: ")
    assert killed.name in logs[0] and older.name in logs[0]
    assert not any("scratch" in line for line in logs[1:])  # one line


@pytest.mark.slow
def test_cli_export_of_a_trained_run(small_data_dir, cli_args, tmp_path, capsys):
    from hybridtron.cli import main

    run = tmp_path / "run"
    extra = ["--model.layer_pattern", "LA", "--model.doc_mask", "true", "--model.deltanet.chunk_size", "16",
             "--train.max_steps", "4", "--checkpoint.every", "2", "--train.eval_every", "0", "--train.warmup_steps", "1"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "target: qwen3_5_text (Qwen3_5ForCausalLM)" in printed and "parity: max |logit difference|" in printed
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("def main():", return_tensors="pt")["input_ids"]
    assert hf.generate(ids, max_new_tokens=5, do_sample=False).shape[1] == ids.shape[1] + 5
    # A second export into the same directory is refused, the first stays intact.
    assert main(["export", str(run / "checkpoints" / "step_00000002"), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    shutil.rmtree(out)
    assert main(["export", str(run / "checkpoints" / "step_00000002"), "--out", str(out)]) == 0


@pytest.mark.parametrize("case", ["dense_gated", "hybrid_qwen35", "hybrid_untied", "moe", "ungated_qwen3", "ungated_llama",
                                  "moe_partial_next", "moe_no_renorm_next", "hybrid_gate_none"])
def test_round_trip_hf_to_hybridtron_to_hf_is_bit_exact(case, tok_dir, tmp_path):
    from safetensors.torch import load_file

    from hybridtron.train.hf.load import load_hf_weights, model_config_from_hf, read_hf_config

    export_model(tiny(**CASES[case]), tok_dir, tmp_path / "a", log=lambda _: None)
    cfg = model_config_from_hf(read_hf_config(tmp_path / "a"), ModelConfig(max_seq_len=64))
    imported = GatedLM(cfg, cfg.vocab_size)
    load_hf_weights(imported, tmp_path / "a")
    export_model(imported.eval(), tok_dir, tmp_path / "b", log=lambda _: None)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in "ab")
    assert ca == cb


def test_import_refuses_unsupported_directories(tmp_path):
    from hybridtron.configs import JobConfig
    from hybridtron.train.hf.load import HFImportError, apply_init_from

    with pytest.raises(HFImportError, match="no config.json"):
        apply_init_from(JobConfig(), f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFImportError, match="model_type 'gpt2' is not supported"):
        apply_init_from(JobConfig(), f"hf:{tmp_path}")
    with pytest.raises(HFImportError, match="write hf:DIR"):
        apply_init_from(JobConfig(), str(tmp_path))


@pytest.mark.slow
def test_train_init_from_hf_continues_from_its_weights(small_data_dir, cli_args, tmp_path, capsys):
    from hybridtron.cli import main
    from hybridtron.train.metrics import read_metrics

    run = tmp_path / "run"
    base = ["--model.layer_pattern", "LA", "--model.deltanet.chunk_size", "16", "--train.eval_every", "0",
            "--train.warmup_steps", "1", "--checkpoint.every", "0"]
    assert main(cli_args(small_data_dir, run, base + ["--train.max_steps", "20"])) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    cont, fresh = tmp_path / "cont", tmp_path / "fresh"
    # The HF tokenizer re-tokenizes the corpus: a data directory of its own (prepare refuses to mix).
    assert main(cli_args(small_data_dir, cont, base + ["--train.max_steps", "2", "--init-from", f"hf:{tmp_path / 'hf'}",
                                                       "--data.out_dir", str(tmp_path / "data_hf")])) == 0
    assert "initialised from Hugging Face weights" in capsys.readouterr().out
    saved = (cont / "config.yaml").read_text()
    assert "kind: pretrained" in saved and "tokenizer.json" in saved and "norm_type: rmsnorm_zero_centered" in saved
    assert main(cli_args(small_data_dir, fresh, base + ["--train.max_steps", "2"])) == 0
    trained = read_metrics(run)[-1]["loss"]
    first_cont, first_fresh = read_metrics(cont)[0]["loss"], read_metrics(fresh)[0]["loss"]
    # The continued run starts where the exported one ended (same data, same tokenizer), far below a fresh start.
    assert first_cont < first_fresh - 0.5
    assert abs(first_cont - trained) < 0.5


@pytest.mark.slow
def test_export_of_a_run_with_triton_kernels_runs_the_reference_on_a_cpu(small_data_dir, cli_args, tmp_path, capsys,
                                                                          monkeypatch):
    """A run that named Triton kernels (trained here under the interpreter, as on a GPU) exports on a CPU without
    one: the export switches every kernel to the reference and says so; sample keeps refusing the backend."""
    from hybridtron.cli import main
    from hybridtron.kernels import backend

    run = tmp_path / "run"
    extra = ["--model.n_layers", "2", "--model.kernels.norm", "triton", "--model.kernels.swiglu", "triton",
             "--train.max_steps", "2", "--checkpoint.every", "2", "--train.eval_every", "0", "--train.warmup_steps", "1"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # now a CPU machine without Triton's interpreter
    backend.clear_cache()
    try:
        capsys.readouterr()
        ckpt = run / "checkpoints" / "step_00000002"
        assert main(["sample", "--checkpoint", str(ckpt), "--prompt", "def", "--max-new-tokens", "2"]) == 2
        assert "triton" in capsys.readouterr().err  # the refusal the export must not hit
        out = tmp_path / "hf"
        assert main(["export", str(run), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert ("pure-torch reference on the CPU: model.kernels.norm=reference, model.kernels.swiglu=reference"
                in printed), printed
        assert "parity: max |logit difference|" in printed
    finally:
        backend.clear_cache()
