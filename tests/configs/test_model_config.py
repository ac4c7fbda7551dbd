"""The architecture switches: layer patterns expand as documented, impossible combinations are refused
with the field, the value and what is allowed, and every CPU preset builds."""

from __future__ import annotations

import pytest

from hybridtron.configs import ConfigError, ModelConfig, load_config


@pytest.mark.parametrize(
    "pattern, n_layers, expected",
    [
        ("A", 3, ["A", "A", "A"]),
        ("LLLA", 8, list("LLLALLLA")),
        ("LLA", 3, list("LLA")),
        ("L", 2, ["L", "L"]),
        (["L", "full_attention", "linear_attention"], 3, ["L", "A", "L"]),
    ],
)
def test_layer_pattern_expands(pattern, n_layers, expected):
    cfg = ModelConfig(n_layers=n_layers, layer_pattern=pattern)
    cfg.validate()
    assert cfg.layer_types() == expected


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"layer_pattern": "LXA", "n_layers": 3}, ["layer_pattern", "'X'", "allowed"]),
        ({"layer_pattern": "LLA", "n_layers": 4}, ["layer_pattern", "length 3", "n_layers=4"]),
        ({"layer_pattern": ["L", "A"], "n_layers": 3}, ["layer_pattern", "2 layers", "n_layers=3"]),
        ({"layer_pattern": ""}, ["layer_pattern", "empty"]),
        ({"moe": {"n_experts": 4, "top_k": 5}}, ["model.moe.top_k=5", "n_experts=4"]),
        ({"moe": {"n_experts": 4, "layers": [7]}}, ["model.moe.layers", "layer 7"]),
        ({"deltanet": {"n_k_heads": 3, "n_v_heads": 4}}, ["n_v_heads=4", "n_k_heads=3", "multiple"]),
        ({"deltanet": {"n_householder": 0}}, ["n_householder=0"]),
        ({"ffn": {"kind": "lowrank", "rank": 1000}}, ["model.ffn.rank=1000", "min(d_model, ffn_hidden)"]),
        ({"ffn": {"kind": "blockshuffle", "n_blocks": 3}}, ["model.ffn.n_blocks=3", "divide"]),
        ({"ffn": {"kind": "blockdense", "n_blocks": 4, "rank": 30}}, ["model.ffn.rank=30", "multiple"]),
        ({"ffn": {"kind": "lowrank", "self_guided_fraction": 0.0}}, ["self_guided_fraction"]),
        ({"n_heads": 3}, ["n_heads=3", "d_model=128"]),
        ({"scale": {"two_sided": True}, "ffn": {"kind": "lowrank"}}, ["model.scale", "model.ffn.kind=lowrank"]),
    ],
)
def test_impossible_architectures_are_refused_with_the_field_named(overrides, words):
    from hybridtron.configs.base import from_dict

    with pytest.raises(ConfigError) as e:
        from_dict(ModelConfig, overrides).validate()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_dotted_overrides_reach_subsections():
    cfg = load_config("tiny", [("model.moe.n_experts", "4"), ("model.deltanet.neg_eigval", "true"),
                               ("model.layer_pattern", "LA")])
    assert cfg.model.moe.n_experts == 4 and cfg.model.deltanet.neg_eigval and cfg.model.layer_types() == list("LALA")
    with pytest.raises(ConfigError, match="unknown config key 'model.moe.n_expert'"):
        load_config("tiny", [("model.moe.n_expert", "4")])


def test_moe_placement():
    from hybridtron.configs.base import from_dict

    every2 = from_dict(ModelConfig, {"n_layers": 4, "moe": {"n_experts": 4, "every": 2}})
    assert [every2.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    listed = from_dict(ModelConfig, {"n_layers": 4, "moe": {"n_experts": 4, "layers": [0, 2]}})
    assert [listed.moe.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    off = from_dict(ModelConfig, {"n_layers": 4})
    assert not any(off.moe.is_moe_layer(i) for i in range(4))
