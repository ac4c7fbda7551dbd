"""One writer per run directory: an advisory ``flock`` on ``RUN_DIR/.lock``, held by the process that writes the
run (rank 0 of a job) for as long as it trains.

The kernel drops the lock when its holder dies, however it dies (SIGKILL, OOM, a node reboot once the file server
notices), so a crash never leaves a stale lock to clean up and a SLURM requeue of the same job simply takes it
again. Readers (``eval``, ``sample``, ``export``, ``status``) never take it. After acquiring, the holder writes who it
is (host, pid, start time, SLURM job) into the file, through the locked descriptor: replacing the file by a rename
would move the lock to an inode nobody else opens. A process that is refused reads that to name the holder.

The descriptor does not outlive the holder in its children: ``flock`` belongs to the open file description, which a
forked child (a data-loader or tokenizer worker) shares, so a child that outlived its killed parent kept the run
locked until it exited. Each child closes its copy at once (``os.register_at_fork``); an exec'd one never gets it
(``O_CLOEXEC``). The parent's lock is untouched: it holds its own descriptor.

Where the file system cannot lock (``flock`` fails with ENOLCK, ENOSYS, EOPNOTSUPP or EINVAL: NFS without a lock
service, Lustre mounted ``noflock``), the run goes on unlocked after one warning line; docs/architecture.md says
what each file system guarantees.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridtron.atomic import missing_dirs, remove_empty_dirs
from hybridtron.configs import ConfigError

LOCK_FILE = ".lock"

# flock's answers that mean "this file system does not lock", as opposed to "someone holds it"
UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _warn(msg: str) -> None:
    print(f"[hybridtron] {msg}", file=sys.stderr, flush=True)


_held: set[RunLock] = set()  # the locks this process holds: what a forked child must let go of


def _close_in_child() -> None:
    for lock in list(_held):
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = None  # the child's release() then touches nothing: the lock file is the parent's
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunDirBusy(ConfigError):
    """Another process trains into this run directory (exit 2: a refused state). ``relayed``: this rank learned it
    from rank 0, whose own line names the holder."""

    def __init__(self, msg: str, relayed: bool = False):
        super().__init__(msg)
        self.relayed = relayed


def describe_holder(text: str) -> str:
    """The lock file's content as the words of a refusal: 'host h, pid 123, since 2026-... (SLURM job 7)'."""
    try:
        who = json.loads(text)
        parts = [f"host {who['host']}", f"pid {who['pid']}", f"since {who['started']}"]
    except (ValueError, TypeError, KeyError):
        # the holder took the lock and has not written its name yet (a few microseconds), or an old file
        return "a process that has not recorded itself yet"
    if who.get("slurm_job_id"):
        parts.append(f"SLURM job {who['slurm_job_id']}")
    return ", ".join(parts)


class RunLock:
    """The lock of one run directory. ``acquire()`` returns None when taken, or the holder's description when
    another process holds it; ``release()`` gives it back (process exit does too)."""

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.unsupported: OSError | None = None  # set when the file system cannot lock: running unlocked
        self._created: list[Path] = []  # directories made for the lock, removed again if the run leaves them empty

    def acquire(self) -> str | None:
        self._created = missing_dirs(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
                os.close(fd)
                self._remove_created()
                return holder
            except OSError as e:
                os.close(fd)
                if e.errno not in UNSUPPORTED:
                    raise
                self.unsupported = e
                return None
            # A holder that left an empty fresh directory removed the file after we opened it: our lock is on an
            # inode nobody else will open, so open the path again.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.fd = fd
        _held.add(self)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        who = {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
               "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        data = (json.dumps(who) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        # A run that failed before writing anything (its data could not be prepared, say) leaves no directory
        # that holds only the lock; unlinked while still held, so no other process can have locked this file.
        try:
            if os.listdir(self.run_dir) == [LOCK_FILE]:
                os.unlink(self.path)
                self._remove_created()
        except OSError:
            pass
        _held.discard(self)
        os.close(self.fd)
        self.fd = None

    def _remove_created(self) -> None:
        remove_empty_dirs(self._created)
        self._created = []


def probe_holder(run_dir: Path | str) -> str | None:
    """The holder's description when another process holds ``run_dir``'s lock; None when it is free, has no lock
    file, or the file system cannot tell. Creates and changes nothing (`hybridtron submit --dry-run` asks too): a
    shared ``flock`` on the existing file, which any holder's exclusive one refuses, released at once. For those
    few microseconds a run starting in the same directory would be refused."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: never trained into, so nobody holds it; unreadable: the job will judge
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except OSError:  # a file system that cannot lock: nothing to learn here
        return None
    finally:
        os.close(fd)  # (also drops the shared lock)
    return None


@contextmanager
def hold_run_dir(run_dir: Path, is_main: bool = True, agree: Callable[[bool], bool] | None = None,
                 warn: Callable[[str], None] = _warn, what: str | None = None) -> Iterator[RunLock | None]:
    """Hold ``run_dir``'s lock for the block, or raise RunDirBusy naming the holder. Only the ``is_main`` process
    (rank 0) locks; ``agree(flag)`` is the job's "true on every rank if true on any" (``Mesh.any``), so that every
    rank of a multi-process job learns of a refusal and stops with the same exit code, none waiting in a
    collective for a rank that left."""
    what = what or f"--run-dir {run_dir}"
    lock = RunLock(run_dir) if is_main else None
    try:
        holder = lock.acquire() if lock is not None else None
        refused = holder is not None
        if agree is not None:
            refused = agree(refused)
        if refused and holder is None:
            raise RunDirBusy(f"{what} is in use by another training process (rank 0's line names it); wait for it to "
                             f"end, or choose another --run-dir", relayed=True)
        if refused:
            raise RunDirBusy(f"{what} is in use by another training process ({holder}); wait for it to end or stop "
                             f"it, or choose another --run-dir (a crashed holder releases it by itself)")
        if lock is not None and lock.unsupported is not None:
            e = lock.unsupported
            warn(f"warning: the file system of {run_dir} does not support file locks (flock: "
                 f"{(e.strerror or str(e)).lower()}), so nothing stops a second training process from writing into "
                 f"{what} at the same time; make sure only one runs")
        yield lock
    finally:
        if lock is not None:
            lock.release()
