"""One writer per directory: an advisory ``flock`` on a lock file inside it, shared by the run directory's lock
(train/run_lock.py) and the prepared-data directory's (data_pipeline/data_lock.py), which each say who takes it
and what a refusal tells the user.

The kernel drops the lock when its holder dies, however it dies (SIGKILL, OOM, a node reboot once the file server
notices), so a crash never leaves a stale lock to clean up. After acquiring, the holder writes who it is (host,
pid, start time, SLURM job) into the file, through the locked descriptor: replacing the file by a rename would move
the lock to an inode nobody else opens. A process that is refused reads that to name the holder.

The descriptor does not outlive the holder in its children: ``flock`` belongs to the open file description, which a
forked child (a data-loader or tokenizer worker) shares, so a child that outlived its killed parent kept the
directory locked until it exited. Each child closes its copy at once (``os.register_at_fork``); an exec'd one never
gets it (``O_CLOEXEC``). The parent's lock is untouched: it holds its own descriptor.

A holder may remove the lock file when it lets go (always, or when the directory holds nothing else), unlinking it
while still locked: a process that locked the old file meanwhile sees that the path no longer leads to it and opens
the path again, so two processes never hold two files of one name.

Where the file system cannot lock (``flock`` fails with ENOLCK, ENOSYS, EOPNOTSUPP or EINVAL: NFS without a lock
service, Lustre mounted ``noflock``), ``acquire`` succeeds unlocked and records why in ``unsupported``; the caller
warns in one line. docs/architecture.md says what each file system guarantees.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hybridtron.atomic import missing_dirs, remove_empty_dirs

# flock's answers that mean "this file system does not lock", as opposed to "someone holds it"
UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_POLL_S = 0.05  # how often a waiting acquire tries again


def warn(msg: str) -> None:
    print(f"[hybridtron] {msg}", file=sys.stderr, flush=True)


_held: set[DirLock] = set()  # the locks this process holds: what a forked child must let go of


def _close_in_child() -> None:
    for lock in list(_held):
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = None
        lock.held = False  # the child's release() then touches nothing: the lock file is the parent's
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


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


def _held_for(text: str) -> float | None:
    """Seconds since the holder recorded in ``text`` took the lock (by its clock, to the second); None when it
    has not recorded itself yet."""
    try:
        started = datetime.datetime.fromisoformat(json.loads(text)["started"])
        return max(0.0, time.time() - started.timestamp())
    except (ValueError, TypeError, KeyError, OverflowError):
        return None


class DirLock:
    """The lock file ``name`` of ``directory``. ``acquire()`` returns None when taken (or when the file system
    cannot lock: ``unsupported``), or the holder's description when another process holds it; ``release()`` gives
    it back (process exit does too), removing the lock file where ``keep_file`` is false or it is all the
    directory holds, and then the directories that ``acquire`` created, where empty."""

    def __init__(self, directory: Path | str, name: str, keep_file: bool = True):
        self.directory = Path(directory)
        self.name = name
        self.path = self.directory / name
        self.keep_file = keep_file
        self.fd: int | None = None
        self.held = False  # taken, locked or (unsupported) not: release() has work to do
        self.unsupported: OSError | None = None  # set when the file system cannot lock: running unlocked
        self._created: list[Path] = []  # directories made for the lock, removed again if the holder leaves them empty

    def acquire(self, patience_s: float = 0.0) -> str | None:
        """Take the lock. A holder that has held it for less than ``patience_s`` may be about to let go (one that
        only checks the directory is done in moments): wait until it has held it that long, then give up."""
        self._created = []
        deadline = None
        while True:
            text = self._try()
            if text is None:
                return None
            if deadline is None:
                held = _held_for(text)
                left = patience_s if held is None else min(patience_s, patience_s - held)
                deadline = time.monotonic() + max(0.0, left)
            if time.monotonic() >= deadline:
                self._remove_created()
                return describe_holder(text)
            time.sleep(_POLL_S)

    def _try(self) -> str | None:
        """One attempt: None when taken (or unsupported), else what the holder wrote into the file."""
        for attempt in range(1, 100):
            # (again each time: a holder that let go meanwhile removed the directories it had made, where empty)
            made = {*self._created, *missing_dirs(self.directory)}
            self._created = sorted(made, key=lambda d: len(d.parts), reverse=True)  # innermost first
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # a holder that let go removed the empty directory after our mkdir
                if attempt < 3:
                    continue
                raise  # (a dangling link in the lock file's place)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
                os.close(fd)
                return text
            except OSError as e:
                os.close(fd)
                if e.errno not in UNSUPPORTED:
                    raise
                self.unsupported = e
                self._hold(None)
                return None
            # A holder that let go removed the file after we opened it: our lock is on an inode nobody else will
            # open, so open the path again.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise OSError(errno.EAGAIN, "the lock file kept being replaced", str(self.path))
        self._hold(fd)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        who = {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
               "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        data = (json.dumps(who) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return None

    def _hold(self, fd: int | None) -> None:
        self.fd, self.held = fd, True
        _held.add(self)

    def release(self) -> None:
        if not self.held:
            return
        # Unlinked while still held, so no other process can have locked this file (see the module's docstring).
        # A holder that failed before writing anything (its data could not be prepared, say) leaves no directory.
        try:
            if not self.keep_file or os.listdir(self.directory) == [self.name]:
                os.unlink(self.path)
                self._remove_created()
        except OSError:
            pass
        _held.discard(self)
        self.held = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _remove_created(self) -> None:
        remove_empty_dirs(self._created)
        self._created = []


def probe_holder(path: Path | str) -> str | None:
    """The holder's description when another process holds the lock file ``path``; None when it is free, does not
    exist, or the file system cannot tell. Creates and changes nothing: a shared ``flock`` on the existing file,
    which any holder's exclusive one refuses, released at once. For those few microseconds a process taking the
    lock would be refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: nobody holds it; unreadable: the holder's side will judge
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
