"""A run shorter than the preset's warm-up trains: the warm-up is scaled down to a tenth of the run, with one log
line saying so, the saved schedule is the scaled one, and a longer resume keeps the curve the run was on."""

from __future__ import annotations

import json
import math

import pytest

from hybridtron.cli import main
from hybridtron.configs import TrainConfig, load_config
from hybridtron.train.schedule import Plan, resume_plan, warmup_steps

FLAT = ["--train.eval_every", "0", "--train.eval_batches", "1", "--train.log_every", "1"]


def lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "lr" in r}


def test_every_preset_accepts_a_30_step_run():
    for preset in ("tiny", "dense_125m", "dense_1b", "hybrid_1b", "hybrid_moe"):
        cfg = load_config(preset, [("train.max_steps", "30")])  # the issue: refused for every preset
        assert 0 < warmup_steps(cfg.train) < 30


def test_the_scaled_warm_up_ramps_then_the_cosine_decays():
    cfg = TrainConfig(max_steps=30, warmup_steps=30, lr=1.0, min_lr_ratio=0.1)
    plan = Plan.from_config(cfg)
    assert plan.warmup == 3  # a tenth of 30
    assert [plan.lr(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    decay = [plan.lr(s) for s in range(3, 31)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False)) and decay[-1] == pytest.approx(0.1)
    assert warmup_steps(TrainConfig(max_steps=1, warmup_steps=20)) == 0  # never the whole run
    assert warmup_steps(TrainConfig(max_steps=10, warmup_steps=20, schedule="constant")) == 20  # no decay to save
    assert warmup_steps(TrainConfig(max_steps=30, warmup_steps=29)) == 29  # below max_steps: as asked


def test_a_longer_resume_keeps_the_scaled_curve_and_says_nothing_was_changed():
    short = TrainConfig(max_steps=30, warmup_steps=40)
    old = Plan.from_config(short)
    # the same config at another length: the warm-up the config now asks (40) is not applied under keep
    new, msg = resume_plan(old, TrainConfig(max_steps=100, warmup_steps=40), 30, "keep")
    assert new == old and "train.warmup_steps=40 (the checkpoint's: 3)" in msg
    # a length that still scales the warm-up to the same 3 steps changes nothing but the end
    _, msg = resume_plan(old, TrainConfig(max_steps=39, warmup_steps=40), 30, "keep")
    assert "not applied" not in msg


def test_train_max_steps_5_with_the_default_warm_up(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert TrainConfig().warmup_steps == 20  # the default
    assert main(cli_args(small_data_dir, run, FLAT + ["--train.max_steps", "5", "--train.warmup_steps", "20"])) == 0
    out = capsys.readouterr().out
    notes = [ln for ln in out.splitlines() if "train.warmup_steps=20 is not below train.max_steps=5" in ln]
    assert len(notes) == 1 and "over 1 step" in notes[0] and "--train.warmup_steps" in notes[0], out
    assert sorted(lrs(run)) == [1, 2, 3, 4, 5]


def test_a_short_run_ramps_over_its_scaled_warm_up_and_a_longer_resume_keeps_its_curve(small_data_dir, cli_args,
                                                                                       tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, FLAT + ["--train.max_steps", "20", "--train.warmup_steps", "20"])) == 0
    assert "warming up over 2 steps" in capsys.readouterr().out
    first = lrs(run)
    peak = 3e-3  # the tiny preset's train.lr
    assert load_config("tiny").train.lr == peak
    assert first[1] == pytest.approx(peak / 2) and first[2] == pytest.approx(peak)  # step k logs the LR of k-1
    assert first[20] == pytest.approx(peak * 0.1 + 0.5 * peak * 0.9 * (1 + math.cos(math.pi * 17 / 18)))
    state = json.loads(next(run.glob("checkpoints/*/trainer_state.json")).read_text())
    assert state["extra"]["schedule"]["warmup"] == 2
    # resumed to 26 steps (keep): the curve the run was on, holding its floor past step 20; no new warm-up note
    assert main(cli_args(small_data_dir, run, FLAT + ["--train.max_steps", "26", "--train.warmup_steps", "20"])) == 0
    out = capsys.readouterr().out
    assert "is not below" not in out and "train.warmup_steps=20 (the checkpoint's: 2)" in out, out
    resumed = lrs(run)
    assert {s: resumed[s] for s in first} == first
    assert [resumed[s] for s in range(21, 27)] == pytest.approx([peak * 0.1] * 6)
