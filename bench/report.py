"""What every bench prints about where it ran and how it files its table in bench/RESULTS.md."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def device_name(device: str | torch.device) -> str:
    """The GPU's name, or the CPU's with a warning that its numbers are not timings."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}; not a timing: tests only)"


def append_results(path: str | Path, header: str, command: str, body: str) -> None:
    """A section ``## header`` with the command that measured it and its body, appended to ``path``."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"\n## {header}\n\nCommand: `{command}`\n\n{body}\n")
