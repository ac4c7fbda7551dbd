"""One writer per prepared-data directory (data_pipeline/data_lock.py): a second `prepare` of a data.out_dir that
another process is writing is refused in one line naming the holder (host, pid, start time, SLURM job), exit 2;
the kernel drops the lock when the holder dies, so a kill -9 leaves nothing stale; a prepare that only finds the
data done holds it for moments, and one that meets it waits that out; other directories, and the other ranks of a
job, are not affected."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtron.cli import main
from hybridtron.data_pipeline.data_lock import LOCK_FILE, PATIENCE_S, hold_data_dir
from hybridtron.data_pipeline.errors import DataDirBusy

HOLD = """import os, sys, time
from pathlib import Path
from hybridtron.data_pipeline.data_lock import hold_data_dir
os.environ["SLURM_JOB_ID"] = "4242"
with hold_data_dir(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID"):
        env.pop(k, None)
    return env


def _hold(out: Path, seconds: float = 120) -> subprocess.Popen:
    """Another process holding ``out``'s lock as prepare_data does (the lock alone, not a whole prepare: fast)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(seconds)], stdout=subprocess.PIPE, text=True,
                            env=_env())
    assert proc.stdout.readline().strip() == "held", "the holder did not get the lock"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture
def src(tmp_path) -> Path:
    """A few small text files: a corpus the tiny config prepares in a moment."""
    d = tmp_path / "src"
    d.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    for i in range(6):
        (d / f"f{i}.txt").write_text(" ".join(words[(i * j) % len(words)] for j in range(300)))
    return d


def _argv(src: Path, out: Path) -> list[str]:
    return ["prepare", "--config", "tiny", "--data.sources", f"[{{path: {src}}}]", "--data.out_dir", str(out)]


def _prepared(out: Path) -> bool:
    return (out / "src" / "train" / "manifest.json").is_file() and (out / "tokenizer").is_dir()


def test_a_second_prepare_is_refused_in_one_line_until_the_holder_dies(src, tmp_path, capsys):
    out = tmp_path / "data"
    holder = _hold(out)
    try:
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "hybridtron.cli", *_argv(src, out)], env=_env(),
                                capture_output=True, text=True, timeout=60)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        for needle in (f"data.out_dir={out} is being written by another process", f"host {socket.gethostname()}",
                       f"pid {holder.pid}", "since 20", "SLURM job 4242", "wait for it to finish",
                       "choose another data.out_dir"):
            assert needle in lines[0], (needle, lines[0])
        # it waited at most until the holder had held the lock PATIENCE_S (started before `started`)
        assert time.monotonic() - started < PATIENCE_S + 20
        assert sorted(os.listdir(out)) == [LOCK_FILE]  # refused before anything was written
        # a holder that has held it that long is writing: the next one is refused without waiting
        t = time.monotonic()
        with pytest.raises(DataDirBusy), hold_data_dir(out):
            pass
        assert time.monotonic() - t < 1.0
    finally:
        holder.send_signal(signal.SIGKILL)  # the lock dies with its holder
        _stop(holder)
    assert main(_argv(src, out)) == 0
    assert _prepared(out) and not (out / LOCK_FILE).exists()  # the lock file leaves with the prepare


def test_a_prepare_of_another_out_dir_is_not_affected(src, tmp_path, capsys):
    held, other = tmp_path / "held", tmp_path / "other"
    holder = _hold(held)
    try:
        before = (held / LOCK_FILE).read_bytes()
        assert main(_argv(src, other)) == 0
        assert _prepared(other) and not (other / LOCK_FILE).exists()
        assert (held / LOCK_FILE).read_bytes() == before and holder.poll() is None
    finally:
        _stop(holder)


def test_a_prepare_that_meets_a_brief_holder_waits_for_it(tmp_path):
    """Two runs starting on one prepared corpus: each prepare_data only checks it, holding the lock for moments."""
    out = tmp_path / "data"
    holder = _hold(out, seconds=1.0)
    try:
        t = time.monotonic()
        with hold_data_dir(out):
            assert (out / LOCK_FILE).is_file()
        assert time.monotonic() - t < PATIENCE_S
        assert holder.wait(timeout=30) == 0
    finally:
        _stop(holder)
    assert not os.path.lexists(out)  # the lock made the directory, and nothing else was written


def test_only_rank_0_locks(tmp_path, monkeypatch):
    """Rank 0 prepares, the other ranks of the job read the data after a barrier (train/recipe.py): at once, and
    never refusing each other."""
    out = tmp_path / "data"
    holder = _hold(out)
    try:
        monkeypatch.setenv("RANK", "1")
        with hold_data_dir(out):
            pass
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(DataDirBusy), hold_data_dir(out, patience_s=0):
            pass
    finally:
        _stop(holder)


def test_a_failed_prepare_leaves_no_directory_behind(tmp_path, capsys):
    """The lock file is made in data.out_dir before prepare reads a source; a prepare that then fails on bad input
    takes it away again, and with it the directories that were made for it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")  # no text: found once prepare has made its directory
    for sources in (f"[{{path: {tmp_path}/missing}}]", f"[{{path: {empty}}}]"):
        code = main(["prepare", "--config", "tiny", "--data.sources", sources,
                     "--data.out_dir", str(tmp_path / "new" / "data")])
        err = capsys.readouterr().err
        assert code == 2 and ("matches no files" in err or "no text to train" in err), err
        assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"  # a directory that existed before stays, without the lock file
    kept.mkdir()
    assert main(["prepare", "--config", "tiny", "--data.sources", f"[{{path: {empty}}}]",
                 "--data.out_dir", str(kept)]) == 2
    assert list(kept.iterdir()) == []


def test_a_file_system_without_locks_warns_once_and_goes_on(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)  # what NFS without its lock service answers
    warned = []
    out = tmp_path / "new" / "data"
    with hold_data_dir(out, warn=warned.append):
        pass
    assert len(warned) == 1 and "does not support file locks" in warned[0] and str(out) in warned[0], warned
    assert not (tmp_path / "new").exists()  # nothing was written: the lock's file and directories are gone
