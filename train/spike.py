"""The loss-spike guard: a step whose loss or gradient norm stands far above the recent ones is warned about,
skipped, or stops the run (``train.spike_policy``).

Each step's (global, data-parallel-mean) loss and its gradient norm before clipping are scored against the last
``train.spike_window`` accepted steps: z = (x - mean) / std, the standard deviation floored at 1% of the mean so
that a flat history does not turn noise into a spike. Only a rise counts (a falling loss is progress). The
guard judges nothing until its window is full.

- ``warn``: the step is applied and logged as a spike; its values join the history.
- ``skip``: the step's update is not applied (weights and optimizer state untouched; the batch is consumed, the
  step counted); its values stay out of the history. More than ``MAX_CONSECUTIVE_SKIPS`` in a row is not a
  spike but a divergence or a shift of the loss's level: the run stops.
- ``stop``: the step is not applied and the run stops without saving (exit 3); the last checkpoint is kept.

The history goes into every checkpoint (``trainer_state.json``), so a resumed run judges its steps exactly as the
uninterrupted one. Every rank sees the same loss and norm, so every rank decides alike.
"""

from __future__ import annotations

import math
from collections import deque

MAX_CONSECUTIVE_SKIPS = 5
REL_STD_FLOOR = 0.01


class SpikeGuard:
    def __init__(self, policy: str, threshold: float, window: int):
        self.policy, self.threshold, self.window = policy, threshold, window
        self.history: dict[str, deque] = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.consecutive = 0  # spikes in a row
        self.total = 0  # spikes seen over the run
        self.last: dict[str, float] = {}  # the last judged step's scores (and "spike" when it was one)

    def _z(self, key: str, x: float) -> float | None:
        h = self.history[key]
        if len(h) < self.window or not math.isfinite(x):
            return None
        mean = sum(h) / len(h)
        std = math.sqrt(sum((v - mean) ** 2 for v in h) / len(h))
        return (x - mean) / max(std, REL_STD_FLOOR * abs(mean), 1e-12)

    def allows(self, loss: float, grad_norm: float) -> bool:
        """Judge a step with finite ``loss`` and ``grad_norm``: may its update be applied?"""
        z = {"loss": self._z("loss", loss), "grad_norm": self._z("grad_norm", grad_norm)}
        self.last = {f"spike/{k}_z": v for k, v in z.items() if v is not None}
        over = [k for k, v in z.items() if v is not None and v > self.threshold]
        if over:
            self.total += 1
            self.consecutive += 1
            self.last["spike"] = 1
            self.last["spike_on"] = "+".join(over)
        else:
            self.consecutive = 0
        if not over or self.policy == "warn":
            self.history["loss"].append(loss)
            self.history["grad_norm"].append(grad_norm)
            return True
        return False

    def after_step(self, step: int, rec: dict, log) -> str | None:
        """Add the step's scores to its metrics record; report a spike. Returns why the run must stop, or None."""
        judged, self.last = self.last, {}
        rec.update(judged)
        if not judged.get("spike"):
            return None
        what = " and ".join(f"{k} {rec.get(k, float('nan')):.4g} (z={judged[f'spike/{k}_z']:.1f})"
                            for k in judged["spike_on"].split("+"))
        where = f"step {step}: loss spike: {what} over the last {self.window} steps (train.spike_threshold=" \
                f"{self.threshold:g})"
        if self.policy == "stop":
            return (f"{where}; stopped without saving (the last checkpoint is kept). Resume with "
                    f"train.spike_policy=skip to drop such steps, or lower train.lr")
        if self.policy == "skip" and self.consecutive > MAX_CONSECUTIVE_SKIPS:
            return (f"{where}: {self.consecutive} steps in a row skipped, which is no spike but a divergence or a new "
                    f"level of the loss; lower train.lr and resume, or raise train.spike_threshold")
        log(f"{where}; " + ("update skipped (train.spike_policy=skip)" if self.policy == "skip" else
                            "applied (train.spike_policy=warn)"))
        return None

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.history.items()} | {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, d: dict) -> None:
        for k in self.history:
            self.history[k].clear()
            self.history[k].extend(float(v) for v in d.get(k, [])[-self.window:])
        self.consecutive, self.total = int(d.get("consecutive", 0)), int(d.get("total", 0))
