"""The argument checks every gated-delta-rule kernel entry point makes (chunk.py, recurrent.py): shapes, dtypes
and devices, each refused with the argument's name and what it must be."""

from __future__ import annotations

import torch


def check_inputs(fn: str, q, k, v, g, beta, resets, initial_state) -> None:
    """Raise ValueError naming the first argument of ``fn`` that does not fit the reference's shapes: q (B, T, Hk,
    Dk); k (B, T, n_h, Hk, Dk); v (B, T, n_h, Hv, Dv) with Hv a multiple of Hk; g (B, T, Hv); beta (B, T, n_h,
    Hv); resets (B, T) bool or None; initial_state (B, Hv, Dk, Dv) or None; floating point, on one device."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{fn}: {name} is {x.dtype}; it must be floating point (float16, bfloat16, float32 "
                             f"or float64)")
    if q.dim() != 4:
        raise ValueError(f"{fn}: q has shape {tuple(q.shape)}; it must be (B, T, Hk, Dk)")
    B, T, Hk, Dk = q.shape
    if k.dim() != 5 or k.shape[:2] != (B, T) or k.shape[3:] != (Hk, Dk) or k.shape[2] < 1:
        raise ValueError(f"{fn}: k has shape {tuple(k.shape)}; it must be (B, T, n_h, Hk, Dk) = ({B}, {T}, n_h, {Hk}, "
                         f"{Dk}), q's B, T, Hk, Dk with n_h >= 1 keys per token (DeltaProduct's sub-steps; 1 for "
                         f"Gated DeltaNet)")
    n_h = k.shape[2]
    if v.dim() != 5 or v.shape[:3] != (B, T, n_h):
        raise ValueError(f"{fn}: v has shape {tuple(v.shape)}; it must be (B, T, n_h, Hv, Dv) = ({B}, {T}, {n_h}, Hv, "
                         f"Dv)")
    Hv, Dv = v.shape[3:]
    if Hk == 0 or Hv == 0 or Hv % Hk:
        raise ValueError(f"{fn}: v has {Hv} value heads and q and k {Hk} key heads; the value heads must be a "
                         f"positive multiple of the key heads (key head h serves value heads h*r .. h*r + r - 1)")
    if g.shape != (B, T, Hv):
        raise ValueError(f"{fn}: g has shape {tuple(g.shape)}; it must be (B, T, Hv) = ({B}, {T}, {Hv}), one log "
                         f"decay per token and value head")
    if beta.shape != (B, T, n_h, Hv):
        raise ValueError(f"{fn}: beta has shape {tuple(beta.shape)}; it must be (B, T, n_h, Hv) = ({B}, {T}, {n_h}, "
                         f"{Hv}), one write strength per sub-step and value head")
    if resets is not None and (resets.shape != (B, T) or resets.dtype != torch.bool):
        raise ValueError(f"{fn}: resets is {resets.dtype} of shape {tuple(resets.shape)}; it must be bool of shape "
                         f"(B, T) = ({B}, {T}), True where a token starts a document")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"{fn}: initial_state has shape {tuple(initial_state.shape)}; it must be (B, Hv, Dk, Dv) = "
                         f"({B}, {Hv}, {Dk}, {Dv}), the state after the previous tokens")
    devices = {x.device for x in (q, k, v, g, beta, resets, initial_state) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"{fn}: the inputs are on several devices {sorted(map(str, devices))}; put them on one")
