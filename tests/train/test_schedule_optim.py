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
