"""Atomic, resumable checkpoints.

Layout of ``<run_dir>/checkpoints/``::

    step_00000100/          one complete checkpoint
        model.safetensors   weights (safetensors: loading executes no code)
        optimizer.pt        optimizer state, loaded with weights_only=True
        rng.pt              torch RNG states, loaded with weights_only=True
        trainer_state.json  step, data position, tokens seen, python RNG
        config.yaml         the resolved job config
        tokenizer/          the tokenizer the run was trained with
    latest                  text file naming the newest complete checkpoint

A checkpoint is written under a temporary name and renamed into place only when every file is on
disk, and ``latest`` is replaced after that; a crash at any moment leaves either the previous state or
the new one, never a directory that looks complete and is not.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from hybridtron.data_pipeline.atomic import fsync_dir, write_text_atomic

STEP_RE = re.compile(r"^step_(\d{8})$")
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model being trained."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, plain


def restore_rng(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    v, st, g = plain["python"]
    random.setstate((v, tuple(st), g))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # global data position (independent of the DP size)
    tokens_seen: int = 0


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 3):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    # ---- discovery -------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if p.is_dir() and STEP_RE.match(p.name))

    def latest(self) -> Path | None:
        """The checkpoint named by ``latest``; if the pointer is missing or stale, the newest complete one."""
        ptr = self.dir / LATEST
        if ptr.is_file():
            cand = self.dir / ptr.read_text().strip()
            if cand.is_dir() and STEP_RE.match(cand.name):
                return cand
        done = self.complete()
        return done[-1] if done else None

    def clean_partial(self) -> None:
        """Remove temporary directories left by a save that was killed midway."""
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)

    # ---- save ------------------------------------------------------------------------------
    def save(
        self,
        state: TrainerState,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config_yaml: str,
        tokenizer_dir: Path,
    ) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / step_dir_name(state.step)
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        rng_tensors, rng_plain = capture_rng()
        torch.save(rng_tensors, tmp / "rng.pt")
        meta = {"step": state.step, "consumed_samples": state.consumed_samples, "tokens_seen": state.tokens_seen}
        (tmp / "trainer_state.json").write_text(json.dumps({**meta, "rng": rng_plain}))
        (tmp / "config.yaml").write_text(config_yaml)
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. exit right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        write_text_atomic(self.dir / LATEST, final.name)
        self._prune()
        return final

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(len(done) - self.keep_last, 0)]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------
    @staticmethod
    def load(
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        restore_rng_state: bool = True,
    ) -> TrainerState:
        path = Path(path)
        for name in ("model.safetensors", "trainer_state.json"):
            if not (path / name).is_file():
                raise CheckpointError(f"checkpoint {path} has no {name}; it is incomplete or not a checkpoint")
        try:
            missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        except RuntimeError as e:  # shape mismatch
            raise CheckpointError(
                f"checkpoint {path} does not fit this model ({e}); resume with the model config it was saved with "
                f"(see {path / 'config.yaml'}) or start a new --run-dir"
            ) from None
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}; use the model config in {path / 'config.yaml'} or a new --run-dir"
            )
        meta = json.loads((path / "trainer_state.json").read_text())
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
        if restore_rng_state:
            restore_rng(torch.load(path / "rng.pt", weights_only=True), meta["rng"])
        return TrainerState(meta["step"], meta["consumed_samples"], meta["tokens_seen"])
