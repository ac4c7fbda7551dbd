"""train.profile: a torch.profiler trace of the chosen steps per rank, memory snapshots (CUDA: faked here), and the
snapshot an out-of-memory error dumps and names."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from hybridtron.cli import main
from hybridtron.train import profile as profile_mod
from hybridtron.train import trainer as trainer_mod

SHORT = ["--train.max_steps", "4", "--train.warmup_steps", "1", "--train.eval_every", "0", "--checkpoint.every", "0"]


def trace_names(path) -> Counter:
    """How often each event name occurs in a Chrome trace file."""
    return Counter(e.get("name") for e in json.loads(path.read_text())["traceEvents"])


@pytest.mark.parametrize("steps", ["[0, 2]", "[3, 2]", "[2, 5]", "[2]", "[1, 2, 3]"])
def test_bad_steps_refused_in_one_line(steps, small_data_dir, cli_args, tmp_path, capsys):
    assert main(cli_args(small_data_dir, tmp_path / "run", SHORT + ["--train.profile.steps", steps])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.profile.steps=" in err and "train.max_steps=4" in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_trace_of_the_chosen_steps(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, SHORT + ["--train.profile.steps", "[2, 3]"])) == 0
    trace = run / "profile" / "steps2-3" / "rank0.pt.trace.json"
    names = trace_names(trace)
    # steps 2 and 3 only: step 1 was the discarded warmup, step 4 came after
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert names["aten::mm"] > 0 and names["aten::linear"] > 0  # the step's ops, with the optimizer's
    assert any(n.startswith("Optimizer.step#") for n in names)
    assert sorted(str(p.relative_to(run)) for p in (run / "profile").rglob("*")) == [
        "profile/steps2-3", "profile/steps2-3/rank0.pt.trace.json"]  # no scratch left behind
    assert f"trace of steps 2-3 written to {trace}" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_traces_what_is_left_and_nothing_past_last(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    prof = ["--train.profile.steps", "[2, 3]"]
    assert main(cli_args(small_data_dir, run, SHORT + prof + ["--train.exit_interval", "2"])) == 0  # stops at 2
    assert main(cli_args(small_data_dir, run, SHORT + prof)) == 0  # resumes at 3
    got = sorted(str(p.relative_to(run / "profile")) for p in (run / "profile").rglob("*.json"))
    assert got == ["steps2-2/rank0.pt.trace.json", "steps3-3/rank0.pt.trace.json"]
    for path, step in ((run / "profile" / g, g[5]) for g in got):
        assert sum(n.startswith("ProfilerStep#") for n in trace_names(path)) == 1, (path, step)
    capsys.readouterr()
    # resumed at step 5, past [2, 3]: no trace, one line says why
    assert main(cli_args(small_data_dir, run, SHORT + prof + ["--train.max_steps", "5"])) == 0
    assert "this run resumes at step 5, past them; no trace" in capsys.readouterr().out
    assert sorted(str(p.relative_to(run / "profile")) for p in (run / "profile").rglob("*.json")) == got


@pytest.mark.slow
def test_trace_per_rank_at_two_gloo_ranks(small_argv, small_data_dir, tmp_path):
    from .test_data_parallel import torchrun

    run = tmp_path / "dp2"
    r = torchrun(small_argv(small_data_dir, run, SHORT + ["--train.profile.steps", "[2, 2]"]))
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        names = trace_names(run / "profile" / "steps2-2" / f"rank{rank}.pt.trace.json")
        assert names["aten::mm"] > 0 and sum(n.startswith("ProfilerStep#") for n in names) == 1
        assert any("allreduce" in str(n) for n in names), rank  # DDP's gradient all-reduce, on each rank


@pytest.mark.slow
def test_memory_on_the_cpu_says_it_needs_cuda(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, SHORT + ["--train.profile.memory", "true"])) == 0
    assert "train.profile.memory: memory snapshots need CUDA and this run is on cpu: none taken" in \
        capsys.readouterr().out
    assert not (run / "profile").exists()


class FakeAllocatorHistory:
    """Stands in for CUDA's allocator history on the CPU: notes when recording starts and stops and at which
    trainer step a snapshot was dumped; the snapshot file holds that step."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        self.trainer = None
        real_step = trainer_mod.Trainer.train_step

        def train_step(trainer):
            self.trainer = trainer
            return real_step(trainer)

        monkeypatch.setattr(trainer_mod.Trainer, "train_step", train_step)
        monkeypatch.setattr(profile_mod, "memory_supported", lambda device: True)
        monkeypatch.setattr(profile_mod, "record_memory", lambda on: self.events.append(("record", on, self.done())))
        monkeypatch.setattr(profile_mod, "dump_memory", self.dump)

    def done(self) -> int | None:
        return self.trainer.state.step if self.trainer else None

    def dump(self, path: str) -> None:
        self.events.append(("dump", self.done()))
        with open(path, "w") as f:
            f.write(f"snapshot after step {self.done()}")


