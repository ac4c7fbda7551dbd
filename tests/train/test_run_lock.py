"""One writer per run directory (train/run_lock.py): a second `train` (or `ablate`) on a run directory that another
process is training into is refused in one line naming the holder (host, pid, start time), exit 2, before any
data is prepared; the kernel drops the lock when the holder dies, so a kill -9 leaves nothing stale; readers
(eval, status) go on during a run."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hybridtron.cli import main
from hybridtron.train import run_lock
from hybridtron.train.metrics import read_metrics

FAST = ["--train.warmup_steps", "0", "--train.eval_every", "0", "--train.eval_batches", "1", "--checkpoint.every", "2"]
HOLD = ("import sys, time; from hybridtron.train.run_lock import RunLock; "
        "print(RunLock(sys.argv[1]).acquire(), flush=True); time.sleep(120)")


def _hold(path) -> subprocess.Popen:
    """Another process holding ``path``'s lock (the lock module itself, not a whole training run: fast)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "None", "the holder did not get the lock"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _snapshot(run) -> dict:
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() else None) for p in sorted(run.rglob("*"))}


def _refusal(code, err, pid) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    line = lines[0]
    for needle in ("is in use by another training process", f"host {socket.gethostname()}", f"pid {pid}", "since 20"):
        assert needle in line, (needle, line)
    return line


def test_a_second_writer_is_refused_and_a_killed_holder_leaves_no_stale_lock(small_data_dir, cli_args, tmp_path,
                                                                              capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, [*FAST, "--train.max_steps", "2"])) == 0
    before = _snapshot(run)
    capsys.readouterr()
    holder = _hold(run)
    try:
        fresh_data = tmp_path / "other_data"  # where the refused run would prepare its data (out_dir may change)
        code = main(cli_args(fresh_data, run, [*FAST, "--train.max_steps", "4"]))
        _refusal(code, capsys.readouterr().err, holder.pid)
        assert not fresh_data.exists()  # refused before any data was prepared
        after = _snapshot(run)
        assert after.keys() - {".lock"} == before.keys() - {".lock"}
        assert all(after[k] == before[k] for k in before if k != ".lock")  # nothing written: metrics, checkpoints
    finally:
        holder.send_signal(signal.SIGKILL)  # the lock dies with its holder
        _stop(holder)
    assert main(cli_args(small_data_dir, run, [*FAST, "--train.max_steps", "4"])) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_real_run_holds_the_lock_while_readers_go_on(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([sys.executable, "-m", "hybridtron.cli",
                              *cli_args(small_data_dir, run, [*FAST, "--train.schedule", "constant",
                                                              "--train.max_steps", "100000"])],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints" / "latest").exists():
            assert time.time() < deadline and first.poll() is None, "the first run never saved a checkpoint"
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "hybridtron.cli",
                                 *cli_args(small_data_dir, run, [*FAST, "--train.max_steps", "100000"])],
                                env=env, capture_output=True, text=True, timeout=120)
        _refusal(second.returncode, second.stderr, first.pid)
        assert "resumed from" not in second.stdout and "model:" not in second.stdout, second.stdout
        # readers take no lock
        capsys.readouterr()
        assert main(["eval", "--run-dir", str(run), "--batches", "1"]) == 0
        assert '"val_loss"' in capsys.readouterr().out
        assert main(["status", str(run)]) == 0
        assert "checkpoint" in capsys.readouterr().out
        assert first.poll() is None  # still training, undisturbed
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.slow
def test_every_rank_of_a_refused_job_exits_2(small_data_dir, cli_args, tmp_path):
    run = tmp_path / "run"
    holder = _hold(run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    fresh_data = tmp_path / "data"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "hybridtron.cli", *cli_args(fresh_data, run, [*FAST, "--parallel.tp", "2", "--train.max_steps", "4"])]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = job.communicate(timeout=120)  # no rank waits in a collective for one that left
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
        job.wait()
        _stop(holder)
    assert job.returncode != 0  # torchrun's 1, whatever its workers' codes: scripts see the failure
    lines = out.splitlines()
    rank0 = [ln for ln in lines if ln.startswith("hybridtron train (rank 0/2): error:")]
    rank1 = [ln for ln in lines if ln.startswith("hybridtron train (rank 1/2): error:")]
    assert len(rank0) == 1 and f"pid {holder.pid}" in rank0[0], out[-3000:]
    assert len(rank1) == 1 and "is in use by another training process" in rank1[0], out[-3000:]
    assert lines[0] in (rank0[0], rank1[0]), out[:3000]  # what the user reads first is ours
    # torchrun then prints its ChildFailedError traceback and a summary of the workers; the summary ends with the
    # root cause, whose "traceback :" field is the line rank 0 left in torchrun's error file, naming the holder
    # (rank 1's points at rank 0's line and is dated later, so it is not taken for the root cause).
    root = out.rsplit("Root Cause (first observed failure):", 1)[1].splitlines()
    assert "rank      : 0 (local_rank: 0)" in out.rsplit("Root Cause", 1)[1], out[-3000:]
    assert [ln.strip() for ln in root if ln.strip()][-2:] == [f"traceback : {rank0[0]}", "=" * 60], out[-3000:]
    # torchrun stops the other rank once the first has exited (its summary may list that one as SIGTERM'd)
    assert "exitcode  : 2" in out and "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    assert not fresh_data.exists() and sorted(os.listdir(run)) == [".lock"]


