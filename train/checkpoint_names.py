"""How a run directory names its checkpoints (``checkpoints/step_NNNNNNNN``) and which one is the latest, read
without torch: ``hybridtron status`` and the config checks that name a run's latest checkpoint need no more, and
train/checkpoint.py, which writes and loads checkpoints, imports torch and torch.distributed.checkpoint (~3.5 s of
CPU on a 2-core VM)."""

from __future__ import annotations

import re
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d{8})$")
LATEST = "latest"  # RUN_DIR/checkpoints/latest: the name of the latest complete checkpoint, written last


def complete(checkpoints: Path) -> list[Path]:
    """The checkpoint directories in ``checkpoints`` (RUN_DIR/checkpoints), oldest first; [] when there is none."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.is_dir() and STEP_RE.match(p.name))


def latest(checkpoints: Path) -> tuple[Path | None, str | None]:
    """(the latest checkpoint, what ``latest`` names when that is not a checkpoint directory here). The latest is
    the one ``latest`` names; when it names none (missing, damaged, or naming a directory that is gone), the newest
    complete one, and the second value says what it named (None when there is no pointer)."""
    ptr = checkpoints / LATEST
    named = None
    if ptr.is_file():
        named = ptr.read_text(errors="replace").strip()
        cand = checkpoints / named
        if STEP_RE.match(named) and cand.is_dir():
            return cand, None
    done = complete(checkpoints)
    return (done[-1] if done else None), named


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The latest checkpoint of the run in ``run_dir`` (`latest`), silently; None when it has none."""
    return latest(Path(run_dir) / "checkpoints")[0]
