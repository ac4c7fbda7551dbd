"""One writer per run directory: an advisory ``flock`` on ``RUN_DIR/.lock``, held by the process that writes the
run (rank 0 of a job) for as long as it trains (hybridtron/dir_lock.py: how the lock is taken, named and dropped).

The kernel drops the lock when its holder dies, so a crash never leaves a stale lock and a SLURM requeue of the same
job simply takes it again. Readers (``eval``, ``sample``, ``export``, ``status``) never take it. The lock file stays
(it names the last holder), unless it is all the directory holds: a run that failed before writing anything leaves
no directory behind. Where the file system cannot lock, the run goes on unlocked after one warning line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridtron import dir_lock
from hybridtron.configs import ConfigError
from hybridtron.dir_lock import DirLock

LOCK_FILE = ".lock"
_warn = dir_lock.warn


class RunDirBusy(ConfigError):
    """Another process trains into this run directory (exit 2: a refused state). ``relayed``: this rank learned it
    from rank 0, whose own line names the holder."""

    def __init__(self, msg: str, relayed: bool = False):
        super().__init__(msg)
        self.relayed = relayed


class RunLock(DirLock):
    """The lock of one run directory. ``acquire()`` returns None when taken, or the holder's description when
    another process holds it; ``release()`` gives it back (process exit does too)."""

    def __init__(self, run_dir: Path | str):
        super().__init__(run_dir, LOCK_FILE)


def probe_holder(run_dir: Path | str) -> str | None:
    """The holder's description when another process holds ``run_dir``'s lock; None when it is free, has no lock
    file, or the file system cannot tell. Creates and changes nothing (`hybridtron submit --dry-run` asks too)."""
    return dir_lock.probe_holder(Path(run_dir) / LOCK_FILE)


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
