"""Cached decoding (KV cache for attention, conv window + recurrent state for delta-rule layers)
gives the logits of the full forward, and `generate` matches a greedy loop without a cache."""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import ModelConfig
from hybridtron.model import GatedLM
from hybridtron.train.sample import generate

V = 50


def build(pattern: str, **kw) -> GatedLM:
    cfg = ModelConfig(d_model=32, n_layers=len(pattern), n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
                      layer_pattern=pattern, **kw)
    model = GatedLM(cfg, V)
    torch.manual_seed(0)
    model.init_weights()
    return model.double().eval()


@pytest.mark.parametrize("pattern", ["A", "AA", "LA", "LLLA"])
def test_incremental_logits_equal_full_forward(pattern):
    model = build(pattern)
    x = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))
    full = model(x)
    cache = model.new_cache()
    parts = [model(x[:, :7], cache=cache)]  # a prompt, then a second prompt chunk, then single tokens
    parts.append(model(x[:, 7:11], cache=cache))
    parts += [model(x[:, t : t + 1], cache=cache) for t in range(11, 19)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.pos == 19


def test_generate_greedy_equals_uncached_loop():
    model = build("LA")
    prompt = [3, 14, 15, 9, 2]
    out = generate(model, prompt, 12, max_seq_len=64, temperature=0.0)
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids


def test_generate_past_the_rotary_table_rebuilds_the_cache():
    model = build("A")
    out = generate(model, [1, 2, 3], 80, max_seq_len=16, temperature=0.0)
    assert len(out) == 83 and all(0 <= t < V for t in out)
