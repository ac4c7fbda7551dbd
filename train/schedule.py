"""Learning-rate schedules as pure functions of the step, and what a resume with other settings makes of them.

A schedule is a ``Plan``: the settings that shape the curve (kind, peak, floor, warm-up, end, WSD's decay share)
and, after a re-planned resume, the step and LR its new segment starts from. The plan in force is saved in every
checkpoint (``trainer_state.json``), so a resume continues the curve the run was on, not one recomputed from the
current config.

A resume whose config asks for another schedule never makes the LR jump (``train.schedule_on_resume``):

- ``keep`` (the default, Megatron's "use the checkpoint's scheduler"): the checkpoint's curve goes on; only
  ``train.max_steps`` (where the run stops) is taken from the config. A cosine keeps its old curve and holds its
  floor past its old end. A WSD run whose decay has not begun extends (or shortens) its stable phase and decays at
  the new end; one whose decay would already have begun at the new length starts decaying now, from the current
  LR; one already decaying keeps its decay and then its floor. Other changed settings (lr, warm-up, schedule,
  min_lr_ratio, decay_fraction) are not applied, and the resume says so.
- ``replan`` (Megatron's "override"): the config's schedule from the current step, starting at the LR the old
  curve gives there: a cosine runs from it down to the new floor at the new end; WSD and constant approach the new
  peak linearly over ``train.warmup_steps`` steps (within the warm-up: by its end), hold it, and WSD decays at the
  new end (from the current LR at once if its decay has begun).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from hybridtron.configs import TrainConfig

# The TrainConfig settings that shape the curve (besides max_steps, the end).
SHAPE = ("schedule", "lr", "min_lr_ratio", "warmup_steps", "decay_fraction")


@dataclass(frozen=True)
class Plan:
    kind: str  # cosine | wsd | constant
    peak: float
    floor: float
    warmup: int
    end: int  # max_steps: cosine reaches its floor, WSD ends its decay here
    decay_fraction: float
    start: int = 0  # a re-planned segment starts at this step ...
    start_lr: float | None = None  # ... from this LR (None: the curve from step 0, with its warm-up)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> Plan:
        return cls(cfg.schedule, cfg.lr, cfg.lr * cfg.min_lr_ratio, warmup_steps(cfg), cfg.max_steps,
                   cfg.decay_fraction)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)

    def decay_start(self) -> int:
        """WSD: the first step of the linear decay."""
        return self.end - max(int(round(self.decay_fraction * max(self.end - self.warmup, 1))), 1)

    def lr(self, step: int) -> float:
        """LR for optimizer step ``step`` (0-based)."""
        if self.start_lr is None:
            return self._from_zero(step)
        return self._segment(step)

    def _from_zero(self, step: int) -> float:
        peak, floor = self.peak, self.floor
        if self.warmup and step < self.warmup:
            return peak * (step + 1) / self.warmup
        if self.kind == "constant":
            return peak
        total = max(self.end - self.warmup, 1)
        done = min(step - self.warmup, total)
        if self.kind == "cosine":
            return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * done / total))
        # WSD: hold the peak, then decay linearly to the floor over the last decay_fraction of steps.
        stable = self.decay_start() - self.warmup
        if done < stable:
            return peak
        return peak + (floor - peak) * min((done - stable + 1) / (self.end - self.decay_start()), 1.0)

    def _segment(self, step: int) -> float:
        s, lr0, peak, floor = self.start, self.start_lr, self.peak, self.floor
        step = max(step, s)
        if self.kind == "cosine" and s >= self.warmup:  # from the current LR down to the floor at the end
            span = max(self.end - s, 1)
            return floor + 0.5 * (lr0 - floor) * (1.0 + math.cos(math.pi * min((step - s) / span, 1.0)))
        if self.kind == "wsd" and s >= self.decay_start():  # the decay has begun: from the current LR, linearly
            span = max(self.end - 1 - s, 1)
            return lr0 + (floor - lr0) * min((step - s) / span, 1.0)
        # A ramp from the current LR to the peak: by the end of the warm-up, or over warmup steps after it.
        ramp_end = self.warmup if s < self.warmup else s + (max(self.warmup, 1) if lr0 != peak else 0)
        if self.kind == "wsd":
            ramp_end = min(ramp_end, self.decay_start())
        if step < ramp_end:
            return lr0 + (peak - lr0) * (step - s) / (ramp_end - s)
        # After the ramp: the curve from zero (the warm-up is over by now).
        return replace(self, start_lr=None)._from_zero(step)  # step >= warmup here

    def describe(self) -> str:
        curve = {"cosine": f"cosine to {self.floor:.3g} at step {self.end}",
                 "wsd": f"WSD: stable to step {self.decay_start()}, linear decay to {self.floor:.3g} at step "
                        f"{self.end}",
                 "constant": "constant"}[self.kind]
        head = (f"from {self.start_lr:.3g} at step {self.start}" if self.start_lr is not None
                else f"warm-up {self.warmup} steps")
        return f"{head}, peak {self.peak:.3g}, {curve}"


def warmup_steps(cfg: TrainConfig) -> int:
    """The warm-up a run started with ``cfg`` takes: ``train.warmup_steps``, or, when that is not below
    ``train.max_steps`` (a smoke run of a preset made for a long one), a tenth of max_steps (at least 1 step, and
    below max_steps), so the decay still has steps. A constant schedule keeps its warm-up: it has no decay."""
    if cfg.warmup_steps < cfg.max_steps or cfg.schedule == "constant":
        return cfg.warmup_steps
    return min(max(1, cfg.max_steps // 10), cfg.max_steps - 1)


def warmup_note(cfg: TrainConfig) -> str | None:
    """The log line of a scaled-down warm-up (None when the config's is used as it is)."""
    n = warmup_steps(cfg)
    if n == cfg.warmup_steps:
        return None
    return (f"train.warmup_steps={cfg.warmup_steps} is not below train.max_steps={cfg.max_steps}: warming up over "
            f"{n} step{'s' if n != 1 else ''} instead (a tenth of the run); --train.warmup_steps N sets it")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based) of a run started with ``cfg``: linear warm-up, then cosine / WSD /
    constant."""
    return Plan.from_config(cfg).lr(step)


def resume_plan(old: Plan, cfg: TrainConfig, step: int, policy: str) -> tuple[Plan, str | None]:
    """The plan a run resumed at ``step`` follows, given the plan its checkpoint was on and the config it resumes
    with, and a line for the log when it differs from what the config alone would give (None when nothing
    changed). The LR at ``step`` is the old plan's: no jump."""
    wanted = Plan.from_config(cfg)
    asked = _shape(wanted)  # the config's settings, with the warm-up a short run scales down
    changed = {k: v for k, v in _shape(old).items() if not _same(asked[k], v)}
    if not changed and old.end == cfg.max_steps:
        return old, None
    now = old.lr(step)
    if policy == "replan":
        new = replace(wanted, start=step, start_lr=now)
        return new, (f"train.schedule_on_resume=replan: from step {step} the LR follows {new.describe()} "
                     f"(the checkpoint's curve: {old.describe()})")
    new = old
    if old.kind == "wsd" and cfg.max_steps != old.end:
        moved = replace(old, end=cfg.max_steps)
        if step < old.decay_start() and step < moved.decay_start():
            new = moved  # the stable phase extends (or shortens); the decay comes at the new end
        elif step < old.decay_start():  # at the new length the decay would have begun already: it begins now
            new = replace(moved, start=step, start_lr=now)
        # else: the decay is under way: it goes on as planned, then holds the floor
    ignored = [f"train.{k}={asked[k]!r} (the checkpoint's: {v!r})" for k, v in changed.items()]
    msg = f"resumed schedule (train.schedule_on_resume=keep): {new.describe()}"
    if new.kind != "wsd" and cfg.max_steps > old.end:
        msg += f"; from step {old.end} to {cfg.max_steps} it holds {old.lr(old.end):.3g}"
    if ignored:
        msg += (f"; not applied: {', '.join(ignored)} (set train.schedule_on_resume=replan to re-plan from the "
                f"current LR {now:.3g})")
    return new, msg


def _shape(p: Plan) -> dict:
    """A plan's shape settings under their TrainConfig names (min_lr_ratio as the ratio)."""
    return {"schedule": p.kind, "lr": p.peak, "min_lr_ratio": round(p.floor / p.peak, 12) if p.peak else 0.0,
            "warmup_steps": p.warmup, "decay_fraction": p.decay_fraction}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    return a == b
