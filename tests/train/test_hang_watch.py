"""Hangs and stragglers (train/watchdog.py), as a user meets them: a rank stopped by the kernel (SIGSTOP) in the
middle of a tp2 or dp2 run under torchrun, and a rank slowed from outside to half the hang timeout per step.

The stopped rank's peers must exit within train.hang_timeout_s + 30 s with a line naming it, the run directory must
say why (last_stop.json, the stacks in hang/), and the same command must resume from the latest checkpoint to the
same losses the hung attempt logged for the steps it retrains. The slowed rank must not be taken for a hung one, and
must be named as a straggler (log, metrics.jsonl)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridtron.train.metrics import read_metrics
from hybridtron.train.run_dir import LAST_STOP
from hybridtron.train.watchdog import HANG_EXIT, diagnose, find_stragglers

from .test_data_parallel import _workers
from .test_launcher_watch import _gone, _kill, _wait_gone

TIMEOUT = 8  # train.hang_timeout_s of these runs
FLAT = ["--train.schedule", "constant", "--train.warmup_steps", "0", "--train.eval_every", "0",
        "--train.hang_timeout_s", str(TIMEOUT)]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HYBRIDTRON_DEBUG"):
        env.pop(k, None)
    return env


def _torchrun(argv, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "hybridtron.cli", *argv]
    with open(log, "w") as f:  # a file, not a pipe: nobody reads a pipe while the test waits
        return subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_steps(job, run: Path, log: Path, n: int, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < n:
        assert time.time() < deadline and job.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


# ---- the decisions, on readings written by hand -----------------------------------------------------------------

def _e(step, count, beat, phase="backward", host="h"):
    return {"step": step, "count": count, "beat": beat, "phase": phase, "host": host, "pid": 1}


def test_diagnose_names_frozen_and_behind_ranks_and_sees_movement():
    first = [_e(5, 3, 10), _e(5, 3, 7), _e(5, 1, 4, "data", "n2"), None]
    second = [_e(5, 3, 14), _e(5, 3, 7), _e(5, 1, 9, "data", "n2"), None]
    late, moving = diagnose(first, second)
    assert not moving
    assert [r for r, _ in late] == [1, 2, 3]
    assert "not responding" in late[0][1] and "behind" in late[1][1] and "host n2, in data at step 5" in late[1][1]
    assert "never reported" in late[2][1]
    # a rank whose place changed between the readings: a slow but alive job, not a hang
    _, moving = diagnose(first, [_e(5, 3, 14), _e(5, 4, 8), _e(5, 1, 9), None])
    assert moving


def test_find_stragglers_by_busy_time_and_by_time_not_running():
    def t(rank, step_s, wait_s, stall_s=0.0):
        return {"rank": rank, "host": f"n{rank}", "step_s": step_s, "data_s": 0.01, "wait_s": wait_s,
                "stall_s": stall_s, "compute_s": step_s - wait_s - 0.01, "busy_s": step_s - wait_s}
    even = [t(r, 1.0, 0.1) for r in range(4)]
    assert find_stragglers(even, 0.2) == []
    slow = [*even[:3], t(3, 1.0, 0.0)]  # busy 1.0 against a median of 0.9: 11% slower, within the margin
    assert find_stragglers(slow, 0.2) == []
    slow = [t(0, 2.0, 1.0), t(1, 2.0, 1.0), t(2, 2.0, 1.1), t(3, 2.0, 0.0)]  # the others wait half a step for 3
    found = find_stragglers(slow, 0.2)
    assert [s["rank"] for s in found] == [3] and found[0]["host"] == "n3" and found[0]["median_busy_s"] == 1.0
    assert found[0]["slower"] == 1.0  # busy 2.0 s against a median of 1.0
    # the same busy time (its peers' waits hide in the model's collectives), but not running for 3 of 4 steps' time:
    # 0.75 s above the median of the two (0.75) per 2 s step
    stopped = [t(0, 2.0, 0.5), t(1, 2.0, 0.5, stall_s=1.5)]
    found = find_stragglers(stopped, 0.2)
    assert [s["rank"] for s in found] == [1] and found[0]["slower"] == 0.375
    assert find_stragglers(slow, 0.0) == []  # margin 0: not looked for


# ---- under torchrun -----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallel.tp", "2"], ["--parallel.dp", "2"]], ids=["tp2", "dp2"])
def test_a_stopped_rank_is_named_and_the_rerun_resumes_to_the_same_losses(layout, small_data_dir, small_argv,
                                                                           tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    argv = small_argv(small_data_dir, run, [*FLAT, *layout, "--checkpoint.every", "5", "--train.max_steps", "20"])
    job = _torchrun(argv, log)
    workers: dict[int, int] = {}
    try:
        _wait_steps(job, run, log, 8)  # past the first checkpoint (step 5), mid-run
        workers = _workers(job.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.time()
        left = _wait_gone([workers[0]], TIMEOUT + 30)
        took = time.time() - stopped_at
        assert left == [], f"rank 0 still running {took:.0f} s after rank 1 stopped\n{log.read_text()[-3000:]}"
        job.wait(timeout=60)  # torchrun ends the stopped rank (SIGKILL after its grace) and exits
    finally:
        _kill([job.pid, *workers.values()])
        job.wait()
    out = log.read_text()
    line = next((ln for ln in out.splitlines() if "hang: no progress" in ln and "rank 0/2" in ln), None)
    assert line is not None, out[-3000:]
    assert "rank 1 (host" in line and "not responding" in line and "did not arrive" in line, line
    assert f"exiting with code {HANG_EXIT}" in line and "step_000000" in line, line
    assert job.returncode != 0
    causes = [ln for ln in out.splitlines() if "traceback :" in ln]  # torchrun's summary: the root cause is ours
    assert causes and "hang: no progress" in causes[-1], out[-3000:]
    stop = json.loads((run / LAST_STOP).read_text())
    assert stop["stopped_by"] == "hang" and stop["late_ranks"] == [1] and stop["exit_code"] == HANG_EXIT, stop
    stacks = run / "hang" / "stacks-rank0.txt"
    assert str(stacks) in line and "Thread" in stacks.read_text()
    recorder = run / "hang" / "flight-recorder-rank0.json"  # torch's record of the last collectives, gloo's too
    assert str(recorder) in line
    last = json.loads(recorder.read_text())["entries"][-1]
    assert last["profiling_name"].startswith("gloo:") and last["state"] != "completed", last
    hung = {r["step"]: r["loss"] for r in read_metrics(run)}
    resumed_from = int(stop["checkpoint"].split("_")[1])
    retrained = [s for s in hung if s > resumed_from]
    assert retrained, (resumed_from, sorted(hung))

    # the same command again: resumes from the latest checkpoint, retrains the lost steps to the same losses
    job = _torchrun(argv, log)
    try:
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        _kill([job.pid])
    again = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert [again[s] for s in retrained] == [hung[s] for s in retrained]
    assert max(again) == 20 and json.loads((run / LAST_STOP).read_text())["stopped_by"] == "max_steps"


def _slow_down(pid: int, stop_s: float, run_s: float, until: threading.Event) -> None:
    """A rank slowed from outside: stopped for stop_s, running for run_s, until told (a noisy neighbour)."""
    while not until.is_set() and not _gone(pid):
        try:
            os.kill(pid, signal.SIGSTOP)
            until.wait(stop_s)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        until.wait(run_s)


@pytest.mark.slow
def test_a_slow_rank_is_named_as_a_straggler_and_not_stopped(small_data_dir, small_argv, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    argv = small_argv(small_data_dir, run, [*FLAT, "--parallel.dp", "2", "--checkpoint.every", "0",
                                            "--train.max_steps", "60"])
    job = _torchrun(argv, log)
    done = threading.Event()
    workers: dict[int, int] = {}
    try:
        _wait_steps(job, run, log, 3)
        workers = _workers(job.pid)
        # half the hang timeout stopped, then a second running: a step of rank 1 takes about TIMEOUT / 2
        slow = threading.Thread(target=_slow_down, args=(workers[1], TIMEOUT / 2, 1.0, done), daemon=True)
        slow.start()
        deadline = time.time() + 120
        while not any("stragglers" in r for r in read_metrics(run)):
            assert job.poll() is None, f"the job ended while a rank was slow\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        done.set()
        slow.join()
        os.kill(workers[1], signal.SIGCONT)
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        done.set()
        _kill([job.pid, *workers.values()])
        job.wait()
    out = log.read_text()
    assert "hang:" not in out, out[-3000:]
    records = [r for r in read_metrics(run) if "stragglers" in r]
    # the report made while rank 1 was slowed names it alone; later windows are not asserted: on a loaded machine
    # (a CI run beside other tests) rank 0 was once slower by the margin at step 48, long after, and so named
    assert {s["rank"] for s in records[0]["stragglers"]} == {1}, records
    assert any("straggler" in ln and "rank 1 (" in ln for ln in out.splitlines()), out[-3000:]
    split = records[0]["rank_times"]
    assert split["slowest"]["rank"] == 1 and set(split["median"]) >= {"data_s", "compute_s", "wait_s"}


# One process: the watch sees its own progress only (a data read or a file system that never answers).
STUCK = """
import sys, time
from pathlib import Path
from hybridtron.train.watchdog import Watch
w = Watch(1.0, Path(sys.argv[1]), checkpoint_dir=lambda: "step_00000020",
          last_stop=Path(sys.argv[1]) / "last_stop.json").start()
w.step_begin(23)
w.step_end()
w.arm()
w.step_begin(24)  # and then nothing: a read that never returns
time.sleep(30)
"""


def test_one_process_stuck_in_its_data_names_the_phase_and_exits_for_a_restart(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", STUCK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == HANG_EXIT, p.stderr
    assert time.monotonic() - t0 < 15
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("[hybridtron rank 0/1 ") and "hang: no progress for 1 s in data at step 24" in line, line
    assert "(step_00000020)" in line and "did not arrive" not in line, line
    stop = json.loads((tmp_path / LAST_STOP).read_text())
    assert stop == {"stopped_by": "hang", "step": 24, "phase": "data", "reported_by": 0, "late_ranks": [], "late": [],
                    "checkpoint": "step_00000020", "exit_code": HANG_EXIT}
