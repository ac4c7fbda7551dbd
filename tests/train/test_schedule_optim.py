import math

import pytest
import torch
from torch import nn

from hybridtron.configs import TrainConfig
from hybridtron.train.optim import param_groups
from hybridtron.train.schedule import lr_at


def test_cosine_warmup_and_floor():
    c = TrainConfig(max_steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, c) == pytest.approx(0.1)
    assert lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0)
    # halfway through the decay the cosine is at the midpoint of peak and floor
    assert lr_at(60, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, c) == pytest.approx(0.1)
    lrs = [lr_at(s, c) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_wsd_holds_then_decays_linearly():
    c = TrainConfig(max_steps=110, warmup_steps=10, lr=2.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert all(lr_at(s, c) == 2.0 for s in range(10, 90))
    assert lr_at(99, c) == pytest.approx(1.0)  # 10 of 20 decay steps done
    assert lr_at(109, c) == pytest.approx(0.0)


def test_constant():
    c = TrainConfig(max_steps=10, warmup_steps=0, lr=0.5, schedule="constant")
    assert {lr_at(s, c) for s in range(10)} == {0.5}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(4))


def test_param_groups_decay_rules():
    m = Tiny()
    names = {id(p): n for n, p in m.named_parameters()}

    def grouped(cfg):
        return {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in param_groups(m, cfg)}

    g = grouped(TrainConfig())
    assert g["decay"] == ["proj.weight"]
    assert g["no_decay"] == ["embed_tokens.weight", "norm.weight", "proj.bias"]
    g = grouped(TrainConfig(decay_embeddings=True, decay_norms=True))
    assert g["decay"] == ["embed_tokens.weight", "norm.weight", "proj.weight"]
    assert g["no_decay"] == ["proj.bias"]


# ---- a resume with other schedule settings (train.schedule_on_resume) ----------------------------------------

from dataclasses import replace  # noqa: E402

from hybridtron.train.schedule import Plan, resume_plan  # noqa: E402


def _cfg(**kw):
    base = dict(max_steps=600, warmup_steps=20, lr=3e-3, min_lr_ratio=0.1, schedule="cosine", decay_fraction=0.2)
    return TrainConfig(**{**base, **kw})


def _largest_step_change(plan, start, end):
    return max(abs(plan.lr(s + 1) - plan.lr(s)) for s in range(start - 1, end))


def _no_jump(old, new, step, end):
    """The LR at the first resumed step is the one the old curve gives there, and no later step moves it by more
    than the steepest step of a plain warm-up or a curve of the remaining length would."""
    assert new.lr(step) == pytest.approx(old.lr(step), rel=1e-12)
    bound = max(old.peak, new.peak) * max(1 / max(new.warmup, 1), math.pi / max(end - step, 1)) * 1.01
    assert _largest_step_change(new, step, end) <= bound


def test_cosine_extended_keeps_its_curve_and_floor():
    """The issue's run: cosine to step 600, resumed with max_steps 1200: the LR stays at its floor (3e-4), where
    re-stretching the cosine jumped to ~1.7e-3."""
    old = Plan.from_config(_cfg())
    new, msg = resume_plan(old, _cfg(max_steps=1200), 600, "keep")
    assert old.lr(599) == pytest.approx(3e-4, rel=1e-3)
    assert Plan.from_config(_cfg(max_steps=1200)).lr(600) > 1.5e-3  # what re-stretching gives: the jump
    assert [new.lr(s) for s in (600, 900, 1199)] == pytest.approx([3e-4] * 3)
    assert "holds 0.0003" in msg
    _no_jump(old, new, 600, 1200)
    # mid-curve: the old curve, then its floor
    new, _ = resume_plan(old, _cfg(max_steps=1200), 300, "keep")
    assert all(new.lr(s) == old.lr(s) for s in range(300, 1200))


def test_cosine_replan_runs_from_current_lr_to_the_new_end():
    old = Plan.from_config(_cfg())
    for step in (300, 600):  # mid-curve, and at the old floor
        new, msg = resume_plan(old, _cfg(max_steps=1200), step, "replan")
        _no_jump(old, new, step, 1200)
        assert new.lr(1200) == pytest.approx(3e-4)
        assert "replan" in msg
    new, _ = resume_plan(old, _cfg(max_steps=1200), 300, "replan")
    # half way from step 300 to 1200 the new cosine is half way between the LR at 300 and the floor
    assert new.lr(750) == pytest.approx(3e-4 + 0.5 * (old.lr(300) - 3e-4))


def test_wsd_extends_its_stable_phase_and_decays_at_the_new_end():
    old = Plan.from_config(_cfg(schedule="wsd"))
    assert old.decay_start() == 484  # 600 - round(0.2 * 580)
    new, msg = resume_plan(old, _cfg(schedule="wsd", max_steps=1200), 400, "keep")
    _no_jump(old, new, 400, 1200)
    assert all(new.lr(s) == 3e-3 for s in range(400, new.decay_start()))
    assert new.decay_start() == 1200 - round(0.2 * 1180)
    assert new.lr(1199) == pytest.approx(3e-4)
    assert "stable to step 964" in msg


def test_wsd_shortened_past_its_decay_start_decays_now():
    old = Plan.from_config(_cfg(schedule="wsd", max_steps=1200))
    new, _ = resume_plan(old, _cfg(schedule="wsd", max_steps=500), 450, "keep")
    _no_jump(old, new, 450, 500)
    assert new.lr(450) == 3e-3 and new.lr(499) == pytest.approx(3e-4)
    lrs = [new.lr(s) for s in range(450, 500)]
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))


