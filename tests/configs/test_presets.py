"""The GPU presets build (on the meta device, no memory) at the sizes their names promise."""

import pytest
import torch

from hybridtron.configs import load_config
from hybridtron.model import GatedLM


@pytest.mark.parametrize("name, lo, hi", [("dense_125m", 110e6, 135e6), ("dense_1b", 0.9e9, 1.1e9)])
def test_preset_sizes(name, lo, hi):
    cfg = load_config(name)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    with torch.device("meta"):
        model = GatedLM(cfg.model, vocab)
    assert lo < model.num_params() < hi
