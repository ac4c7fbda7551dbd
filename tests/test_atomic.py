"""Atomic writes leave no scratch behind: a failed write removes its own, and the scratch of a writer that was
killed is reclaimed by the next one on the same host (never another host's, never a live process's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtron.atomic import (
    OLD_SCRATCH_AGE_S,
    parse_scratch,
    reclaim_scratch,
    scratch_name,
    this_host,
    write_chunks_atomic,
    write_file_atomic,
)

ROOT = Path(__file__).resolve().parents[2]  # the directory holding the hybridtron package


def make(path: Path, kind: str) -> Path:
    if kind == "dir":
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "model.safetensors").write_bytes(b"half")
    else:
        path.write_bytes(b"half")
    return path


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def test_scratch_names_carry_this_host_and_pid_and_parse_back():
    final = Path("/data/x/tokenizer.json")
    name = scratch_name(final)
    assert name.parent == final.parent
    assert parse_scratch(name.name) == ("tokenizer.json", this_host(), os.getpid())
    assert parse_scratch(".step_00000010.tmp-gpu-node-07.cluster-4242") == ("step_00000010", "gpu-node-07.cluster", 4242)
    assert parse_scratch(".a.tmp-b.tmp-12-34") == ("a.tmp-b", "12", 34)  # a host of digits is still a host
    assert parse_scratch(".x.tmp-1234") == ("x", None, 1234)  # an older version's name: no host
    for other in ("x.tmp-1234", ".x.tmp-", ".x.tmp-node-", ".tmp-step_00000010-sharded", ".tmp-step_00000010-12",
                  ".x.tmp-1234.bak", ".x.tmp", "step_00000010"):
        assert parse_scratch(other) is None, other


def test_dead_writers_scratch_of_this_host_is_reclaimed_and_nothing_else(tmp_path, dead_pid, live_pid):
    d, host, dead, ours = tmp_path / "out", this_host(), dead_pid, os.getpid()
    d.mkdir()
    outside = tmp_path / "outside"
    make(outside, "dir")
    gone = [make(d / f".x.tmp-{host}-{dead}", "dir"), make(d / f".shard_00001.bin.tmp-{host}-{dead}", "file")]
    (gone[0] / "link").symlink_to(outside)  # inside a removed directory: the link goes, not what it names
    kept = [
        make(d / f".y.tmp-{host}-{ours}", "dir"),  # our own
        make(d / f".z.tmp-{host}-{live_pid}", "file"),  # a live process
        make(d / f".x.tmp-other-node-{dead}", "dir"),  # another host: its pid says nothing here
        make(d / f".x.tmp-{dead}", "file"),  # an older version's name, changed just now
        make(d / f".x.tmp-{host}-{dead}.keep", "file"),
        make(d / f"x.tmp-{host}-{dead}", "file"),
        make(d / "x", "dir"),
    ]
    link = d / f".w.tmp-{host}-{dead}"
    link.symlink_to(outside)  # a link is never ours: left, and never followed
    kept.append(link)
    lines = []
    removed = reclaim_scratch(d, tmp_path / "missing", log=lines.append)
    assert sorted(removed) == sorted(gone)
    assert not any(os.path.lexists(p) for p in gone)
    assert all(os.path.lexists(p) for p in kept)
    assert (outside / "sub" / "model.safetensors").read_bytes() == b"half"
    assert len(lines) == 1 and lines[0].startswith(f"removed 2 scratch entries of dead processes in {d}: ")
    assert all(p.name in lines[0] for p in gone)
    lines.clear()
    assert reclaim_scratch(d, log=lines.append) == [] and lines == []  # nothing to say: silent


def test_older_versions_names_are_reclaimed_only_when_dead_here_and_old(tmp_path, dead_pid, live_pid):
    dead = dead_pid
    old_dead = make(tmp_path / f".x.tmp-{dead}", "dir")
    old_dead_file = make(tmp_path / f".y.tmp-{dead}", "file")
    fresh_dead = make(tmp_path / f".z.tmp-{dead}", "file")
    old_alive = make(tmp_path / f".w.tmp-{live_pid}", "file")
    for p in (old_dead, old_dead_file, old_alive):
        age(p, OLD_SCRATCH_AGE_S + 60)
    age(fresh_dead, OLD_SCRATCH_AGE_S - 60)
    assert sorted(reclaim_scratch(tmp_path)) == sorted([old_dead, old_dead_file])
    assert fresh_dead.exists() and old_alive.exists()


def test_directories_named_in_one_call_are_reported_in_one_line(tmp_path, dead_pid):
    host, dead = this_host(), dead_pid
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "src" / "train").mkdir(parents=True)
    a = make(tmp_path / "tokenizer" / f".tokenizer.json.tmp-{host}-{dead}", "file")
    b = make(tmp_path / "src" / "train" / f".shard_00000.idx.tmp-{host}-{dead}", "file")
    lines = []
    assert sorted(reclaim_scratch(tmp_path, tmp_path / "tokenizer", tmp_path / "src" / "train", log=lines.append)) \
        == sorted([a, b])
    assert len(lines) == 1 and f"in {tmp_path}: " in lines[0]
    assert "tokenizer/.tokenizer.json.tmp-" in lines[0] and "src/train/.shard_00000.idx.tmp-" in lines[0]


def test_a_failed_write_removes_its_own_scratch(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def chunks():
        yield b"new"
        raise KeyboardInterrupt  # interrupted midway

    with pytest.raises(KeyboardInterrupt):
        write_chunks_atomic(target, chunks())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"] and target.read_bytes() == b"old"


def test_a_writer_killed_midway_leaves_scratch_the_next_one_reclaims(tmp_path):
    """kill -9 a process in the middle of an atomic write: its scratch file stays, named for it and this host;
    the next reclaim here removes it and says so."""
    target = tmp_path / "tokenizer.json"
    code = ("import sys, time\nfrom pathlib import Path\nfrom hybridtron.atomic import write_chunks_atomic\n"
            "def chunks():\n    yield b'half a tokenizer'\n    time.sleep(120)\n    yield b'never'\n"
            "write_chunks_atomic(Path(sys.argv[1]), chunks())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", code, str(target)], env=env, start_new_session=True)
    try:
        scratch = target.with_name(f".{target.name}.tmp-{this_host()}-{p.pid}")
        deadline = time.monotonic() + 60
        while not scratch.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scratch.exists(), f"the writer made no {scratch.name} (exit {p.poll()})"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    lines = []
    assert reclaim_scratch(tmp_path, log=lines.append) == [scratch]
    assert not list(tmp_path.iterdir())
    assert lines == [f"removed 1 scratch entry of dead processes in {tmp_path}: {scratch.name}"]


def test_write_file_atomic_publishes_what_the_writer_wrote_or_nothing(tmp_path):
    final = tmp_path / "trace.json"
    seen = []

    def writer(path: str) -> None:
        seen.append(path)
        assert not final.exists()  # written under its scratch name, published only when complete
        Path(path).write_text("{}")

    write_file_atomic(final, writer)
    assert final.read_text() == "{}" and seen == [str(scratch_name(final))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]

    def fails(path: str) -> None:
        Path(path).write_text("torn")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_file_atomic(final, fails)
    assert final.read_text() == "{}"  # the previous file stays; no scratch is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
