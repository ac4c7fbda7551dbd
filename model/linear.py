"""The one place projections are made, so reparameterisations (scale vectors) apply to all of them.

``make_linear(cfg, in_features, out_features)`` returns a bias-free ``nn.Linear`` whose ``weight`` keeps
transformers' name and (out, in) layout; with ``model.scale.*`` switched on it returns the scaled form
from ``model/scale.py``, whose extra vectors fold back into ``weight`` exactly on export.
"""

from __future__ import annotations

from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.model.scale import ScaledLinear


def make_linear(
    cfg: ModelConfig,
    in_features: int,
    out_features: int,
    *,
    after_norm: bool = False,
    feeds_norm: bool = False,
    residual_out: bool = False,
) -> nn.Linear:
    """A projection; the keywords say where it sits, which decides its scale vectors and init.

    after_norm: reads a block's pre-mixer / pre-FFN norm (q/k/v, gates, up, in_proj_*): its in_scale
        replaces that norm's shared gain under ``branch_specific``.
    feeds_norm: its output goes straight into an RMSNorm (q/k with qk_norm): no out_scale, which the
        norm would partly cancel (see model/scale.py).
    residual_out: writes into the residual stream (o_proj, down_proj, out_proj): initialised with the
        depth-scaled out_std. A plain nn.Linear gets that from its name in GatedLM.init_weights instead.
    """
    s = cfg.scale
    in_scale = s.two_sided or (s.branch_specific and after_norm)
    out_scale = s.two_sided and not feeds_norm
    if not (in_scale or out_scale):
        return nn.Linear(in_features, out_features, bias=False)
    return ScaledLinear(
        in_features,
        out_features,
        in_scale=in_scale,
        out_scale=out_scale,
        magnitude_direction=s.magnitude_direction,
        residual_out=residual_out,
        decay_rule=s.decay_rule,
    )
