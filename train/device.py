"""The run's device and its compute precision: where the model runs and in which dtype it computes.

Weights and optimizer state stay fp32 (the master copy); on a GPU the forward and backward run under bf16
autocast unless ``train.dtype`` says otherwise.
"""

from __future__ import annotations

import contextlib

import torch

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
