"""bench/bench_hf.py on the CPU at a tiny size: both models train the same configuration and the table says so."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hybridtron.bench import bench_hf

# hybrid_1b's layout (LLLA, untied head, 25% rotary, zero-centred norms) at widths a CPU trains in seconds.
TINY = ["--device", "cpu", "--layers", "4", "--seq", "64", "--batch", "2", "--warmup", "2", "--steps", "2",
        "--repeats", "2"] + [f"--set={k}={v}" for k, v in {
            "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 16,
            "model.ffn_hidden": 128, "model.deltanet.n_k_heads": 2, "model.deltanet.n_v_heads": 4,
            "model.deltanet.k_head_dim": 16, "model.deltanet.v_head_dim": 16, "model.deltanet.chunk_size": 16,
            "model.vocab_size": 512, "data.tokenizer.vocab_size": 512}.items()]


@pytest.fixture
def one_thread():
    """At these sizes every op is tiny; a second intra-op thread only adds waits (seconds on a busy 2-core VM)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _row(out: str, name: str) -> list[str]:
    rows = [line for line in out.splitlines() if line.startswith(f"| {name} ")]
    assert len(rows) == 1, out
    return [c.strip() for c in rows[0].strip("|").split("|")]


def test_both_models_train_the_same_configuration(capsys, tmp_path, one_thread):
    results = tmp_path / "RESULTS.md"
    bench_hf.main(TINY + ["--append", str(results)])
    out = capsys.readouterr().out
    ours, hf = _row(out, "hybridtron GatedLM"), _row(out, "transformers Qwen3_5ForCausalLM")
    n_ours, n_hf = (int(r[1].replace(",", "")) for r in (ours, hf))
    assert n_hf > 100_000 and abs(n_ours - n_hf) <= 0.01 * n_hf  # the same configuration, not merely similar sizes
    for row in (ours, hf):
        assert float(row[3].replace(",", "")) > 0  # median tokens/s
        first, last = (float(v) for v in row[5].split("->"))
        assert math.isfinite(first) and math.isfinite(last) and last < first  # it trains
    first = re.search(r"first-step loss .*: ours (\S+), transformers (\S+)", out)
    assert abs(float(first.group(1)) - float(first.group(2))) < 1e-3  # same weights, same batch, fp32
    assert "torch fallback" in hf[2] and "sdpa" in hf[2]  # which path transformers took (no fla on the CPU)
    assert re.search(r"ours / transformers: \d+\.\d\dx tokens/s\*\* \(target >= 2x: no verdict", out)
    assert "timings mean nothing" in out
    written = results.read_text()
    assert "Ours against transformers' Qwen3.5" in written and "| transformers Qwen3_5ForCausalLM |" in written
