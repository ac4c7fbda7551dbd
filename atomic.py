"""Durable, atomic file writes shared by shards, tokenizers, checkpoints, run files and the kernel tuner's cache,
the reclaiming of the scratch that writers killed midway leave behind, and the removal of the empty directories
a command that failed had created.

Write to a temporary name in the same directory, fsync, ``os.replace`` onto the final name, then fsync
the directory so the rename itself survives a crash: a reader sees the old file or the new one, never
a torn one.

Every temporary ("scratch") entry, file or directory, is named by ``scratch_name``:
``.<final name>.tmp-<host>-<pid>``. The host is there because run and data directories are shared between
the nodes of a cluster (NFS, Lustre): a pid tells whether its writer still lives only on the host that wrote
it. ``reclaim_scratch`` removes the entries of writers that are gone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# A name written by an older version, ".<final>.tmp-<pid>", carries no host: its writer may have run on any node
# sharing the directory, where its pid means nothing here. Such an entry is reclaimed only when its pid is not a
# live process here AND it has not changed for this long, far longer than an older version took for one file.
OLD_SCRATCH_AGE_S = 3600.0
# "<host>-" is absent from the older names; a host may hold "-" itself, the pid never does, so the last one splits.
_SCRATCH_RE = re.compile(r"^\.(?P<final>.+)\.tmp-(?:(?P<host>[A-Za-z0-9_.-]+)-)?(?P<pid>[0-9]{1,10})$")
_LISTED = 6  # names in the one line that reports a reclaim; the rest are counted


@functools.cache
def this_host() -> str:
    """This machine's host name as scratch names carry it: file-name safe, at most 64 characters."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "localhost"


def scratch_name(final: Path) -> Path:
    """The temporary name beside ``final`` under which this process writes it (a file or a directory)."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{this_host()}-{os.getpid()}")


def parse_scratch(name: str) -> tuple[str, str | None, int] | None:
    """(final name, host or None for an older version's name, pid) of a scratch name; None for any other name."""
    m = _SCRATCH_RE.match(name)
    return (m["final"], m["host"], int(m["pid"])) if m else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process on this host (one we may not signal counts: it exists). A pid reused
    since its writer died reads as alive, which only leaves that writer's scratch in place."""
    if pid <= 0:
        return True  # os.kill(0, ...) would ask about our own process group: never a writer's pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, another user's
        return True
    return True


def _dead_writer(entry: os.DirEntry, host: str | None, pid: int, now: float) -> bool:
    if pid == os.getpid() or (host is not None and host != this_host()) or pid_alive(pid):
        return False
    if host is None:
        try:
            return now - entry.stat(follow_symlinks=False).st_mtime > OLD_SCRATCH_AGE_S
        except OSError:
            return False
    return True


def remove_entry(path: Path) -> bool:
    """Remove the file or directory tree ``path`` without following a symbolic link (a link, or anything else
    that is neither a file nor a directory, is left alone); True when it is gone, also when another process
    removed it first."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)  # removes links inside it, never what they point to
        elif stat.S_ISREG(mode):
            os.unlink(path)
        else:
            return False
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return not os.path.lexists(path)


def report_removed(removed: list[Path], log: Callable[[str], object] | None, why: str = "of dead processes") -> None:
    """Say in one line which scratch entries went, named from the directory they have in common."""
    if not removed or log is None:
        return
    where = Path(os.path.commonpath([p.parent for p in removed]))
    names = [str(p.relative_to(where)) for p in removed]
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    n = len(removed)
    log(f"removed {n} scratch entr{'y' if n == 1 else 'ies'} {why} in {where}: {', '.join(names[:_LISTED])}{more}")


def reclaim_scratch(*directories: Path, log: Callable[[str], object] | None = None) -> list[Path]:
    """Remove the scratch entries in ``directories`` (not below them) whose writer is gone, and say so in one
    line through ``log``; returns what was removed. Directories that are missing or cannot be listed are skipped.

    An entry is removed when its name is a scratch name and
    - it names this host and a pid that is no process here (``os.kill(pid, 0)``), or
    - it is an older version's name (no host) whose pid is no process here and which has not changed for
      ``OLD_SCRATCH_AGE_S`` (one hour): written on another node it may still be in use, but no older version
      wrote one entry for that long.
    Never removed: another host's entries (its processes cannot be seen from here; that host reclaims them when
    it next writes there), our own pid's, symbolic links, and any name that is not a scratch name.
    """
    removed, now = [], time.time()
    for d in directories:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:  # missing, not a directory, or not ours to list: nothing of ours to reclaim there
            continue
        for e in entries:
            parsed = parse_scratch(e.name)
            if parsed is not None and _dead_writer(e, parsed[1], parsed[2], now) and remove_entry(Path(e.path)):
                removed.append(Path(e.path))
    report_removed(removed, log)
    return removed


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> str:
    """Atomically replace ``path`` with ``data``; returns the blake2b-128 digest of ``data``."""
    return write_chunks_atomic(path, [data])


@contextlib.contextmanager
def _publishing(path: Path):
    """Yields the scratch name to write ``path`` under; on success renames it into place (after the caller's fsync),
    on any failure removes it and re-raises."""
    tmp = scratch_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        # A write or fsync that fails (ENOSPC on a full disk) names no file, and the scratch name is gone: name the
        # file the caller asked for, so the one line the command prints says where.
        if isinstance(e, OSError) and (e.filename is None or os.fspath(e.filename) == os.fspath(tmp)):
            e.filename = os.fspath(path)
        raise
    fsync_dir(path.parent)


def write_chunks_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> str:
    """``write_bytes_atomic`` of the concatenation of ``chunks``, without ever holding it whole. A write that
    fails (a full disk, an interrupt) removes its temporary file and raises."""
    h = hashlib.blake2b(digest_size=16)
    with _publishing(Path(path)) as tmp, open(tmp, "wb") as f:
        for c in chunks:
            h.update(c)
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def write_file_atomic(path: Path, write: Callable[[str], object]) -> None:
    """Atomically publish the file that ``write(scratch)`` writes at the path it is handed: for a library that
    writes a file itself (a profiler trace, a memory snapshot). A write that fails removes its scratch and raises."""
    with _publishing(Path(path)) as tmp:
        write(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first: what creating it will make."""
    path = Path(path)
    return [d for d in (path, *path.parents) if not os.path.lexists(d)]


def remove_empty_dirs(dirs: Iterable[Path]) -> None:
    """Remove ``dirs`` (innermost first) while they are empty; the first that holds anything stays, and so do
    the ones above it."""
    for d in dirs:
        try:
            Path(d).rmdir()
        except OSError:
            break


@contextlib.contextmanager
def new_dirs_removed_on_failure(path: Path) -> Iterator[None]:
    """When the block raises, the directories that creating ``path`` made (``path`` and its parents that did not
    exist before the block) are removed again where empty: a command that stopped on bad input leaves no empty
    folders behind."""
    created = missing_dirs(path)
    try:
        yield
    except BaseException:
        remove_empty_dirs(created)
        raise