def test_a_second_ablation_is_refused_before_it_trains(small_data_dir, cli_args, tmp_path, capsys):
    out = tmp_path / "abl"
    holder = _hold(out)
    try:
        argv = cli_args(small_data_dir, out, [*FAST, "--train.max_steps", "2"])
        argv[0] = "ablate"
        code = main([*argv, "--variant", "base:", "--variant", "one:model.n_layers=1"])
        line = _refusal(code, capsys.readouterr().err, holder.pid)
        assert "(an ablation)" in line
        assert sorted(os.listdir(out)) == [".lock"]  # no variant started
    finally:
        _stop(holder)


def test_a_run_that_fails_before_writing_leaves_no_directory(tmp_path, cli_args, capsys):
    """The lock creates the run directory before data is prepared; a run that then fails takes it away again."""
    run = tmp_path / "new" / "run"
    code = main(cli_args(tmp_path / "data", run, ["--data.sources", f"[{{path: {tmp_path}/missing}}]"]))
    assert code == 2 and "matches no files" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_file_system_without_locks_warns_once_and_goes_on(small_data_dir, cli_args, tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)  # what NFS without its lock service answers
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, [*FAST, "--train.max_steps", "2"])) == 0
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "lock" in ln]
    # one line for the run directory, one for the data directory the run prepares (data_pipeline/data_lock.py)
    assert len(warned) == 2 and all("does not support file locks" in ln and "no locks available" in ln
                                    for ln in warned), warned
    assert f"--run-dir {run}" in warned[0] and f"data.out_dir={small_data_dir}" in warned[1], warned
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # trained, unlocked

    def broken(fd, op):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(fcntl, "flock", broken)  # any other failure is not a file system without locks
    with pytest.raises(OSError), run_lock.hold_run_dir(tmp_path / "other"):
        pass


FORK_AND_HOLD = """import multiprocessing, os, sys, time
from hybridtron.train.run_lock import RunLock
def work():  # a data or tokenizer worker; it names itself once running, so past the fork handlers
    print(os.getpid(), flush=True)
    time.sleep(120)
lock = RunLock(sys.argv[1])
assert lock.acquire() is None
multiprocessing.get_context("fork").Process(target=work).start()
time.sleep(120)
"""


def test_a_forked_worker_does_not_keep_a_killed_holders_lock(tmp_path):
    """flock belongs to the open file description a forked child shares: a worker that outlived its killed parent
    (rank 0 killed with kill -9 while preparing data) kept the run locked until it exited."""
    run = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-c", FORK_AND_HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        assert run_lock.RunLock(run).acquire() is not None, "the parent does not hold the lock"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        os.kill(worker, 0)  # the worker lives on (now init's child)
        lock = run_lock.RunLock(run)
        assert lock.acquire() is None, "the killed holder's forked worker still holds the run directory's lock"
        lock.release()
    finally:
        _stop(parent)
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
