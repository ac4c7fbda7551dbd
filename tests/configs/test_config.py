"""Bad config input fails at once with a message naming the field, the value and what is allowed."""

import pytest
import yaml

from hybridtron.configs import ConfigError, JobConfig, load_config, parse_overrides, resolve_preset
from hybridtron.train.parallel.layout import Layout


def test_presets_load_and_validate():
    for name in ("tiny", "dense_125m", "dense_1b"):
        cfg = load_config(name)
        assert isinstance(cfg, JobConfig)
    tiny = load_config("tiny")
    assert tiny.model.n_layers == 4 and tiny.data.seq_len == 128


def test_overrides_apply_with_types():
    cfg = load_config("tiny", parse_overrides(["--train.max_steps", "70", "--model.n_layers=2", "--train.lr", "1e-3",
                                                "--model.attn_gate", "headwise", "--model.qk_norm", "false"]))
    assert cfg.train.max_steps == 70 and cfg.model.n_layers == 2 and cfg.train.lr == 1e-3
    assert cfg.model.attn_gate == "headwise" and cfg.model.qk_norm is False


def test_list_override_of_sources():
    cfg = load_config("tiny", [("data.sources", "[{path: a.jsonl, weight: 2}, {path: b}]")])
    assert [s.path for s in cfg.data.sources] == ["a.jsonl", "b"] and cfg.data.sources[0].weight == 2.0


@pytest.mark.parametrize(
    "overrides, needles",
    [
        ([("model.n_layerz", "3")], ["model.n_layerz", "n_layers"]),
        ([("modle.n_layers", "3")], ["modle", "allowed"]),
        ([("model.n_layers", "four")], ["model.n_layers", "'four'", "integer"]),
        ([("train.lr", "fast")], ["train.lr", "number"]),
        ([("model.qk_norm", "3")], ["model.qk_norm", "true/false"]),
        ([("model.attn_gate", "sideways")], ["model.attn_gate", "sideways", "elementwise", "headwise", "none"]),
        ([("model.n_heads", "3")], ["model.n_heads=3", "model.d_model=128"]),
        ([("model.n_kv_heads", "3")], ["model.n_kv_heads=3", "model.n_heads=4"]),
        ([("data.seq_len", "1024")], ["data.seq_len=1024", "model.max_seq_len=256"]),
        ([("model.rotary_fraction", "0.01")], ["model.rotary_fraction"]),
        ([("data.tokenizer.vocab_size", "100")], ["data.tokenizer.vocab_size=100", "259"]),
        ([("data.tokenizer.kind", "pretrained")], ["data.tokenizer.path"]),
        ([("train.device", "tpu")], ["train.device", "'tpu'"]),
        ([("checkpoint.keep_last", "0")], ["checkpoint.keep_last=0"]),
        ([("data.sources", "[{path: x, wieght: 2}]")], ["wieght", "weight"]),
        ([("parallel.zero_stage", "4")], ["parallel.zero_stage=4", "0, 1, 2 or 3"]),
        ([("parallel.zero_stage", "1")], ["parallel.zero_stage=1", "parallel.engine=deepspeed"]),
        ([("parallel.dp", "0")], ["parallel.dp=0", "-1"]),
        ([("parallel.cp", "2"), ("parallel.engine", "deepspeed")], ["parallel.cp > 1", "engine=torch", "parallel.cp=1"]),
        ([("parallel.pp", "0")], ["parallel.pp=0", "positive"]),
        ([("parallel.cp", "2"), ("model.kernels.attention", "flash-attn")],
         ["model.kernels.attention=flash-attn", "parallel.cp=2", "ring attention", "sdpa, triton or reference"]),
        ([("parallel.backend", "mpi")], ["parallel.backend", "'mpi'"]),
    ],
)
def test_bad_input_names_field_value_and_allowed(overrides, needles):
    with pytest.raises(ConfigError) as e:
        Layout.from_config(load_config("tiny", overrides), 2)  # the sections' own checks, then the layout's
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} missing from {msg!r}"


def test_unknown_key_in_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"model": {"d_model": 64, "n_head": 4}}))
    with pytest.raises(ConfigError, match="n_head"):
        load_config(str(f))


def test_missing_preset_lists_presets():
    with pytest.raises(ConfigError, match="tiny"):
        resolve_preset("no_such_preset")


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["--train.max_steps"])
    with pytest.raises(ConfigError, match="--section.field"):
        parse_overrides(["train.max_steps", "3"])


def test_resolve_vocab():
    cfg = load_config("tiny")
    assert cfg.model.resolve_vocab(4099) == 4160  # rounded up to vocab_multiple=64
    cfg.model.vocab_size = 100
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        cfg.model.resolve_vocab(4096)


def test_yaml_round_trip():
    cfg = load_config("dense_1b")
    from hybridtron.configs import config_from_dict

    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
