"""What `eval` and `sample` print: stdout holds the result alone (JSON; the text), every log line goes to stderr;
and a missing checkpoint or run directory is named in one line (exit 2) saying what was expected there."""

from __future__ import annotations

import json

import pytest

from hybridtron.cli import main


@pytest.fixture(scope="module")
def run(small_data_dir, small_argv, tmp_path_factory):
    """A run directory with one checkpoint (2 steps of the small model)."""
    run = tmp_path_factory.mktemp("cli-output") / "run"
    assert main(small_argv(small_data_dir, run, ["--train.max_steps", "2", "--train.warmup_steps", "1",
                                                  "--train.eval_every", "0", "--train.eval_batches", "1"])) == 0
    return run


def test_eval_prints_only_its_json_on_stdout(run, capfd):
    capfd.readouterr()
    assert main(["eval", "--run-dir", str(run), "--batches", "1"]) == 0
    out, err = capfd.readouterr()
    result = json.loads(out)  # the whole of stdout, as `| jq .` reads it
    assert result["batches"] == 1 and result["val_loss"] > 0 and "checkpoints/step_" in result["checkpoint"]
    assert "[hybridtron]" in err  # the progress lines are still there, on stderr


def test_sample_prints_only_the_text_on_stdout(run, capfd):
    capfd.readouterr()
    assert main(["sample", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    out, err = capfd.readouterr()
    assert "[hybridtron" not in out and len(out.splitlines()) <= 6, out  # the text (5 tokens) and its newline
    assert main(["sample", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    assert capfd.readouterr().out == out  # greedy: the same text again, and nothing else


def one_error_line(capfd) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ": error: " in ln]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("command", [["eval"], ["sample"]])
def test_a_missing_or_wrong_checkpoint_is_named(command, run, tmp_path, capfd):
    missing = tmp_path / "nope"
    assert main(command + ["--checkpoint", str(missing)]) == 2
    line = one_error_line(capfd)
    assert f"--checkpoint {missing} does not exist" in line and "RUN_DIR/checkpoints/step_N" in line, line
    assert main(command + ["--checkpoint", str(run)]) == 2  # a run directory, not a checkpoint
    line = one_error_line(capfd)
    assert f"--checkpoint {run} is a run directory, not a checkpoint; pass --run-dir {run}" in line, line
    (tmp_path / "empty").mkdir()
    assert main(command + ["--checkpoint", str(tmp_path / "empty")]) == 2
    line = one_error_line(capfd)
    assert "is not a checkpoint: it has no config.yaml and no tokenizer/" in line and "the weights" in line, line
    assert main(command + ["--run-dir", str(missing)]) == 2
    assert f"--run-dir {missing} does not exist" in one_error_line(capfd)
    assert main(command + ["--run-dir", str(tmp_path / "empty")]) == 2
    line = one_error_line(capfd)
    assert f"--run-dir {tmp_path / 'empty'} has no checkpoint" in line and "train it first" in line, line


def test_export_of_a_missing_path_says_it_does_not_exist(tmp_path, capfd):
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    line = one_error_line(capfd)
    assert f"{tmp_path / 'nope'} does not exist" in line and "RUN_DIR/checkpoints/step_N" in line, line
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "hf")]) == 2
    assert "neither a checkpoint directory nor a run directory with checkpoints" in one_error_line(capfd)
    assert not (tmp_path / "hf").exists()
