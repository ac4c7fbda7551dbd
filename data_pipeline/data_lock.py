"""One writer per prepared-data directory: ``prepare_data`` holds an advisory ``flock`` on
``data.out_dir/.prepare.lock`` while it works there (hybridtron/dir_lock.py: how the lock is taken, named and
dropped when its holder dies), so two ``prepare``s, two ``train``s preparing the same corpus, or a ``prepare`` and
a ``train``, never write one directory at once.

Every ``prepare_data`` takes it, also one that finds everything done (it cannot know before it looks); that one
lets go within moments. So a process that finds the lock taken waits while the holder has held it for less than
``PATIENCE_S`` (a second run starting on a prepared corpus goes on after its brief wait), and is refused once the
holder has held it that long: that one is writing (a minute or an hour), and the refusal (DataDirBusy, exit 2)
comes at once, naming the holder. Under a launcher only rank 0 locks: it prepares first, the other ranks read what
it wrote after a barrier (train/recipe.py), and must not refuse each other.

The lock file is removed when its holder lets go, so a prepared directory holds only data, and a prepare that
failed on bad input leaves no directory it created behind.

The array tasks of ``hybridtron submit prepare`` (prepare_tasks.py) tokenize parts side by side, on several nodes,
so they cannot take that exclusive lock. Each holds a *shared* ``flock`` on ``data.out_dir/.prepare-tasks.lock``
and then checks that nobody holds ``.prepare.lock`` (a shared probe); the holder of ``.prepare.lock``, once it has
it, checks that nobody holds the tasks' file (an exclusive probe, which also removes the file when it is free).
Whichever order the two come in, the later one sees the earlier, so a ``prepare`` or ``train`` never cleans or
merges parts while a task writes them, and a task never starts while one of them works there; both wait
``PATIENCE_S`` before refusing. A directory no task ever wrote gets no tasks' file. Which task writes which part is
settled by a lock per part (``part_lock``), so two submissions over one directory never write one part at once.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridtron import dir_lock
from hybridtron.data_pipeline.errors import DataDirBusy

LOCK_FILE = ".prepare.lock"  # not the run directory's ".lock": data.out_dir may be the run directory itself
TASKS_LOCK = ".prepare-tasks.lock"  # shared by the live array tasks of `hybridtron submit prepare`
UNLOCKED = -1  # what flock_path returns where the file system cannot lock
PATIENCE_S = 5.0  # longer than a prepare that finds everything done holds the lock


@contextmanager
def hold_data_dir(out: Path, is_main: bool | None = None, warn: Callable[[str], None] = dir_lock.warn,
                  patience_s: float = PATIENCE_S) -> Iterator[None]:
    """Hold ``out``'s lock for the block, or raise DataDirBusy naming the holder. ``is_main`` (default: ``RANK``
    is 0 or unset) is the process that locks."""
    if is_main is None:
        is_main = os.environ.get("RANK", "0") == "0"
    if not is_main:
        yield
        return
    lock = dir_lock.DirLock(out, LOCK_FILE, keep_file=False)
    try:
        holder = lock.acquire(patience_s)
        if holder is not None:
            raise DataDirBusy(f"data.out_dir={out} is being written by another process ({holder}): a `hybridtron "
                              f"prepare`, or a `train` preparing its data; wait for it to finish, or choose another "
                              f"data.out_dir (a crashed holder releases it by itself)")
        if not _no_tasks(out / TASKS_LOCK, patience_s):
            raise DataDirBusy(f"data.out_dir={out} is being written by the array tasks of a `hybridtron submit "
                              f"prepare` (they tokenize its parts; `hybridtron status {out}` shows them): wait for "
                              f"them to end (their merge job then writes the shards), or scancel them and run this "
                              f"again (it keeps their complete parts)")
        if lock.unsupported is not None:
            e = lock.unsupported
            warn(f"warning: the file system of {out} does not support file locks (flock: "
                 f"{(e.strerror or str(e)).lower()}), so nothing stops a second prepare from writing into "
                 f"data.out_dir={out} at the same time; make sure only one runs")
        yield
    finally:
        lock.release()


def _flock_patiently(path: Path, mode: int, patience_s: float, create: bool) -> tuple[int | None, str]:
    """Open ``path`` (created when ``create``) and ``flock(mode)`` it, trying for up to ``patience_s``: (descriptor,
    "held"), or (None, why): "busy" (others hold it), "missing" (no such file, not ``create``), "unsupported" (the
    file system cannot lock)."""
    deadline = time.monotonic() + patience_s
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_CLOEXEC
    while True:
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            if create:  # its directory is missing: the caller's error
                raise
            return None, "missing"
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd, "held"
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None, "busy"
            time.sleep(0.05)
        except OSError as e:
            os.close(fd)
            if e.errno in dir_lock.UNSUPPORTED:
                return None, "unsupported"
            raise


def _no_tasks(path: Path, patience_s: float) -> bool:
    """Whether no array task holds the tasks' file ``path`` (waiting up to ``patience_s``); a free one is removed,
    under an exclusive lock: a task that opened it meanwhile then finds ``.prepare.lock`` held and stands back."""
    fd, why = _flock_patiently(path, fcntl.LOCK_EX, patience_s, create=False)
    if fd is None:
        return why != "busy"
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)
    return True


def flock_path(path: Path, mode: int, patience_s: float = 0.0) -> int | None:
    """``flock(mode)`` on ``path`` (created if missing), trying for up to ``patience_s``: the open descriptor
    (close it to let go), None when others hold it, UNLOCKED where the file system cannot lock. The path is opened
    again when the file was replaced or removed meanwhile (a holder unlinks it as it lets go), so the lock taken is
    always on the file the path names."""
    deadline = time.monotonic() + patience_s
    while True:
        fd, why = _flock_patiently(path, mode, max(0.0, deadline - time.monotonic()), create=True)
        if fd is None:
            return None if why == "busy" else UNLOCKED
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextmanager
def hold_as_task(out: Path, patience_s: float = PATIENCE_S) -> Iterator[None]:
    """An array task's share of ``out``: refused (DataDirBusy) while a ``prepare`` or ``train`` works there."""
    deadline = time.monotonic() + patience_s
    while True:
        fd = flock_path(out / TASKS_LOCK, fcntl.LOCK_SH, patience_s)
        holder = dir_lock.probe_holder(out / LOCK_FILE) if fd is not None else "one that is about to let go"
        if holder is None:
            break
        if fd is not None and fd != UNLOCKED:
            os.close(fd)
        if time.monotonic() >= deadline:
            raise DataDirBusy(f"data.out_dir={out} is being written by another process ({holder}): a `hybridtron "
                              f"prepare`, or a `train` preparing its data; an array task does not tokenize beside it. "
                              f"Wait for it to end, then submit again (complete parts are kept)")
        time.sleep(0.05)
    try:
        yield
    finally:
        if fd != UNLOCKED:
            os.close(fd)


def part_lock(path: Path) -> int | None:
    """The lock of one part (``SOURCE/.parts/part-NNNNN.lock``): a descriptor, or None when another task has it."""
    fd = flock_path(path, fcntl.LOCK_EX)
    if fd is not None and fd != UNLOCKED:
        os.pwrite(fd, f"{os.uname().nodename} {os.getpid()}\n".encode(), 0)
    return fd

