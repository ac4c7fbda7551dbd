"""Learning-rate schedules as pure functions of the step.

A pure function keeps resume exact and trivial: the only scheduler state is the step counter,
which the checkpoint already carries.
"""

from __future__ import annotations

import math

from hybridtron.configs import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then cosine / WSD / constant."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    total = max(cfg.max_steps - cfg.warmup_steps, 1)
    done = min(step - cfg.warmup_steps, total)
    if cfg.schedule == "cosine":
        progress = done / total
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    # WSD: hold the peak, then decay linearly to the floor over the last decay_fraction of steps.
    decay_steps = max(int(round(cfg.decay_fraction * total)), 1)
    stable = total - decay_steps
    if done < stable:
        return peak
    return peak + (floor - peak) * min((done - stable + 1) / decay_steps, 1.0)
