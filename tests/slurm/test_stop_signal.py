"""The trainer's side of the SLURM contract, on one process: SIGUSR1 (the time-limit warning) stops training with a
checkpoint like SIGTERM, and `last_stop.json` says why training stopped, which is what the job script reads to
decide whether to requeue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from hybridtron.cli import main
from hybridtron.train.checkpoint import CheckpointManager
from hybridtron.train.metrics import read_metrics
from hybridtron.train.run_dir import LAST_STOP, STOP_REQUEST


def test_sigusr1_checkpoints_stops_and_says_so(small_data_dir, cli_args, tmp_path):
    run = tmp_path / "run"
    flat = ["--train.schedule", "constant", "--train.warmup_steps", "0", "--checkpoint.every", "0",
            "--train.eval_every", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "hybridtron.cli",
                             *cli_args(small_data_dir, run, [*flat, "--train.max_steps", "400"])],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 5:
            assert time.time() < deadline and proc.poll() is None, "training never reached step 5"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    stop = json.loads((run / LAST_STOP).read_text())
    assert "received signal SIGUSR1; saving a checkpoint at step" in out, out
    assert stop["stopped_by"] == "signal" and 5 <= stop["step"] < 400 and stop["max_steps"] == 400, stop
    assert CheckpointManager(run).latest().name == stop["checkpoint"] == f"step_{stop['step']:08d}"
    # the same run to its end: the stop file now says it finished (the job script does not requeue that)
    end = stop["step"] + 2
    assert main(cli_args(small_data_dir, run, [*flat, "--train.max_steps", str(end)])) == 0
    stop = json.loads((run / LAST_STOP).read_text())
    assert stop == {"stopped_by": "max_steps", "step": end, "max_steps": end, "checkpoint": f"step_{end:08d}"}


def test_a_warning_recorded_before_the_handlers_stops_after_the_first_step(small_data_dir, cli_args, tmp_path, capsys):
    """The job script writes the signal to `stop_request` when it forwards it: a warning that came while the
    training processes still started (ignoring it) stops them after their first step, with a checkpoint, as if it
    had come then; a file without a signal's name is no request."""
    run = tmp_path / "run"
    args = cli_args(small_data_dir, run, ["--train.max_steps", "20", "--checkpoint.every", "0",
                                          "--train.eval_every", "0"])
    run.mkdir()
    (run / STOP_REQUEST).write_text("USR1\n")
    assert main(args) == 0
    assert "received signal SIGUSR1; saving a checkpoint at step 1 and stopping" in capsys.readouterr().out
    stop = json.loads((run / LAST_STOP).read_text())
    assert stop["stopped_by"] == "signal" and stop["step"] == 1 and stop["checkpoint"] == "step_00000001", stop
    (run / STOP_REQUEST).write_text("")  # what a reader racing the script's write may see: not a request
    assert main(args) == 0
    assert json.loads((run / LAST_STOP).read_text())["stopped_by"] == "max_steps"


def test_a_clean_stop_in_a_slurm_job_lists_the_jobs_restarts(small_data_dir, cli_args, tmp_path, monkeypatch):
    """In a SLURM job, last_stop.json says which failures the job script restarted training after (this job's lines
    of restarts.jsonl, not another job's); outside SLURM it has no such entry."""
    run = tmp_path / "run"
    run.mkdir()
    mine = [{"job_id": "42", "attempt": 0, "restart": k, "reason": "a process or node died", "from_step": 0}
            for k in (1, 2)]
    (run / "restarts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"job_id": "41", "attempt": 0, "restart": 1, "reason": "a process or node died", "from_step": 0}, *mine)))
    args = ["--checkpoint.every", "0", "--train.eval_every", "0", "--train.warmup_steps", "0"]
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert main(cli_args(small_data_dir, run, [*args, "--train.max_steps", "2"])) == 0
    stop = json.loads((run / LAST_STOP).read_text())
    assert stop["stopped_by"] == "max_steps" and stop["restarts"] == mine, stop
    monkeypatch.delenv("SLURM_JOB_ID")
    assert main(cli_args(small_data_dir, run, [*args, "--train.max_steps", "3"])) == 0
    assert "restarts" not in json.loads((run / LAST_STOP).read_text())
