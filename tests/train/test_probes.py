"""The attention-sink measure against a direct loop, on a model with a known answer, and in `hybridtron eval`."""

from __future__ import annotations

import json

import pytest
import torch

from hybridtron.cli import main
from hybridtron.configs import load_config
from hybridtron.model.attention import GatedAttention, first_token_attention
from hybridtron.model.lm import GatedLM
from hybridtron.train.probes import attention_sink


def _loop(q, k, doc_ids):
    B, T, H, D = q.shape
    g = H // k.shape[2]
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            start = t
            while start > 0 and doc_ids[b, start - 1] == doc_ids[b, t]:
                start -= 1
            if start == t:
                continue  # a document's first query
            for h in range(H):
                s = torch.stack([q[b, t, h].double() @ k[b, j, h // g].double() for j in range(start, t + 1)])
                total += float((s * D ** -0.5).softmax(0)[0])
                count += 1
    return total, count


def test_first_token_attention_matches_a_loop_with_documents_and_gqa():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 9, 4, 8, generator=g), torch.randn(2, 9, 2, 8, generator=g)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    total, count = first_token_attention(q, k, doc_ids)
    want_total, want_count = _loop(q, k, doc_ids)
    assert count == want_count and total == pytest.approx(want_total, rel=1e-5)
    total, count = first_token_attention(q, k, None)
    want_total, want_count = _loop(q, k, torch.zeros(2, 9, dtype=torch.long))
    assert count == want_count and total == pytest.approx(want_total, rel=1e-5)


def test_attention_sink_per_layer_is_exact_for_uniform_attention():
    cfg = load_config("tiny_hybrid", [("model.d_model", "32"), ("model.n_heads", "2"), ("model.n_kv_heads", "1")])
    torch.manual_seed(0)
    model = GatedLM(cfg.model, 64)
    model.init_weights()
    attn = [m for m in model.modules() if isinstance(m, GatedAttention)]
    assert attn, "tiny_hybrid has attention layers"
    for m in attn:
        torch.nn.init.zeros_(m.k_proj.weight)  # every key 0: each query spreads evenly over what it sees
    T = 16
    ids = torch.randint(0, 64, (3, T))
    sink = attention_sink(model, lambda: iter([{"input_ids": ids}] * 2), 2, torch.device("cpu"), None, doc_mask=False)
    expect = sum(1 / (t + 1) for t in range(1, T)) / (T - 1)
    assert len(sink) == len(attn) and all(v == pytest.approx(expect, rel=1e-5) for v in sink.values()), sink
    assert all(m.sink_stats is None for m in attn)  # switched off again


@pytest.mark.slow
def test_eval_reports_the_attention_sink(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, ["--train.max_steps", "2", "--train.warmup_steps", "1",
                                               "--train.eval_every", "0"])) == 0
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--batches", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["attention_sink"]) == {"layers.0", "layers.1"} and all(0 < v < 1 for v in out["attention_sink"].values())
