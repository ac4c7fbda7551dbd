"""``hybridtron plan --jobs``: the planner's traces in forked processes (``train/plan/workers.py``) give the plan one
process gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hybridtron.cli import main
from hybridtron.train.plan.workers import Workers


def _pid_and(value):
    return os.getpid(), value


def _fails():
    raise ValueError("the child's own message")


def _nested():
    """A child that forks children of its own (a rank's traces under a rank-level worker)."""
    return Workers(2).map([lambda: _pid_and(1), lambda: _pid_and(2)])


def test_workers_run_calls_in_children_in_order_and_raise_a_childs_error():
    got = Workers(2).map([lambda: _pid_and("a"), lambda: _pid_and("b"), lambda: _pid_and("c")])
    assert [v for _, v in got] == ["a", "b", "c"]
    assert os.getpid() not in {pid for pid, _ in got}
    assert Workers(1).map([lambda: _pid_and("here")]) == [(os.getpid(), "here")]  # one job: no child
    nested = Workers(2).map([_nested, _nested])
    assert [[v for _, v in n] for n in nested] == [[1, 2], [1, 2]]
    with pytest.raises(RuntimeError, match="the child's own message"):
        Workers(2).map([lambda: 1, _fails])
    assert Workers(2).map([lambda: 1, lambda: 2]) == [1, 2]  # its tokens all given back after the failure


def test_workers_pass_on_what_the_children_say():
    said = []
    workers = Workers(2, note=said.append)
    workers.map([lambda: workers.say("one"), lambda: workers.say("two")])
    assert sorted(said) == ["one", "two"]


def test_plan_refuses_negative_jobs(capsys):
    assert main(["plan", "--jobs", "-1"]) == 2
    assert "--jobs -1 must be >= 0" in capsys.readouterr().err


PP3 = ["--model.n_layers", "21", "--model.d_model", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--data.seq_len", "64", "--train.micro_batch_size", "2", "--train.dtype", "bf16", "--parallel.pp", "3",
       "--train.grad_accum_steps", "6", "--nodes", "1", "--gpus-per-node", "6"]


def test_ctrl_c_ends_a_plan_with_one_line_and_no_process_left():
    """Ctrl-C in a terminal signals the whole process group: the plan's forked workers included. The plan ends
    with exit code 130 and one line, no traceback (from it or any worker), and no worker outlives it."""
    # a terminal's foreground command gets SIGINT's default (pytest-xdist's workers ignore it, and an ignored
    # SIGINT is inherited: Python then raises no KeyboardInterrupt, as under nohup or a background job)
    proc = subprocess.Popen([sys.executable, "-m", "hybridtron.cli", "plan", "--config", "tiny", *PP3, "--jobs", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in proc.stderr:  # the progress line, from 3 s on: the first stage's traces run in workers
            seen.append(line)
            if "tracing" in line:
                break
        assert any("tracing" in line for line in seen), "".join(seen)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 130, rest[-3000:]
    finally:
        proc.kill()
    err = "".join(seen) + rest
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "hybridtron plan: interrupted (Ctrl-C)", err[-3000:]
    deadline = time.monotonic() + 10
    while True:  # the workers die with their parent (PR_SET_PDEATHSIG): the group empties
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a plan worker outlived the plan"
        time.sleep(0.1)


@pytest.mark.slow
def test_plan_with_jobs_is_the_plan_of_one_process():
    """The command users run: 3 pipeline stages of 7 layers (so each stage's traces include a middle layer's), dp 2,
    ZeRO-2 and 3: with 3 jobs the first stage's traces run in children, then the other two stages in children that
    fork their own traces; the JSON is the same to the last digit as with one process."""
    over = [*PP3, "--json"]
    out = {}
    for jobs in (1, 3):
        run = subprocess.run([sys.executable, "-m", "hybridtron.cli", "plan", "--config", "tiny", *over, "--jobs",
                              str(jobs)], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        out[jobs] = json.loads(run.stdout)
    assert out[3] == out[1]
    rows = [r for r in out[1] if "refused" not in r]
    assert [r["zero_stage"] for r in rows] == [2, 3] and all(len(r["rank_peaks_gib"]) == 3 for r in rows), rows
