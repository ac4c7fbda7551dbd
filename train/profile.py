"""Profiler traces and memory snapshots of chosen steps (``train.profile``); nothing at all unless asked.

- ``train.profile.steps: [first, last]``: a torch.profiler trace of those steps, one Chrome trace per rank at
  ``RUN_DIR/profile/steps{first}-{last}/rank{R}.pt.trace.json``. That is the layout torch's
  ``tensorboard_trace_handler`` writes and the TensorBoard profiler plugin reads (``tensorboard --logdir
  RUN_DIR/profile``: one run per range of steps, one worker per rank, so its distributed view compares the
  ranks); the same file opens in Perfetto (https://ui.perfetto.dev) or chrome://tracing. The profiler starts one
  step early when it can (a warmup step, discarded, so its start-up cost stays out of the trace); a step's window
  runs from the start of its work to the start of the next step's (its evaluation and checkpoint included).
  The trace's ``ProfilerStep#k`` counts from the profiler's start: the warmup step, when there is one, is #0.
- ``train.profile.memory: true`` on CUDA: the allocator's history is recorded over those steps and a snapshot
  dumped after the last, ``rank{R}.memory.pickle`` beside the trace; without steps, over the whole run. An
  out-of-memory error while recording dumps ``RUN_DIR/profile/oom_step{N}/rank{R}.memory.pickle`` and is raised
  again naming it. Snapshots open at https://pytorch.org/memory_viz.

A resumed run past ``last`` traces nothing; one resumed inside the range traces the steps it has left.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from hybridtron.atomic import write_file_atomic
from hybridtron.configs.job import ProfileConfig

MEMORY_VIEWER = "https://pytorch.org/memory_viz"
# Allocation events the allocator keeps (a ring: the newest win); each is a few KB with its stack.
MAX_MEMORY_EVENTS = 100_000


# kineto (torch's profiler) writes these to the process's stderr at every transition of a trace (start, each
# stage, stop), at a level above its errors (its USDT level), so KINETO_LOG_LEVEL cannot drop them without dropping
# the errors too (seen with torch 2.13: "USDT:2026-11-28 03:41:26 5037:5037 SyncActivityProfilerHandler.cpp:52]
# profiler_start").
KINETO_MARKER = re.compile(rb"^(STAGE|USDT):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def without_kineto_markers():
    """Around the profiler's calls: file descriptor 2 goes to a scratch file, whose lines come back to stderr
    afterwards, kineto's marker lines (KINETO_MARKER) left out. What anything else writes there meanwhile, errors
    included, is shown, only later."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            scratch.seek(0)
            kept = b"".join(ln for ln in scratch.read().splitlines(keepends=True) if not KINETO_MARKER.match(ln))
            if kept:
                os.write(2, kept)


def memory_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def record_memory(on: bool) -> None:
    torch.cuda.memory._record_memory_history("all" if on else None, max_entries=MAX_MEMORY_EVENTS)


def dump_memory(path: str) -> None:
    torch.cuda.memory._dump_snapshot(path)


class StepProfiler:
    """Called by the loop around each step (``guard``) and after each step's iteration (``after``); ``close`` at
    the end. Build it with ``for_run``, which returns None when there is nothing to record."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device, done: int, log):
        self.dir, self.rank, self.device, self.log = Path(run_dir) / "profile", rank, device, log
        self.first, self.last = cfg.steps if cfg.steps else (0, -1)
        self.begin = max(self.first, done + 1)  # the first step traced: a resume inside the range starts later
        if cfg.steps and self.begin > self.last:
            log(f"train.profile.steps={cfg.steps}: this run resumes at step {done + 1}, past them; no trace")
        self.trace = bool(cfg.steps) and self.begin <= self.last
        self.warmup = 1 if self.begin > done + 1 else 0
        self.memory = cfg.memory and memory_supported(device)
        self.memory_whole_run = self.memory and not cfg.steps
        if cfg.memory and not self.memory:
            log(f"train.profile.memory: memory snapshots need CUDA and this run is on {device.type}: none taken")
        self.memory = self.memory and (self.trace or self.memory_whole_run)
        self.prof: torch.profiler.profile | None = None
        self.current = 0  # the step running (or last run)
        self.recording = False  # the allocator's history is on

    @classmethod
    def for_run(cls, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device, done: int,
                log) -> StepProfiler | None:
        if not cfg.steps and not cfg.memory:
            return None
        p = cls(cfg, run_dir, rank, device, done, log)
        return p if p.trace or p.memory else None

    @contextlib.contextmanager
    def guard(self, step: int):
        """Around step ``step``'s work: starts what begins there; an out-of-memory error while the allocator's
        history is recorded dumps a snapshot and is raised again naming it."""
        if self.prof is not None:
            with without_kineto_markers():
                self.prof.step()  # the previous step's window ends here (it holds that step's whole loop iteration)
        elif self.trace and step == self.begin - self.warmup:
            self._start_trace()
        self.current = step
        if self.memory and not self.recording and (self.memory_whole_run or step == self.begin):
            record_memory(True)
            self.recording = True
        try:
            yield
        except torch.OutOfMemoryError as e:
            if not self.recording:
                raise
            path = self._dump_memory(f"oom_step{step}", "")
            raise torch.OutOfMemoryError(
                f"{e}\nmemory snapshot at this out-of-memory error: {path}; open it at {MEMORY_VIEWER}") from e

    def after(self, step: int) -> None:
        """At the end of step ``step``'s loop iteration: the profiler moves on; after ``last``, what was recorded
        is written."""
        if self.prof is not None and step == self.last:
            prof, self.prof = self.prof, None
            with without_kineto_markers():
                prof.stop()  # writes the trace (_write_trace)
        if self.recording and not self.memory_whole_run and step == self.last:
            self._dump_memory(f"steps{self.begin}-{self.last}", " (one per rank)")

    def close(self) -> None:
        """The run ended (or failed) with something still running: write what was recorded."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            with without_kineto_markers():
                prof.stop()  # writes the trace of the steps from begin to the current one, if any
        if self.recording:
            record_memory(False)
            self.recording = False

    def _start_trace(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # no warmup step (the range starts at this process's first step): fine
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.last - self.begin + 1, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write_trace,
                                           record_shapes=True, profile_memory=True)
        with without_kineto_markers():
            self.prof.start()

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        if self.current < self.begin:
            return  # stopped during the warmup step: nothing to show
        steps = f"steps{self.begin}-{self.current}"
        path = self._path(steps, "pt.trace.json")
        write_file_atomic(path, prof.export_chrome_trace)
        self.log(f"profile: trace of {steps.replace('steps', 'steps ')} written to {path} (one per rank); open it "
                 f"at https://ui.perfetto.dev, or run tensorboard --logdir {self.dir} (torch-tb-profiler)")

    def _dump_memory(self, name: str, note: str) -> Path:
        path = self._path(name, "memory.pickle")
        try:
            write_file_atomic(path, dump_memory)
        finally:
            record_memory(False)
            self.recording = False
        self.log(f"profile: memory snapshot written to {path}{note}; open it at {MEMORY_VIEWER}")
        return path

    def _path(self, name: str, suffix: str) -> Path:
        d = self.dir / name
        d.mkdir(parents=True, exist_ok=True)
        return d / f"rank{self.rank}.{suffix}"
