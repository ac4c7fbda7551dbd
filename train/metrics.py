"""Run metrics: ``metrics.jsonl``, TensorBoard events, console lines, MFU and peak memory."""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import math
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridtron.atomic import write_text_atomic
from hybridtron.train.run_dir import naming

# Dense bf16 tensor-core peak per device (vendor datasheets, no sparsity). MFU is reported only when
# the device is found here or train.peak_flops is set: a CPU has no meaningful single figure.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}


def device_peak_flops(device: torch.device, configured: float) -> float | None:
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def peak_flops_for_name(name: str) -> float | None:
    """The first table key found in the device name; the table lists variants before their family."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident set, the closest CPU analogue.
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform.startswith("linux") else 1 / 1024) / 2**20


def _append(fh, data: bytes, path: Path) -> None:
    """All of ``data`` at the end of the unbuffered file ``fh``, or an OSError naming ``path``. A failed write is
    cut back off the file (a full disk leaves no torn line or record behind), and nothing stays buffered to fail
    again, without a name, when the file is closed."""
    start = os.fstat(fh.fileno()).st_size
    view = memoryview(data)
    try:
        while view:
            n = fh.write(view)  # a nearly full file system takes part of it, then refuses the rest
            if not n:
                raise OSError(errno.EIO, "write wrote nothing")
            view = view[n:]
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fh.fileno(), start)
        raise OSError(e.errno, e.strerror, str(path)) from e


_event_files = itertools.count()  # one process may log several runs (ablate): each gets its own events file


class EventFile:
    """A TensorBoard events file written in the caller's thread. torch's SummaryWriter writes from a thread of its
    own: a full disk there printed that thread's traceback to stderr and came back at a later call as an OSError
    naming no file. Here a failed write raises at once, in the call that wrote, naming the file."""

    def __init__(self, directory: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads the files whose names hold "tfevents"; the rest of the name keeps each file its own.
        self.path = directory / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                 f"{os.getpid()}.{next(_event_files)}")
        self._fh = open(self.path, "ab", buffering=0)
        first = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:  # TensorBoard drops the older files' events from this step on
            first.append(Event(wall_time=time.time(), step=purge_step,
                               session_log=SessionLog(status=SessionLog.START)))
        self._write(first)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event per tag, written (and flushed: the file is unbuffered) together."""
        now = time.time()
        self._write([self._event(wall_time=now, step=step, summary=self._summary(
            value=[self._summary.Value(tag=tag, simple_value=float(v))])) for tag, v in values.items()])

    def _write(self, events) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter  # TFRecord framing: length, CRCs

        buf = io.BytesIO()
        framing = RecordWriter(buf)
        for ev in events:
            framing.write(ev.SerializeToString())
        _append(self._fh, buf.getvalue(), self.path)

    def close(self) -> None:
        self._fh.close()


class MetricsLogger:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard.

    Both files are written unbuffered in the training thread: a write that fails (a full disk) raises from
    ``log`` an OSError naming the file, and the CLI ends the run with one line (exit 4 for a full disk)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb_dir = Path(run_dir) / "tensorboard"
        if resume_step is not None and self.path.exists():
            # Steps after the checkpoint (all of them when there is none: resume_step 0) were lost with the
            # interrupted process and are trained again; drop their old lines so every step appears once.
            # A torn line (a kill in the middle of a write) is dropped too, with a word.
            kept, torn = [], 0
            for ln in self.path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(ln) if ln.strip() else None
                except ValueError:
                    torn += 1
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= resume_step:
                    kept.append(ln)
            if torn:
                print(f"[hybridtron] warning: dropped {torn} unreadable line(s) of {self.path} (a write cut short)",
                      file=sys.stderr)
            try:
                write_text_atomic(self.path, "".join(ln + "\n" for ln in kept))
            except OSError as e:  # (write_text_atomic removed its temporary file)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
        self._fh = open(self.path, "ab", buffering=0)
        try:
            # purge_step hides the old events past the resumed step from TensorBoard (all of them after step 0).
            self._tb = EventFile(self.tb_dir, purge_step=resume_step + 1 if resume_step is not None else None)
        except BaseException:
            self._fh.close()
            raise
        self._failed = False

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        scalars = {}
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                # Grouped keys (moe/layer1/load/e0) keep their own section; the rest go under train/ or val/.
                scalars[k if "/" in k else f"{'val' if k.startswith('val_') else 'train'}/{k}"] = v
        try:
            _append(self._fh, (json.dumps(clean) + "\n").encode(), self.path)
            self._tb.scalars(record["step"], scalars)
        except OSError:
            self._failed = True
            raise

    def close(self) -> None:
        """Close both files. After a failed write (raised from ``log`` already) nothing more is raised: that error
        stays the one the run reports."""
        errors = []
        for close, path in ((self._fh.close, self.path), (self._tb.close, self._tb.path)):
            try:
                with naming(path):
                    close()
            except OSError as e:
                errors.append(e)
        if errors and not self._failed:
            self._failed = True
            raise errors[0]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a torn last line (a kill in the middle of a write) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    recs = [json.loads(ln) for ln in lines[:-1]]
    if lines:
        try:
            recs.append(json.loads(lines[-1]))
        except ValueError:
            pass
    return recs
