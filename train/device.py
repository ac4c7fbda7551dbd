"""The run's device and its compute precision: where the model runs and in which dtype it computes.

Weights and optimizer state stay fp32 (the master copy); on a GPU the forward and backward run under bf16
autocast unless ``train.dtype`` says otherwise.
"""

from __future__ import annotations

import contextlib

import torch

from hybridtron.configs import ConfigError, TrainConfig


def select_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        # a ConfigError (exit 2, one line): a RuntimeError here reached the user as a traceback
        raise ConfigError(f"train.device={cfg.device!r} but no CUDA device is visible; use train.device=cpu or auto")
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


def step_weight_casts(device: torch.device, dtype: torch.dtype | None, enabled: bool = True):
    """Keep autocast's bf16 copies of the fp32 weights for a whole optimizer step, not one micro-batch.

    Autocast caches the low-precision copy of each leaf weight it casts, but drops the cache whenever the
    outermost autocast region exits: with one region per micro-batch every weight was cast again in every
    micro-batch (8.6% of dense_1b's step on an H100). An enclosing, disabled autocast region around the
    step's micro-batches keeps the cache alive until the step ends, so each weight is cast once per step;
    the optimizer then updates the fp32 master weights outside it, and the next step casts afresh. FSDP2
    casts its own gathered shards (MixedPrecisionPolicy): pass enabled=False there.
    """
    if dtype is None or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)
