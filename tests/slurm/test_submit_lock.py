"""`hybridtron submit` on a run directory another process trains into: refused on the login node in one line
naming the holder (exit 2), not after the queue wait when the job starts; a job that waits for another
(--dependency) and a dry run get a note. Asking writes nothing (train/run_lock.py's probe_holder)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from hybridtron.cli import main

HOLD = ("import os, sys, time; os.environ['SLURM_JOB_ID'] = '4242'; from hybridtron.train.run_lock import RunLock; "
        "print(RunLock(sys.argv[1]).acquire(), flush=True); time.sleep(120)")


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    """As if no SLURM were installed: a submission that passes every check stops at 'sbatch not found'."""
    from hybridtron.slurm import cluster

    monkeypatch.setattr(cluster, "find_binary", lambda name: None)


@pytest.fixture
def held(tmp_path):
    """A run directory whose lock another process holds, as a training job's rank 0 does."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "None", "the holder did not get the lock"
        yield run, proc.pid
    finally:
        proc.kill()
        proc.wait()


def _snapshot(run):
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() else None) for p in sorted(run.rglob("*"))}


def test_a_busy_run_directory_is_refused_before_submitting(held, capsys):
    run, pid = held
    before = _snapshot(run)
    code = main(["submit", "--run-dir", str(run), "--gpus-per-node", "0"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in (f"--run-dir {run} is in use by another training process", f"host {socket.gethostname()}",
                   f"pid {pid}", "SLURM job 4242", "--dependency afterany:4242"):
        assert needle in lines[0], (needle, lines[0])
    assert "sbatch" not in lines[0]  # refused before SLURM is asked
    assert _snapshot(run) == before  # no script, config or log directory written


def test_a_dependent_job_and_a_dry_run_get_a_note(held, capsys):
    run, pid = held
    before = _snapshot(run)
    code = main(["submit", "--run-dir", str(run), "--gpus-per-node", "0", "--dry-run"])
    out = capsys.readouterr()
    assert code == 0 and "#SBATCH" in out.out, out.err
    assert f"note: --run-dir {run} is in use by another training process" in out.err
    assert "without --dry-run this submission would be refused" in out.err
    code = main(["submit", "--run-dir", str(run), "--gpus-per-node", "0", "--dependency", "afterany:4242"])
    err = capsys.readouterr().err
    assert code == 2 and "sbatch not found" in err, err  # past the lock check, to SLURM (absent here)
    assert f"pid {pid}" in err and "the job waits for --dependency afterany:4242" in err, err
    assert _snapshot(run) == before


def test_a_free_run_directory_is_not_touched_by_the_check(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    code = main(["submit", "--run-dir", str(run), "--gpus-per-node", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "sbatch not found" in err and "in use" not in err, err
    assert os.listdir(run) == []  # the probe made no lock file