def test_wsd_already_decaying_keeps_its_decay_then_holds_the_floor():
    old = Plan.from_config(_cfg(schedule="wsd"))
    new, _ = resume_plan(old, _cfg(schedule="wsd", max_steps=1200), 550, "keep")
    assert all(new.lr(s) == old.lr(s) for s in range(550, 1200))
    assert new.lr(1000) == pytest.approx(3e-4)
    new, _ = resume_plan(old, _cfg(schedule="wsd", max_steps=1200), 550, "replan")  # replan: a slower decay
    _no_jump(old, new, 550, 1200)
    assert new.lr(1199) == pytest.approx(3e-4) and new.lr(800) > old.lr(599)


def test_changed_peak_warmup_or_kind():
    old = Plan.from_config(_cfg(schedule="wsd"))
    # keep: the checkpoint's peak and kind, and the resume names what it did not apply
    new, msg = resume_plan(old, _cfg(schedule="cosine", lr=1e-3, warmup_steps=50), 300, "keep")
    assert new == old
    assert "not applied: train.schedule='cosine'" in msg and "train.lr=0.001" in msg
    # replan to a lower peak on WSD: a ramp over warmup_steps from the current LR, then the new peak
    new, _ = resume_plan(old, _cfg(schedule="wsd", lr=1e-3), 300, "replan")
    _no_jump(old, new, 300, 600)
    assert new.lr(320) == pytest.approx(1e-3) and new.lr(310) == pytest.approx(2e-3)
    # replan to constant, and from a WSD to a cosine
    for kind in ("constant", "cosine"):
        new, _ = resume_plan(old, _cfg(schedule=kind, lr=6e-3, max_steps=900), 300, "replan")
        _no_jump(old, new, 300, 900)
    # resumed inside the warm-up with a longer one: the ramp reaches the peak at the new warm-up's end
    old = Plan.from_config(_cfg())
    new, _ = resume_plan(old, _cfg(warmup_steps=100), 10, "replan")
    _no_jump(old, new, 10, 600)
    assert new.lr(99) < 3e-3 and new.lr(100) == pytest.approx(3e-3)


def test_constant_and_unchanged():
    old = Plan.from_config(_cfg(schedule="constant"))
    new, msg = resume_plan(old, _cfg(schedule="constant", max_steps=1200), 600, "keep")
    assert new.lr(600) == new.lr(1199) == 3e-3
    same, msg = resume_plan(old, _cfg(schedule="constant"), 300, "keep")
    assert same == old and msg is None
    # a plan round-trips through the checkpoint's JSON
    seg = replace(old, start=5, start_lr=1e-4)
    assert Plan.from_dict(seg.to_dict()) == seg
