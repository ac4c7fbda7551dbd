"""Per-step duties of the model's trainable structure, kept out of the train loop.

- Self-guided training (structured FFNs): alpha follows a cosine from 1 to 0 over
  ``model.ffn.self_guided_fraction`` of ``train.max_steps``; at the step where it reaches 0 the dense
  guide weights leave the model and the optimizer. Both are functions of the step alone, so a run
  resumed on either side of that step rebuilds exactly the structure the uninterrupted run had.
- MoE: per-layer load, aux losses and router biases are read for the metrics line, then the
  auxiliary-loss-free biases move towards balance (outside the gradient).
- FP8 with FSDP2's FP8 all-gather: the scales of the updated weights, computed once after the optimizer step.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.configs import JobConfig


def self_guided_end_step(cfg: JobConfig) -> int | None:
    """The first step trained without the dense guide weights, or None when self-guided is off."""
    f = cfg.model.ffn
    if f.kind == "dense" or not f.self_guided:
        return None
    return round(f.self_guided_fraction * cfg.train.max_steps)


def structure_for_step(model: nn.Module, cfg: JobConfig, step: int) -> None:
    """Give a freshly built model the structure it has at ``step`` (before loading a checkpoint)."""
    end = self_guided_end_step(cfg)
    if end is not None and step >= end:
        from hybridtron.model.structured_ffn import drop_self_guided

        drop_self_guided(model)


def _drop_from_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    gone = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    for p in params:
        optimizer.state.pop(p, None)


def before_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, cfg: JobConfig, step: int) -> None:
    """Called before the forward of step ``step`` (0-based: the number of steps already taken)."""
    end = self_guided_end_step(cfg)
    if end is None:
        return
    from hybridtron.model.structured_ffn import drop_self_guided, self_guided_alpha, set_self_guided_alpha

    if step >= end:
        dropped = drop_self_guided(model)  # a no-op list when they are already gone
        if dropped and optimizer is not None:
            _drop_from_optimizer(optimizer, dropped)
        return
    set_self_guided_alpha(model, self_guided_alpha(step, cfg.train.max_steps, cfg.model.ffn.self_guided_fraction))


def after_step(model: nn.Module, reduce=None) -> dict[str, float]:
    """Called after the optimizer step: MoE metrics of this step, then the router-bias update. ``reduce`` sums a
    tensor over the data-parallel ranks in place: expert loads are global before they move the biases, so
    every rank keeps the same biases."""
    out: dict[str, float] = {}
    fp8_scales = getattr(model, "after_optimizer_step_fp8", None)  # FSDP2's FP8 all-gather: weight scales, one
    if fp8_scales is not None:  # all-reduce for all of them (train/parallel/fp8.py)
        fp8_scales(model)
    for name, m in model.named_modules():
        if hasattr(m, "after_optimizer_step"):
            if reduce is not None:
                m.reduce_load(reduce)
            layer = name.split(".")[1] if name.startswith("layers.") else name
            out.update({f"moe/layer{layer}/{k}": v for k, v in m.metrics().items()})
            m.after_optimizer_step()
    return out
