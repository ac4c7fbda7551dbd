"""The accuracy rule every kernel test uses (DESIGN principle 6).

A kernel computing in dtype ``d`` is compared with the reference run in float64 on the same inputs
(``ref64``), and the reference run in ``d`` itself (``ref_d``) gives the scale: the kernel's error may be
at most ``factor`` times the reference's own error, plus a floor ``atol`` for outputs the reference
happens to get (almost) exactly right, where a ratio means nothing:

    max|kernel - ref64| <= factor * max|ref_d - ref64| + atol

With ``factor`` 2-4 this catches a wrong formula (errors of O(1)), a missing mask (garbage in the tail
block) or a lost fp32 accumulation (errors of bf16 size where the reference keeps fp32), while allowing
a different summation order.
"""

from __future__ import annotations

import torch


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_reference_error(
    name: str,
    out: torch.Tensor,
    ref_d: torch.Tensor,
    ref64: torch.Tensor,
    factor: float = 3.0,
    atol: float | None = None,
) -> None:
    """Raise AssertionError unless ``out`` is as close to ``ref64`` as the rule above allows."""
    if out.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: non-finite values in the kernel's output")
    if atol is None:
        # Ulps of the output's dtype at the reference's magnitude: one in 16-bit dtypes, where rounding the output
        # already gives the reference half an ulp of error to scale by; four in fp32, where the reference's error
        # is tiny and another summation order (a kernel's partial sums, tf32x3 products) legitimately exceeds
        # three times it.
        scale = ref64.abs().max().item() if ref64.numel() else 0.0
        ulps = 1 if torch.finfo(out.dtype).bits <= 16 else 4
        atol = ulps * torch.finfo(out.dtype).eps * max(scale, 1e-6)
    err, ref_err = max_err(out, ref64), max_err(ref_d, ref64)
    bound = factor * ref_err + atol
    if not err <= bound:
        raise AssertionError(
            f"{name}: max error vs float64 {err:.3e} exceeds {factor} x the reference's own error {ref_err:.3e} "
            f"+ {atol:.1e} = {bound:.3e} (dtype {out.dtype}, shape {tuple(out.shape)})"
        )
