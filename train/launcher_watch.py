"""A training process launched by torchrun ends when its launcher dies.

torchrun starts its workers in sessions of their own, so a launcher killed with SIGKILL (or by the OOM killer)
takes nobody with it: before this, both workers of a tp2 job trained on to their last step, writing checkpoints
into a run directory nobody watched. Each worker therefore asks the kernel for SIGTERM when its parent dies
(Linux ``prctl(PR_SET_PDEATHSIG)``), or, where that is not available, polls its parent once a second. SIGTERM is
the trainer's "checkpoint at the end of this step and stop" (``StopSignal``); every worker of the job gets it at
the same time, so they still agree on the step and save together. Before the loop, SIGTERM ends the process
at once, which loses nothing: every file a run writes is published by a rename.

Under SLURM, srun ends the whole job step when its task (torchrun) ends, so this only matters outside it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_SECONDS = 1.0
# Launchers that may themselves be process 1 of a container (a Kubernetes pod running torchrun directly): a worker
# whose parent is process 1 is then not an orphan.
LAUNCHER_NAMES = (b"torchrun", b"torch.distributed.run", b"deepspeed", b"accelerate")

_armed: str | None = None


def launched() -> bool:
    """Whether a launcher started this process as one worker of a job (torchrun sets both; a shell neither)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _orphaned(parent: int) -> bool:
    ppid = os.getppid()
    if ppid != parent:
        return True
    if ppid != 1:
        return False
    try:  # adopted by init before we looked, unless init is the launcher itself
        with open("/proc/1/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return not any(name in cmdline for name in LAUNCHER_NAMES)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0),
                          ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def _poll(parent: int) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def watch_parent(parent: int | None = None, use_prctl: bool = True) -> str:
    """SIGTERM to this process when ``parent`` (default: the current parent) dies; returns how it watches
    ("prctl" or "poll"). Once per process; a later call returns the first one's answer. A parent already gone
    when this runs (it died while this process was still starting) is answered by SIGTERM at once."""
    global _armed
    if _armed is not None:
        return _armed
    parent = os.getppid() if parent is None else parent
    if use_prctl and _set_pdeathsig(signal.SIGTERM):
        _armed = "prctl"
    else:
        threading.Thread(target=_poll, args=(parent,), name="hybridtron-launcher-watch", daemon=True).start()
        _armed = "poll"
    # prctl only covers a parent that dies after it: one that died before (or before `parent` was read) has
    # already handed this process to init or a subreaper.
    if _orphaned(parent):
        os.kill(os.getpid(), signal.SIGTERM)
    return _armed


def tell_launcher(line: str, cause: bool = True) -> None:
    """torchrun ends its output with a summary of the failed workers, each with a "traceback :" field read from the
    file named by TORCHELASTIC_ERROR_FILE (without one: a link to its docs). Our line goes there, so that the
    summary's last entry, the root cause, reads as our line did. torchrun takes for the root cause the smallest
    timestamp (whole seconds; a tie goes to the worker it lists first): a line that only points at another
    process's (``cause`` False) is dated a second later, so that the one it points at is the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    from hybridtron.atomic import write_text_atomic

    stamp = int(time.time()) + (0 if cause else 1)
    try:  # the format torchrun reads (torch.distributed.elastic.multiprocessing.errors.ProcessFailure)
        write_text_atomic(Path(path), json.dumps({"message": line, "timestamp": stamp}))
    except OSError:
        pass
