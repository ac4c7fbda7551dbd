"""Run metrics: ``metrics.jsonl``, TensorBoard events, console lines, MFU and peak memory."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from hybridtron.atomic import write_text_atomic

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


class MetricsLogger:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard."""

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
            except OSError as e:
                self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}").unlink(missing_ok=True)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
        self._fh = open(self.path, "a")
        from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

        # purge_step hides the old events past the resumed step from TensorBoard (all of them after step 0).
        self._tb = SummaryWriter(log_dir=str(self.tb_dir),
                                 purge_step=resume_step + 1 if resume_step is not None else None)

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        try:
            self._fh.write(json.dumps(clean) + "\n")
            self._fh.flush()
        except OSError as e:  # a buffered write's error names no file: name it (the CLI reports ENOSPC with it)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        step = record["step"]
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                # Grouped keys (moe/layer1/load/e0) keep their own section; the rest go under train/ or val/.
                tag = k if "/" in k else f"{'val' if k.startswith('val_') else 'train'}/{k}"
                self._tb.add_scalar(tag, v, step)

    def close(self) -> None:
        self._fh.close()
        self._tb.flush()
        self._tb.close()


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
