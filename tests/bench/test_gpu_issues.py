"""bench/gpu_issues.py: every command it would run on the GPU is one its bench accepts (checked by each bench's own
argument parser, stopped right after parsing), and without a GPU it refuses to run instead of timing CPU kernels."""

from __future__ import annotations

import argparse
import importlib

import pytest

from hybridtron.bench import gpu_issues


class _Parsed(Exception):
    def __init__(self, args):
        self.args_ = args


BENCHES = [c for c in gpu_issues.COMMANDS if c[1] != "pytest"]


@pytest.mark.parametrize("name,module,extra", BENCHES, ids=[c[0] for c in BENCHES])
def test_every_command_parses_with_its_bench(name, module, extra, monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    bench = importlib.import_module(f"hybridtron.bench.{module}")
    with pytest.raises(_Parsed) as parsed:
        bench.main(list(extra))
    assert vars(parsed.value.args_), name


def test_a_bad_argument_is_caught_by_that_check(monkeypatch):
    """The check above can fail: an option the bench does not have ends in argparse's error, not in a parse."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    bench = importlib.import_module("hybridtron.bench.kernels")
    with pytest.raises(SystemExit):
        bench.main(["--ops", "delta_rule", "--no-such-option"])


def test_dry_run_lists_each_command_and_no_gpu_is_refused(capsys, monkeypatch):
    assert gpu_issues.main(["--dry-run", "--only", "delta_rule_conv", "train_moe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["delta_rule_conv", "train_moe"]
    assert "-m hybridtron.bench.kernels --ops delta_rule conv --no-append" in out[0]
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_issues.main(["--only", "delta_rule_conv"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_gpu_tests_it_names_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name, module, extra in gpu_issues.COMMANDS:
        if module == "pytest":
            files = [a for a in extra if a.endswith(".py")]
            assert files and all((root / f).is_file() for f in files), (name, files)
