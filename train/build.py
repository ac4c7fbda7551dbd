"""The model for a config at a training step, and a checkpoint loaded into it: what train, eval, sample, export
and plan all build, so that they agree on what a checkpoint of a given step holds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridtron.configs import JobConfig, load_config
from hybridtron.data_pipeline import load_tokenizer
from hybridtron.model import GatedLM

from .checkpoint import DEEPSPEED, SHARDED, STEP_RE, CheckpointError, CheckpointManager, verify_manifest
from .device import select_device
from .model_hooks import structure_for_step
from .parallel.mesh import launch_world
from .parallel.parallelize import parallelize


def build_model(cfg: JobConfig, vocab_size: int, device: torch.device, step: int = 0, cut=None):
    """The model as it is at training step ``step`` (structure that changes with the step, such as
    self-guided FFN weights leaving the model, is applied), ready for a checkpoint of that step. ``cut``: drops
    the parts another rank holds (pipeline parallel) before any weight is allocated."""
    with torch.device("meta"):
        model = GatedLM(cfg.model, vocab_size)
    if cut is not None:
        cut(model)
    model = parallelize(model, cfg.train)
    model.to_empty(device=device)
    torch.manual_seed(cfg.train.seed)
    model.init_weights()
    structure_for_step(model, cfg, step)
    return model


def checkpoint_step(ckpt: Path | None) -> int:
    """The step a checkpoint directory was saved at (its name says it); 0 for None."""
    m = STEP_RE.match(ckpt.name) if ckpt is not None else None
    return int(m.group(1)) if m else 0


def select_rank_device(cfg: JobConfig) -> torch.device:
    """This process's device: with several processes on CUDA, the GPU of its local rank."""
    device = select_device(cfg.train)
    _rank, local, world = launch_world()
    if device.type == "cuda" and world > 1 and device.index is None:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    return device


def load_for_inference(ckpt: Path, overrides: list[tuple[str, str]] = ()):
    """(cfg, model, tokenizer, device) from checkpoint directory ``ckpt``, verified before anything is read;
    ``overrides``: dotted config overrides (e.g. the device)."""
    for name in ("config.yaml", "tokenizer"):
        if not (ckpt / name).exists():
            raise CheckpointError(f"checkpoint {ckpt} has no {name}; it is incomplete or not a checkpoint")
    inference_files = ("model.safetensors", SHARDED, DEEPSPEED, "trainer_state.json", "config.yaml", "tokenizer")
    verify_manifest(ckpt, only=inference_files)  # before any of them is read
    cfg = load_config(str(ckpt / "config.yaml"), list(overrides))
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    device = select_device(cfg.train)
    cfg.train.activation_checkpointing = False
    model = build_model(cfg, cfg.model.vocab_size, device, checkpoint_step(ckpt))
    CheckpointManager.load(ckpt, model, optimizer=None, restore_rng_state=False, verify=False)
    return cfg, model, tokenizer, device
