"""A mistyped config key, preset or command names the closest one in its one line (issue 39.3)."""

from __future__ import annotations

import pytest

from hybridtron.cli import main
from hybridtron.configs import ConfigError, JobConfig, config_from_dict, load_config
from hybridtron.configs.base import suggest_key


@pytest.mark.parametrize(("typed", "meant"), [
    ("train.lerning_rate", "train.lr"),  # the case: through the name other trainers use (learning_rate)
    ("train.learning_rate", "train.lr"),
    ("trian.lr", "train.lr"),  # a mistyped section
    ("trian.lerning_rate", "train.lr"),  # both
    ("model.moe.n_expert", "model.moe.n_experts"),  # a nested section's field
    ("model.lr", "train.lr"),  # a field of another section
    ("lr", "train.lr"),  # no section at all
    ("train.seq_len", "data.seq_len"),
    ("parallel.tensor_model_parallel_size", "parallel.tp"),  # Megatron's flag
    ("train.LR", "train.lr"),
])
def test_the_closest_key(typed, meant):
    assert suggest_key(JobConfig, typed) == meant


def test_nothing_close_suggests_nothing():
    assert suggest_key(JobConfig, "model.zzz") is None
    assert suggest_key(JobConfig, "model.moe.xyzzy") is None
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [("model.zzz", "1")])
    assert "did you mean" not in str(e.value) and "allowed:" in str(e.value)


def test_an_override_says_the_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lerning_rate': 'lerning_rate' is not in "
                                          r"train; did you mean 'train.lr'\? allowed: \["):
        load_config("tiny", [("train.lerning_rate", "1e-3")])


def test_a_yaml_key_says_the_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key train.'warmup_step'; did you mean "
                                          r"'train.warmup_steps'\? allowed keys in train"):
        config_from_dict({"train": {"warmup_step": 10}})


def test_a_preset_says_the_closest_preset(tmp_path):
    with pytest.raises(ConfigError, match=r"config 'dense1b' is neither a file nor a preset; did you mean "
                                          r"'dense_1b'\? presets: \["):
        load_config("dense1b")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "nothing_like_any.yaml"))
    assert "did you mean" not in str(e.value)


def test_the_command_line_says_each(capsys):
    with pytest.raises(SystemExit) as e:
        main(["trian"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'trian'" in err and "did you mean 'train'?" in err, err
    with pytest.raises(SystemExit):
        main(["xyzzy"])
    assert "did you mean" not in capsys.readouterr().err
    assert main(["train", "--train.lerning_rate", "1e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did you mean 'train.lr'?" in err, err
    assert main(["plan", "--config", "dense1b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did you mean 'dense_1b'?" in err, err


@pytest.mark.parametrize(("argv", "said"), [
    (["train", "--run-dri", "runs/x"], "unknown option --run-dri; did you mean --run-dir?"),
    (["sample", "--top_k", "3"], "unknown option --top_k; did you mean --top-k?"),
    (["eval", "--chekpoint", "x"], "unknown option --chekpoint; did you mean --checkpoint?"),
])
def test_a_mistyped_flag_says_the_closest_flag(argv, said, capsys):
    """Leftover arguments are taken for dotted overrides: a section-less one close to a flag was reported as an
    unknown config key, naming the config's sections."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and said in err, err


@pytest.mark.parametrize(("argv", "said"), [
    (["export", "runs/x", "--out", "o", "--no-chek"], "unrecognized arguments: --no-chek; did you mean --no-check?"),
    (["status", "runs/x", "--jsn"], "unrecognized arguments: --jsn; did you mean --json?"),
    (["status", "runs/x", "--train.max_steps", "3"], "unrecognized arguments: --train.max_steps 3"),
])
def test_commands_without_overrides_refuse_unknown_flags(argv, said, capsys, tmp_path, monkeypatch):
    """export and status take no config overrides: an unknown flag was silently ignored (the export ran)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1] == f"hybridtron {argv[0]}: error: {said}", err
    assert not (tmp_path / "o").exists()
