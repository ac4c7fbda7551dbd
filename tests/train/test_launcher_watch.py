"""Training processes end when their launcher dies (train/launcher_watch.py): a torchrun killed with SIGKILL used to
leave both workers of a tp2 job training on to their last step. Now each worker gets SIGTERM from the kernel
(PR_SET_PDEATHSIG) or from its own poll of the parent, checkpoints at the end of the step and exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtron.train.checkpoint import MANIFEST, CheckpointManager, verify_manifest
from hybridtron.train.metrics import read_metrics
from hybridtron.train.run_dir import LAST_STOP

from .test_data_parallel import _workers


def _gone(pid: int) -> bool:
    """Exited (a zombie whose new parent has not reaped it yet has exited too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pids, seconds: float) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` for them to exit."""
    deadline = time.time() + seconds
    while time.time() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A parent (the launcher's stand-in) that starts a child which watches it, prints the child's pid and waits.
CHILD = ("import sys, time; from hybridtron.train.launcher_watch import watch_parent; "
         "print(watch_parent(use_prctl=sys.argv[1] == 'prctl'), flush=True); time.sleep(120)")
PARENT = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
          "stdout=open(sys.argv[3], 'w')); print(c.pid, flush=True); time.sleep(120)")


@pytest.mark.parametrize("how", ["prctl", "poll"])
def test_a_watching_process_ends_when_its_parent_is_killed(how, tmp_path):
    out = tmp_path / "child.out"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, how, str(out)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        deadline = time.time() + 30
        while not out.exists() or not out.read_text().strip():
            assert time.time() < deadline, "the child never started watching"
            time.sleep(0.05)
        assert out.read_text().strip() == how  # prctl works on this Linux; poll is what other systems get
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone([child], 5) == [], f"the child ({how}) outlived its parent"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the child shares its session
        parent.wait()
        if child is not None:
            _kill([child])


def test_a_parent_gone_before_the_watch_began_ends_the_process_at_once(tmp_path):
    """The race the kernel cannot cover: the parent died before prctl; the process sees its parent has changed."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    code = ("import sys, time; from hybridtron.train.launcher_watch import watch_parent; "
            f"watch_parent(parent={dead.pid}); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_killing_torchrun_stops_its_tp2_workers_with_a_complete_checkpoint(small_data_dir, small_argv, tmp_path):
    run = tmp_path / "run"
    flat = ["--train.schedule", "constant", "--train.warmup_steps", "0", "--train.eval_every", "0",
            "--checkpoint.every", "3", "--parallel.tp", "2", "--train.max_steps", "100000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "hybridtron.cli", *small_argv(small_data_dir, run, flat)]
    log = tmp_path / "job.log"  # a file, not a pipe: the orphans would block on a full pipe nobody reads
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 2:
            assert time.time() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        workers = list(_workers(job.pid).values())
        assert len(workers) == 2, workers
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        left = _wait_gone(workers, 10)
        steps = [r["step"] for r in read_metrics(run)]
        assert left == [], f"workers {left} trained on after torchrun died (to step {steps[-1]})"
    finally:
        _kill([job.pid, *workers])  # the workers run in sessions of their own
        job.wait()
    out = log.read_text()
    assert "received signal SIGTERM; saving a checkpoint at step" in out, out[-3000:]
    stop = json.loads((run / LAST_STOP).read_text())
    latest = CheckpointManager(run).latest()
    assert stop["stopped_by"] == "signal" and latest.name == stop["checkpoint"] == f"step_{stop['step']:08d}", stop
    assert (latest / MANIFEST).is_file()
    verify_manifest(latest)  # every file there, with its digest
    assert stop["step"] == read_metrics(run)[-1]["step"]  # nothing trained after the stop's checkpoint