@pytest.mark.slow
def test_memory_snapshot_after_the_last_step(small_data_dir, cli_args, tmp_path, monkeypatch, capsys):
    fake = FakeAllocatorHistory(monkeypatch)
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, SHORT + ["--train.profile.steps", "[2, 3]",
                                                       "--train.profile.memory", "true"])) == 0
    # recording starts before step 2 (1 step done) and stops once step 3's snapshot is dumped
    assert fake.events == [("record", True, 1), ("dump", 3), ("record", False, 3)]
    snap = run / "profile" / "steps2-3" / "rank0.memory.pickle"
    assert snap.read_text() == "snapshot after step 3"
    assert f"memory snapshot written to {snap} (one per rank); open it at https://pytorch.org/memory_viz" in \
        capsys.readouterr().out


@pytest.mark.slow
def test_out_of_memory_dumps_a_snapshot_and_names_it(small_data_dir, cli_args, tmp_path, monkeypatch):
    fake = FakeAllocatorHistory(monkeypatch)
    real_step = trainer_mod.Trainer.train_step  # the fake's, which notes the trainer

    def step_that_runs_out(trainer):
        out = real_step(trainer)
        if trainer.state.step == 2:  # an allocation of step 2 fails, as CUDA's caching allocator reports it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", step_that_runs_out)
    run = tmp_path / "run"
    with pytest.raises(torch.OutOfMemoryError) as err:  # what an out-of-memory error does today: raised on
        main(cli_args(small_data_dir, run, SHORT + ["--train.profile.memory", "true"]))
    snap = run / "profile" / "oom_step2" / "rank0.memory.pickle"
    assert snap.read_text() == "snapshot after step 2"
    lines = str(err.value).splitlines()
    assert lines[0] == "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"
    assert lines[1:] == [f"memory snapshot at this out-of-memory error: {snap}; open it at "
                         f"https://pytorch.org/memory_viz"]
    assert fake.events == [("record", True, None), ("dump", 2), ("record", False, 2)]  # the whole run recorded


def test_kineto_markers_are_dropped_and_everything_else_kept(capfd):
    """kineto's STAGE:/USDT: lines, written by C++ to file descriptor 2 at each trace transition, are left out;
    what else reaches the descriptor meanwhile comes back, in order."""
    import os

    with profile_mod.without_kineto_markers():
        os.write(2, b"USDT:2026-11-28 03:41:26 5037:5037 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"an error of someone else\n")
        os.write(2, b"STAGE:2026-11-28 03:42:01 5192:5192 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n")
        os.write(2, b"USDT: a line of ours that only looks alike\n")
    assert capfd.readouterr().err == "an error of someone else\nUSDT: a line of ours that only looks alike\n"


def test_a_traced_run_prints_no_kineto_markers(small_data_dir, cli_args, tmp_path, capfd):
    assert main(cli_args(small_data_dir, tmp_path / "run", ["--train.max_steps", "3", "--train.profile.steps",
                                                             "[2, 3]", "--train.eval_every", "0"])) == 0
    err = capfd.readouterr().err
    assert "USDT:" not in err and "STAGE:" not in err, err
