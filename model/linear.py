"""The one place projections are made, so reparameterisations (scale vectors) apply to all of them.

``make_linear(cfg, in_features, out_features)`` returns a bias-free ``nn.Linear`` whose ``weight`` keeps
transformers' name and (out, in) layout; with ``model.scale.*`` switched on it returns the scaled form
from ``model/scale.py``, whose extra vectors fold back into ``weight`` exactly on export.
"""

from __future__ import annotations

from torch import nn

from ..configs import ModelConfig


def make_linear(cfg: ModelConfig, in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)
