"""The planner's independent traces run side by side in forked processes: ``hybridtron plan --jobs N``.

A plan traces each distinct rank several times (``reduced.py``: the base and one more layer of each repeating kind,
at ZeRO-2 and ZeRO-3), every trace pure Python on fake tensors, one core each. ``Workers.map`` runs such calls in
child processes forked from the one that built the rank, so each starts from the built rank and its first step
(copy-on-write: nothing is rebuilt, nothing imported again) and sends its result back pickled. At most ``jobs``
processes compute at a time, children of children included: each holds one of ``jobs`` tokens while it works and
gives its token back while it waits for its own children. Each trace then starts from the built rank itself; in one
process they run one after another on it, and an earlier one can leave a few scalars behind for the next (a 12-layer
tiny_hybrid at tp 2 planned 524 bytes above the trace of every layer in one process, 12 below with forks).

Forking is safe here because what the children run is the planner's own Python on fake tensors, with no kernel
thread pools, no CUDA and no real process group; the progress thread (``progress.PRINTING``) is kept from printing
while a child is forked, so no child starts with stderr's lock held. With ``jobs`` 1 (the default of the library
calls, and of ``--measure``'s prediction, which runs after a real step used torch's threads) every call runs in
this process, in order."""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import wait

from hybridtron.train.plan.progress import PRINTING


class Workers:
    """Runs calls in forked children, ``jobs`` processes computing at most (module docstring). ``note``: what the
    calls say they do (``say``) goes to it, from this process or from a child."""

    _tokens = None  # the semaphore of the process tree: made by the top process's ``map``, inherited by children
    _parent = None  # in a child: its connection to the parent (results, and what it says)

    def __init__(self, jobs: int = 1, note: Callable[[str], None] | None = None):
        self.jobs, self._note, self._pid = max(1, jobs), note, os.getpid()
        self._ctx = multiprocessing.get_context("fork") if self.jobs > 1 else None

    def say(self, what: str) -> None:
        """What a call does now: to ``note`` in the process that made this ``Workers``; from a child, sent to its
        parent, whose ``map`` says it there (so ``note`` runs where it belongs, the progress line's process)."""
        if os.getpid() == self._pid:
            if self._note is not None:
                self._note(what)
        elif Workers._parent is not None:
            Workers._parent.send(("note", what))

    def map(self, calls: list[Callable[[], object]]) -> list:
        """Each call's result, in order: each run in a forked child when this ``Workers`` has more than one job and
        there is more than one call, else here, one after the other. A child's exception is raised here as a
        ``RuntimeError`` with the child's traceback."""
        if self._ctx is None or len(calls) < 2:
            return [call() for call in calls]
        top = Workers._tokens is None
        if top:
            Workers._tokens = self._ctx.Semaphore(self.jobs - 1)  # this process computes with the last one
        tokens = Workers._tokens
        results: dict[int, object] = {}
        pending: dict[object, tuple[int, object]] = {}
        tokens.release()  # this process waits: its token is the children's meanwhile
        done = False
        try:
            for i, call in enumerate(calls):
                receive, send = self._ctx.Pipe(duplex=False)
                # Ctrl-C reaches the whole process group: only the top process acts on it (its ``finally`` kills
                # the children), so each child starts with SIGINT blocked and then ignores it
                with PRINTING, warnings.catch_warnings(), _sigint_blocked():
                    warnings.simplefilter("ignore", DeprecationWarning)  # python >= 3.12: fork with a thread
                    proc = self._ctx.Process(target=_child, args=(call, send, tokens), name=f"plan-worker-{i}")
                    proc.start()
                send.close()
                pending[receive] = (i, proc)
            while pending:
                for conn in wait(list(pending)):
                    i, proc = pending[conn]
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        proc.join()
                        raise RuntimeError(f"a plan worker (pid {proc.pid}) ended without a result "
                                           f"(exit code {proc.exitcode})") from None
                    if kind == "note":
                        self.say(value)
                        continue
                    conn.close()
                    proc.join()
                    del pending[conn]
                    if kind == "error":
                        raise RuntimeError(f"a plan worker failed:\n{value}")
                    results[i] = value
            done = True
        finally:
            for _conn, proc in pending.values():  # after a failure (or Ctrl-C): the others' work is not wanted
                proc.kill()
                proc.join()
            if done:  # (after a failure the killed children's tokens are gone: nothing more runs on them)
                tokens.acquire()
            if top:
                Workers._tokens = None
        return [results[i] for i in range(len(calls))]


class _sigint_blocked:
    """SIGINT held back in this thread (and in a process forked meanwhile, which inherits the mask) while open."""

    def __enter__(self):
        self._old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old)


def _die_with_parent() -> None:
    """Linux: this process is killed when its parent ends (a failed plan's parent kills its children; theirs go
    with them)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(call, conn, tokens) -> None:
    PRINTING.release()  # taken by the parent around the fork: this copy of it would stay taken for good
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the top process's to handle (``map``)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()
    tokens.acquire()
    Workers._parent = conn
    try:
        import torch

        torch.set_num_threads(1)  # one core per child (and no thread pool inherited half-made)
        try:
            conn.send(("result", call()))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            raise SystemExit(1) from None
    finally:
        conn.close()
        tokens.release()
