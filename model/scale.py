"""Scale vectors (Wang et al., "Negligible in Size, Significant in Effect: On Scale Vectors in LLMs").

Three switches of ``model.scale``, each usable alone:

- ``branch_specific``: the pre-mixer and pre-FFN norms lose their gain; every projection reading them
  (q/k/v/gate_proj, the SwiGLU's gate/up, the delta-rule in_proj_*) gets its own ``in_scale``.
- ``two_sided``: every projection computes ``diag(s_out) W diag(s_in) x`` (``in_scale``, ``out_scale``).
- ``magnitude_direction``: every scale vector, norms' gains included, is ``m * d / ||d|| * sqrt(n)``
  (``<name>_m`` of shape (1,), ``<name>_d`` of shape (n,), both init 1, so the vector starts at all ones).

Each vector folds exactly into the plain Qwen3.5 layout (`fold_scale_vectors`): a projection's scales
multiply the rows and columns of its own ``weight``; a gainless norm exports an identity gain, which is
exact because its gain now lives in the ``in_scale`` of each consumer, folded into that consumer's columns.

Where an out_scale would feed an RMSNorm (q_proj/k_proj with ``qk_norm``), there is none. Folding it
would be exact (it scales W's rows, before the norm), but the norm is invariant to a scale that is
uniform over a head, so part of the vector is invisible to the loss: in magnitude-direction form
k_proj's magnitude would never get a gradient, and weight decay would shrink it into the norm's eps.
q_norm/k_norm's own gains already are the Output-Norm scales at that spot. The fused elementwise gate
rows of q_proj go without an out_scale too (one vector per matrix); every other projection has both.

Weight decay (``decay_rule``): a module may carry ``param_decay``, {local parameter name: decay?}, which
`train.optim.param_groups` obeys. Input-Norm scales (feeding a linear map: in_scale, the pre-mixer,
pre-FFN and final norms' gains) decay; Output-Norm scales (out_scale, q_norm/k_norm gains) do not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ModelConfig


def md_vector(m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """m * d / ||d|| * sqrt(n) with the norm in fp32 at least (a bf16 norm of a long vector is coarse)."""
    dtype = torch.promote_types(d.dtype, torch.float32)
    df = d.to(dtype)
    return m.to(dtype) * df * (math.sqrt(df.numel()) / torch.linalg.vector_norm(df))


def scale_param_names(name: str, magnitude_direction: bool) -> tuple[str, ...]:
    return (f"{name}_m", f"{name}_d") if magnitude_direction else (name,)


def add_scale(module: nn.Module, name: str, n: int, magnitude_direction: bool) -> None:
    """Register scale vector ``name`` (n,) on ``module``, all ones: one parameter, or magnitude + direction."""
    if magnitude_direction:
        module.register_parameter(f"{name}_m", nn.Parameter(torch.ones(1)))
        module.register_parameter(f"{name}_d", nn.Parameter(torch.ones(n)))
    else:
        module.register_parameter(name, nn.Parameter(torch.ones(n)))


def get_scale(module: nn.Module, name: str) -> torch.Tensor | None:
    """The value of scale vector ``name``, or None when ``module`` has none."""
    params = module._parameters
    if f"{name}_m" in params:
        return md_vector(params[f"{name}_m"], params[f"{name}_d"])
    return params.get(name)


@torch.no_grad()
def reset_scale(module: nn.Module, name: str) -> None:
    for pname in (name, f"{name}_m", f"{name}_d"):
        p = module._parameters.get(pname)
        if p is not None:
            p.fill_(1.0)


class ScaledLinear(nn.Linear):
    """Bias-free ``y = diag(s_out) W diag(s_in) x``; ``weight`` keeps nn.Linear's name and (out, in) layout.

    The forward scales activations rather than building W' each step: (in + out) multiplies per token
    against in * out per weight, and W' would be one more weight-sized tensor kept for the backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        in_scale: bool,
        out_scale: bool,
        magnitude_direction: bool = False,
        residual_out: bool = False,
        decay_rule: bool = False,
    ):
        super().__init__(in_features, out_features, bias=False)
        self.residual_out = residual_out  # writes into the residual stream: init with out_std
        self.magnitude_direction = magnitude_direction
        self.scale_names = tuple(n for n, on in (("in_scale", in_scale), ("out_scale", out_scale)) if on)
        for name in self.scale_names:
            add_scale(self, name, in_features if name == "in_scale" else out_features, magnitude_direction)
        if decay_rule:
            # in_scale feeds this map (Input-Norm role), out_scale acts on its output (Output-Norm role).
            self.param_decay = {
                p: name == "in_scale" for name in self.scale_names for p in scale_param_names(name, magnitude_direction)
            }

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        # Same draw as a plain nn.Linear under the LM's init loop, so scales at 1 give the plain model.
        nn.init.normal_(self.weight, mean=0.0, std=out_std if self.residual_out else std)
        for name in self.scale_names:
            reset_scale(self, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s_in = get_scale(self, "in_scale")
        if s_in is not None:
            x = x * s_in.to(x.dtype)
        y = F.linear(x, self.weight)
        s_out = get_scale(self, "out_scale")
        if s_out is not None:
            y = y * s_out.to(y.dtype)
        return y

    @torch.no_grad()
    def folded_state(self, ref: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"weight": diag(s_out) W diag(s_in)} in the weight's dtype (computed in fp32 at least)."""
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        w = self.weight.to(dtype)
        s_in, s_out = get_scale(self, "in_scale"), get_scale(self, "out_scale")
        if s_in is not None:
            w = w * s_in.to(dtype)[None, :]
        if s_out is not None:
            w = w * s_out.to(dtype)[:, None]
        return {"weight": w.to(self.weight.dtype)}

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, scales={list(self.scale_names)}, "
            f"magnitude_direction={self.magnitude_direction}, residual_out={self.residual_out}"
        )


def norm_kwargs(cfg: ModelConfig, *, feeds_linear: bool, branched: bool = False) -> dict:
    """build_norm keywords for a norm under ``cfg.scale``; {} with every switch off (the plain norm).

    feeds_linear: the norm's output enters a linear map (an Input-Norm: pre-mixer, pre-FFN, final norm)
    rather than being a map's output normalised (q_norm, k_norm). branched: each consumer of the norm has
    its own in_scale under branch_specific, so the norm itself carries no gain.
    """
    s = cfg.scale
    kw: dict = {}
    if s.branch_specific and branched:
        kw["gain"] = False
    if s.magnitude_direction:
        kw["magnitude_direction"] = True
    if s.decay_rule:
        kw["decay"] = feeds_linear
    return kw


@torch.no_grad()
def fold_scale_vectors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in the plain layout: loads into the same config with every
    ``model.scale`` switch off and computes the same function.

    A module with ``folded_state(ref)`` (ScaledLinear, RMSNorm) replaces its own parameters by what it
    returns; everything else is copied as is. ``ref`` gives dtype and device to values a module has
    no parameter for (a gainless norm's identity gain).
    """
    ref = next(model.parameters())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        fold = getattr(module, "folded_state", None)
        if fold is None:
            continue
        prefix = f"{name}." if name else ""
        for pname in module._parameters:
            state.pop(prefix + pname, None)
        state.update({prefix + k: v.detach().clone() for k, v in fold(ref).items()})
    return state
