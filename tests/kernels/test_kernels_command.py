"""``hybridtron kernels``: measures auto's choice for every tuned op of a preset at its shapes (one block of each
kind, a training step and an evaluation forward) and prints the table; without a GPU it says why nothing is
measured. The CPU stands in for the GPU here (``--measure-on-cpu``: ours under the interpreter, the real checks
against the reference), with injected timings."""

from __future__ import annotations

import json

import pytest

from hybridtron.cli import main
from hybridtron.kernels import backend, tune

from .helpers import fake_timer

SMALL = ["--train.device", "cpu", "--data.seq_len", "32", "--train.micro_batch_size", "2", "--model.d_model", "32",
         "--model.n_heads", "2", "--model.n_kv_heads", "1", "--model.max_seq_len", "64", "--model.deltanet.n_k_heads",
         "1", "--model.deltanet.n_v_heads", "2", "--model.deltanet.k_head_dim", "16", "--model.deltanet.v_head_dim", "16",
         "--model.deltanet.chunk_size", "16", "--data.tokenizer.vocab_size", "300"]


@pytest.fixture
def cpu_tuner(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRON_CACHE_DIR", str(tmp_path / "cache"))
    tune.reset()
    backend.clear_cache()
    tune.configure(timer=fake_timer({"triton": 2.0, "sdpa": 1.0, "flex": 0.5, "reference": 9.0}))
    yield tmp_path
    tune.reset()
    backend.clear_cache()


def test_kernels_measures_every_tuned_op_of_a_preset(cpu_tuner, capsys):
    out_json = cpu_tuner / "rows.json"
    with pytest.warns(tune.KernelTuningWarning, match="flex dropped"):  # its backward needs CUDA
        assert main(["kernels", "--config", "tiny_hybrid", "--measure-on-cpu", "--json", str(out_json), *SMALL]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())["rows"]
    by = {(r["op"], "grad=True" in r["shape"]): r for r in rows}
    assert set(by) == {(op, g) for op in ("attention", "delta_rule", "conv") for g in (True, False)}
    assert by["attention", True]["chosen"] == "sdpa"  # flex (0.5 ms) dropped: no backward on the CPU
    assert "flex" in by["attention", True]["dropped"] and "flex" not in by["attention", True]["times_ms"]
    assert by["attention", False]["chosen"] == "flex"  # forward only: flex runs on the CPU, and it "was" fastest
    assert by["delta_rule", True]["chosen"] == by["conv", True]["chosen"] == "triton"  # no peer runs on the CPU
    assert "docs=True" in by["attention", True]["shape"]  # tiny_hybrid packs documents (model.doc_mask)
    assert "| attention | dtype=float32,B=2,T=64,H=2,KV=1,D=16,gate=elementwise,docs=True,grad=True | sdpa |" in out
    assert str(cpu_tuner / "cache" / "kernel_choices.json") in out


def test_kernels_without_a_gpu_says_why_nothing_is_measured(cpu_tuner, capsys):
    assert main(["kernels", "--config", "tiny", "--train.device", "cpu"]) == 0
    assert "nothing is measured here" in capsys.readouterr().out
    assert tune.decisions() == {}
