"""Pins (train/checkpoint_pins.py): the checkpoint an export reads survives keep_last pruning while pinned, through
the very call ``hybridtron export`` makes, and goes at the first save after its pin is released; a pin whose reader
is gone (killed, or a file nobody holds a lock on) does not keep anything."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridtron.atomic import this_host
from hybridtron.train.checkpoint import CheckpointManager, TrainerState, step_dir_name
from hybridtron.train.checkpoint_pins import PINS, pinned
from hybridtron.train.hf.export import resolve_checkpoint


@pytest.fixture
def saving(tmp_path):
    """(a run directory, save(*steps): one-process checkpoints of a small model there, keep_last=2)"""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    run = tmp_path / "run"
    mgr = CheckpointManager(run, keep_last=2)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def save(*steps: int) -> None:
        for s in steps:
            mgr.save(TrainerState(step=s), model, opt, "model: {}\n", tok)

    return run, save


def steps(run: Path) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in CheckpointManager(run).complete()]


def pin_path(run: Path, step: int, pid: int) -> Path:
    return run / "checkpoints" / PINS / f"{step_dir_name(step)}.{this_host()}-{pid}"


def test_a_pinned_checkpoint_outlives_keep_last_until_a_save_after_its_release(saving):
    run, save = saving
    save(1, 2)
    with pinned(lambda: resolve_checkpoint(run)) as ckpt:  # what `hybridtron export RUN` pins: the latest
        assert ckpt == run / "checkpoints" / "step_00000002"
        save(3, 4, 5)
        assert steps(run) == [2, 4, 5]  # 3 pruned; 2, past keep_last, kept for the reader
        assert (ckpt / "tokenizer" / "tokenizer.json").is_file()
    assert not (run / "checkpoints" / PINS).exists()  # the reader's pin goes with it
    assert steps(run) == [2, 4, 5]  # reclaimed at the next save, not by the reader
    save(6)
    assert steps(run) == [5, 6]


def test_a_pin_of_a_killed_reader_does_not_keep_its_checkpoint(saving):
    run, save = saving
    save(1)
    code = ("import sys, time; from pathlib import Path; from hybridtron.train.checkpoint_pins import pinned\n"
            "with pinned(lambda: Path(sys.argv[1])):\n    print('pinned', flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run / "checkpoints" / "step_00000001")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "pinned\n"
        save(2, 3)
        assert steps(run) == [1, 2, 3]  # another process's live pin counts
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert pin_path(run, 1, proc.pid).is_file()  # a killed reader leaves its file; its lock died with it
    save(4)
    assert steps(run) == [3, 4]
    assert not (run / "checkpoints" / PINS).exists()  # the stale pin removed too


@pytest.mark.parametrize("holder", ["dead_pid", "live_pid"])
def test_a_pin_file_without_its_lock_is_stale(holder, saving, request):
    """The lock pins, not the file: even a live pid's file (reused pid, a copied directory) keeps nothing."""
    run, save = saving
    save(1)
    pin = pin_path(run, 1, request.getfixturevalue(holder))
    pin.parent.mkdir()
    pin.touch()
    save(2, 3)
    assert steps(run) == [2, 3] and not pin.parent.exists()


@pytest.mark.parametrize("holder, kept", [("dead_pid", False), ("live_pid", True)])
def test_without_file_locks_the_pid_judges_a_pin_of_this_host(holder, kept, saving, request, monkeypatch):
    run, save = saving
    save(1)
    pin = pin_path(run, 1, request.getfixturevalue(holder))
    pin.parent.mkdir()
    pin.touch()

    def no_locks(fd, op):
        raise OSError(37, "No locks available")  # ENOLCK: an NFS mount without a lock daemon

    monkeypatch.setattr(fcntl, "flock", no_locks)
    save(2, 3)
    assert steps(run) == ([1, 2, 3] if kept else [2, 3]) and pin.exists() == kept
