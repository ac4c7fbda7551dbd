"""`hybridtron ablate`: variants of one preset on the same data and steps -> table, JSON and loss plot."""

from __future__ import annotations

import json
import re

import pytest

from hybridtron.train.ablate import parse_variant
from hybridtron.train.cli import main


def ablate_argv(cli_args, data_dir, out, variants, extra=()):
    argv = cli_args(data_dir, out, ["--train.max_steps", "4", "--train.warmup_steps", "1", "--train.eval_every", "2",
                                    "--checkpoint.every", "0", *extra])
    argv[0] = "ablate"
    for v in variants:
        argv += ["--variant", v]
    return argv


@pytest.mark.slow
def test_ablate_writes_table_json_and_plot(small_data_dir, cli_args, tmp_path, capsys):
    out = tmp_path / "abl"
    variants = ["base:", "moe:model.moe.n_experts=4,model.moe.top_k=1", "hybrid:model.layer_pattern=LA"]
    assert main(ablate_argv(cli_args, small_data_dir, out, variants)) == 0
    res = json.loads((out / "ablation.json").read_text())["variants"]
    assert list(res) == ["base", "moe", "hybrid"]
    for name, r in res.items():
        assert r["steps"] == 4, name
        assert 0 < r["final_train_loss"] < 10 and 0 < r["final_val_loss"] < 10
        assert r["tokens_per_s"] > 0
        metrics = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert r["final_val_loss"] == [m["val_loss"] for m in metrics if "val_loss" in m][-1]
    assert res["base"]["params"] == res["base"]["active_params"]
    assert res["moe"]["active_params"] < res["moe"]["params"]  # 4 experts, one active per token
    assert res["moe"]["overrides"] == [["model.moe.n_experts", "4"], ["model.moe.top_k", "1"]]
    # Same data: the first step's loss of the base and hybrid runs differ only through the model, so
    # both runs read the same batch (tokens_seen equal at every step).
    seen = {n: [json.loads(x)["tokens_seen"] for x in (out / n / "metrics.jsonl").read_text().splitlines()
                if "tokens_seen" in x] for n in res}
    assert seen["base"] == seen["moe"] == seen["hybrid"]
    table = (out / "ablation.md").read_text()
    assert "| moe | model.moe.n_experts=4, model.moe.top_k=1 | 4 |" in table
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "| hybrid |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "variants, message",
    [
        (["a:model.layer_pattern=LQ"], "at least two"),
        (["a:", "b:model.layer_pattern=LQ"], "variant 'b'.*unknown"),
        (["a:", "b:data.seq_len=32"], "variant 'b' overrides data.seq_len"),
        (["a:", "b:train.max_steps=9"], "variant 'b' overrides train.max_steps"),
        (["a:", "a:model.n_layers=4"], "used twice"),
        (["a:", "b/c:"], "names a directory"),
        (["a:", "bmodel.n_layers=4"], "NAME:KEY=VALUE"),
    ],
)
def test_bad_variants_are_refused_before_training(variants, message, small_data_dir, cli_args, tmp_path, capsys):
    out = tmp_path / "abl"
    assert main(ablate_argv(cli_args, small_data_dir, out, variants)) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not out.exists()  # nothing trained, nothing written


def test_parse_variant():
    assert parse_variant("x:model.moe.every=2, model.moe.top_k=1") == ("x", [("model.moe.every", "2"),
                                                                            ("model.moe.top_k", "1")])
    assert parse_variant("base:") == ("base", [])
