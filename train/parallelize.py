"""Apply execution strategies to a single-device model from the outside.

The model under ``model/`` knows nothing of devices, precision or recomputation. This module
applies them in the fixed order later parallelisms slot into: TP/SP -> activation checkpointing ->
compile -> ZeRO/FSDP. Today: device/precision selection and activation checkpointing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hybridtron.configs import TrainConfig


def select_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={cfg.device!r} but no CUDA device is visible; use train.device=cpu or auto")
    return dev


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU (weights and optimizer stay fp32); plain fp32 on CPU unless asked."""
    if cfg.dtype == "fp32" or (cfg.dtype == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward: memory O(layers) -> O(1) blocks, ~1/3 more compute."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def parallelize(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model
