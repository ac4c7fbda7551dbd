"""The presets build at the sizes their names and comments promise (GPU presets on the meta device, no
memory), and every CPU preset runs a training step of its own architecture."""

import pytest
import torch

from hybridtron.configs import load_config
from hybridtron.model import GatedLM


def meta_model(name: str) -> GatedLM:
    cfg = load_config(name)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    with torch.device("meta"):
        return GatedLM(cfg.model, vocab)


@pytest.mark.parametrize(
    "name, lo, hi",
    [("dense_125m", 110e6, 135e6), ("dense_1b", 0.9e9, 1.1e9), ("hybrid_1b", 0.95e9, 1.15e9),
     ("hybrid_moe", 1.3e9, 1.55e9)],
)
def test_preset_sizes(name, lo, hi):
    assert lo < meta_model(name).num_params() < hi


def test_hybrid_presets_are_3_to_1_and_moe_is_sparse():
    for name in ("hybrid_1b", "hybrid_moe", "tiny_hybrid"):
        types = load_config(name).model.layer_types()
        assert types.count("L") == 3 * types.count("A") and types[3::4] == ["A"] * (len(types) // 4), name
    moe = meta_model("hybrid_moe")
    assert 0.3e9 < moe.num_active_params() < 0.45e9
    assert moe.layers[0].mlp.shared_expert is not None


@pytest.mark.parametrize(
    "name, feature",
    [
        ("tiny_hybrid", lambda m: hasattr(m.layers[0], "linear_attn") and hasattr(m.layers[3], "self_attn")),
        ("tiny_deltaproduct", lambda m: m.layers[0].linear_attn.n_h == 2 and m.layers[0].linear_attn.neg_eigval),
        ("tiny_moe", lambda m: type(m.layers[1].mlp).__name__ == "MoE" and type(m.layers[0].mlp).__name__ == "SwiGLU"),
        ("tiny_structured", lambda m: type(m.layers[1].mlp).__name__ == "StructuredSwiGLU"),
        ("tiny_scale", lambda m: type(m.layers[0].self_attn.q_proj).__name__ == "ScaledLinear"),
        ("tiny_hax", lambda m: all(layer.linear_attn.hax.sources == ("lsh", "key_selection") for layer in m.layers)),
    ],
)
def test_cpu_presets_build_their_architecture_and_train_a_step(name, feature):
    cfg = load_config(name, [("data.seq_len", "32")])
    model = GatedLM(cfg.model, 256)
    torch.manual_seed(0)
    model.init_weights()
    assert feature(model)
    x = torch.randint(0, 256, (2, 32))
    loss = model(x, labels=x)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
