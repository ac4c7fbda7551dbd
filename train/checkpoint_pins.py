"""Pins: a checkpoint that a reader (``hybridtron export``) is reading, which pruning (``checkpoint.keep_last``)
leaves in place until the reader is done.

A pin is a file ``RUN_DIR/checkpoints/.pins/<step_N>.<host>-<pid>`` on which its reader holds an exclusive
``flock`` for as long as it reads. The lock, not the file, is what pins: a reader that dies (killed, crashed) loses
its lock with its process, and the file it left is a stale pin, which pruning removes and ignores. The reader
removes its pin when done (and ``.pins/`` with its last one); the checkpoint goes at the next save that prunes.

Choosing a checkpoint and pinning it, and deciding that a checkpoint is unpinned and removing it, each happen
under an exclusive ``flock`` on the ``checkpoints/`` directory itself, so a reader never pins a checkpoint that
pruning is removing, nor pruning removes one that a reader has just chosen. Where the file system gives no locks,
a pin whose writer runs on this host is judged by its pid alone, and another host's is taken as live.

Without torch: the export imports it to choose its checkpoint, and train/checkpoint.py to prune.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridtron.atomic import pid_alive, this_host
from hybridtron.train.checkpoint_names import STEP_RE

PINS = ".pins"
# "<step>.<host>-<pid>": a host may hold "." and "-", a step name neither, the pid no "-"
_PIN_RE = re.compile(r"^(?P<step>step_[0-9]{8})\.(?P<host>[A-Za-z0-9_.-]+)-(?P<pid>[0-9]{1,10})$")


@contextlib.contextmanager
def checkpoints_locked(checkpoints: Path) -> Iterator[None]:
    """An exclusive flock on the directory ``checkpoints`` for the block. No lock where it cannot be taken (a
    directory that is missing or a file system without flock): the block then runs unlocked."""
    try:
        fd = os.open(checkpoints, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _pin_is_live(pin: Path) -> bool:
    """Whether the reader that made ``pin`` still holds it; a pin found stale is removed."""
    m = _PIN_RE.match(pin.name)
    try:
        fd = os.open(pin, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot be checked: taken as held
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # no locks here: the pid says, for a pin of this host
            if m is None or m["host"] != this_host() or pid_alive(int(m["pid"])):
                return True
        with contextlib.suppress(OSError):
            pin.unlink()
        return False
    finally:
        os.close(fd)


def pinned_steps(checkpoints: Path) -> set[str]:
    """The names of the checkpoints in ``checkpoints`` that a live reader pins; stale pins are removed on the way.
    The caller holds `checkpoints_locked`."""
    pins = Path(checkpoints) / PINS
    try:
        entries = sorted(pins.iterdir())
    except OSError:  # (none: the usual case)
        return set()
    live = {m["step"] for p in entries if (m := _PIN_RE.match(p.name)) and _pin_is_live(p)}
    with contextlib.suppress(OSError):
        pins.rmdir()  # when every pin was stale
    return live


def prune(checkpoints: Path, done: list[Path], keep_last: int) -> list[Path]:
    """Remove the checkpoints of ``done`` (oldest first) older than its last ``keep_last``, except those pinned;
    returns the ones kept for a pin. A kept one goes at a later prune once its pin is released."""
    old = done[: max(len(done) - keep_last, 0)]
    if not old:
        return []
    with checkpoints_locked(checkpoints):
        live = pinned_steps(checkpoints)
        for p in old:
            if p.name not in live:
                shutil.rmtree(p, ignore_errors=True)
    return [p for p in old if p.name in live]


@contextlib.contextmanager
def pinned(choose: Callable[[], Path]) -> Iterator[Path]:
    """The checkpoint ``choose()`` names, pinned for the block: pruning leaves it in place until the block ends.
    ``choose`` runs twice: once to find the checkpoints directory, then under its lock, so that what it names then
    (e.g. a run's latest) is what is pinned. A directory not named ``step_N`` (a copy elsewhere, which no run
    prunes), or one whose ``checkpoints/`` cannot be written (a read-only archive, a full disk), is read unpinned."""
    checkpoints = choose().parent
    pin, fd = None, None
    with checkpoints_locked(checkpoints):
        ckpt = choose()
        if STEP_RE.match(ckpt.name):
            pin = checkpoints / PINS / f"{ckpt.name}.{this_host()}-{os.getpid()}"
            try:
                pin.parent.mkdir(exist_ok=True)
                fd = os.open(pin, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:  # not ours to write (a read-only archive), or a full disk: read it as before pins
                pass
            else:
                with contextlib.suppress(OSError):  # no locks on this file system: the pid judges the pin
                    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield ckpt
    finally:
        if fd is not None:
            with checkpoints_locked(checkpoints):
                with contextlib.suppress(OSError):
                    pin.unlink()
                os.close(fd)
                with contextlib.suppress(OSError):
                    (checkpoints / PINS).rmdir()  # with its last pin
