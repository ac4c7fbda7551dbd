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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridtron import dir_lock

from .errors import DataDirBusy

LOCK_FILE = ".prepare.lock"  # not the run directory's ".lock": data.out_dir may be the run directory itself
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
        if lock.unsupported is not None:
            e = lock.unsupported
            warn(f"warning: the file system of {out} does not support file locks (flock: "
                 f"{(e.strerror or str(e)).lower()}), so nothing stops a second prepare from writing into "
                 f"data.out_dir={out} at the same time; make sure only one runs")
        yield
    finally:
        lock.release()
