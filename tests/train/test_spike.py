"""The loss-spike guard: scores, policies, and a skipped step that leaves the run exactly where it was."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from hybridtron.cli import main
from hybridtron.train.metrics import read_metrics
from hybridtron.train.spike import MAX_CONSECUTIVE_SKIPS, SpikeGuard


def _noisy(n, level, seed=0):
    rng = random.Random(seed)
    return [level * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(n)]


def test_scores_against_the_window_and_policies():
    losses, norms = _noisy(20, 3.0, 1), _noisy(20, 1.0, 2)
    for policy in ("warn", "skip", "stop"):
        g = SpikeGuard(policy, threshold=6.0, window=8)
        for a, b in zip(losses, norms, strict=True):
            assert g.allows(a, b)  # an ordinary step: applied
        recent = losses[-8:]
        mean, std = statistics.fmean(recent), statistics.pstdev(recent)
        spike = mean + 10 * std
        assert g.allows(spike, 1.0) is (policy == "warn")
        assert g.last["spike"] == 1 and g.last["spike_on"] == "loss"
        assert g.last["spike/loss_z"] == pytest.approx(10.0)
        rec = {"loss": spike, "grad_norm": 1.0}
        why = g.after_step(21, rec, log=lambda *_: None)
        assert rec["spike"] == 1 and (why is not None) == (policy == "stop")
        assert g.allows(mean, 1.0) and "spike" not in g.last  # the next ordinary step
    # a falling loss is never a spike; nor anything before the window is full
    g = SpikeGuard("skip", 6.0, 8)
    assert all(g.allows(x, 1.0) for x in [5.0] * 7 + [50.0])
    assert g.allows(0.1, 1.0)
    # a gradient-norm spike alone counts
    assert not g.allows(5.0, 100.0) and g.last["spike_on"] == "grad_norm"


def test_skip_stops_when_the_level_has_moved():
    g = SpikeGuard("skip", 6.0, 4)
    for x in _noisy(4, 1.0):
        g.allows(x, 1.0)
    whys = []
    for step in range(MAX_CONSECUTIVE_SKIPS + 1):
        assert not g.allows(10.0, 1.0)
        whys.append(g.after_step(step, {"loss": 10.0, "grad_norm": 1.0}, log=lambda *_: None))
    assert whys[:-1] == [None] * MAX_CONSECUTIVE_SKIPS and "in a row" in whys[-1]


def test_state_round_trip_decides_alike():
    a = SpikeGuard("skip", 3.0, 6)
    for x, y in zip(_noisy(9, 2.0, 3), _noisy(9, 1.0, 4), strict=True):
        a.allows(x, y)
    b = SpikeGuard("skip", 3.0, 6)
    b.load_state_dict(a.state_dict())
    for x in (2.0, 2.3, 2.6, 4.0):
        assert a.allows(x, 1.0) == b.allows(x, 1.0)
        assert a.last == b.last


def _inject_norm_spike(monkeypatch, at_step: int):
    """The gradient norm the trainer sees is 1e4 times the real one at step ``at_step`` (1-based)."""
    from hybridtron.train import engine as engine_mod
    from hybridtron.train import trainer as trainer_mod

    current = {}
    real_step, real_clip = trainer_mod.Trainer.train_step, engine_mod.clip_grad_norm

    def train_step(self):
        current["step"] = self.state.step + 1
        return real_step(self)

    def clip(params, max_norm):
        norm = real_clip(params, max_norm)
        return norm * 1e4 if current["step"] == at_step else norm

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", train_step)
    monkeypatch.setattr(engine_mod, "clip_grad_norm", clip)


@pytest.mark.slow
def test_skipped_step_leaves_the_model_and_resumes_exactly(small_data_dir, cli_args, tmp_path, monkeypatch, capsys):
    _inject_norm_spike(monkeypatch, at_step=7)
    extra = ["--train.max_steps", "10", "--train.eval_every", "0", "--train.spike_policy", "skip",
             "--train.spike_window", "4", "--train.spike_threshold", "1000"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(cli_args(small_data_dir, full, extra + ["--checkpoint.every", "1", "--checkpoint.keep_last", "10"])) == 0
    assert "step 7: loss spike: grad_norm" in capsys.readouterr().out
    recs = {r["step"]: r for r in read_metrics(full)}
    assert [s for s, r in recs.items() if r.get("spike")] == [7]
    assert all("spike/grad_norm_z" in recs[s] for s in range(5, 11))  # scored once the window holds 4 steps
    # the skipped step's update was never applied: weights and optimizer state as after step 6
    from safetensors.torch import load_file

    c6, c7 = (full / "checkpoints" / f"step_0000000{s}" for s in (6, 7))
    w6, w7 = load_file(c6 / "model.safetensors"), load_file(c7 / "model.safetensors")
    assert w6.keys() == w7.keys() and all(torch.equal(w6[k], w7[k]) for k in w6)
    o6, o7 = (torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in (c6, c7))
    assert all(torch.equal(o6[i][k], o7[i][k]) for i in o6 for k in o6[i])
    w8 = load_file(full / "checkpoints" / "step_00000008" / "model.safetensors")
    assert not all(torch.equal(w7[k], w8[k]) for k in w7)  # the next step is applied
    # a run stopped at step 5 resumes with the guard's history: the same scores, the same skip, the same losses
    assert main(cli_args(small_data_dir, split, extra + ["--checkpoint.every", "0", "--train.exit_interval", "5"])) == 0
    assert main(cli_args(small_data_dir, split, extra + ["--checkpoint.every", "0"])) == 0
    _same_but_timing(read_metrics(split), recs)


def _same_but_timing(got, want):
    timing = ("tokens_per_s", "peak_mem_gib", "mfu")
    got = {r["step"]: {k: v for k, v in r.items() if k not in timing} for r in got}
    want = {s: {k: v for k, v in r.items() if k not in timing} for s, r in want.items()}
    assert got == want  # bitwise: fp32 on the CPU


@pytest.mark.slow
def test_stop_policy_exits_3_without_saving(small_data_dir, cli_args, tmp_path, monkeypatch, capsys):
    _inject_norm_spike(monkeypatch, at_step=6)
    extra = ["--train.max_steps", "8", "--train.eval_every", "0", "--train.spike_policy", "stop",
             "--train.spike_window", "4", "--train.spike_threshold", "1000", "--checkpoint.every", "5"]
    run = tmp_path / "stop"
    assert main(cli_args(small_data_dir, run, extra)) == 3
    err = capsys.readouterr().err
    assert "training diverged: step 6: loss spike: grad_norm" in err and len(err.strip().splitlines()) == 1
    assert (run / "checkpoints" / "latest").read_text() == "step_00000005"
    assert read_metrics(run)[-1]["spike"] == 1
