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

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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


class Bf16MatmulOperands(TorchDispatchMode):
    """Every float32 matrix product (forward and backward) multiplies its operands rounded to bf16, accumulating
    in fp32: the arithmetic of tensor-core dots on bf16 operands. Under it a reference computes as a kernel that
    feeds its dots bf16 operands does, so the accuracy rule holds that kernel to a factor of the error bf16
    operands must make, not of fp32's."""

    PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "addbmm"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.removeprefix("aten::") in self.PRODUCTS:
            args = tuple(a.to(torch.bfloat16).to(a.dtype) if isinstance(a, torch.Tensor) and a.dtype == torch.float32
                         else a for a in args)
        return func(*args, **(kwargs or {}))


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _run(fn, leaves, cotangents, grad: bool):
    leaves = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in leaves]
    with torch.enable_grad() if grad else torch.no_grad():
        outs = [o for o in _as_tuple(fn(*leaves))]
    if not grad:
        return [o.detach() for o in outs], []
    diff = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(outs, diff, [c.to(o.dtype) for c, o in zip(cotangents, outs, strict=True)],
                                allow_unused=True)
    return [o.detach() for o in outs], [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, diff,
                                                                                                   strict=True)]


def reference_errors(name, kernel_fn, ref_fn, inputs, dtypes, factor=3.0, atol=None, seed=0, ref_mode=None,
                     grad: bool = True) -> list[str]:
    """The accuracy rule applied to every output and (``grad``) every float input's gradient of ``kernel_fn``:
    one message per tensor outside it, none when all agree.

    inputs: float64 tensors (integer tensors pass as they are); dtypes: the dtype each float input takes in the
    low-precision run (None: the input's own). Compares kernel(dtype) and ref(dtype) against ref(float64 of the
    same rounded inputs). ``ref_mode``: a context manager class (e.g. `Bf16MatmulOperands`) around the
    low-precision reference run, forward and backward. The kernel tests and the backend tuner (kernels/tune.py)
    both judge by this."""
    low = [t.to(d) if (t.is_floating_point() and d is not None) else t for t, d in zip(inputs, dtypes, strict=True)]
    high = [t.double() if t.is_floating_point() else t for t in low]
    with torch.no_grad():
        probe = _as_tuple(ref_fn(*high))
    g = torch.Generator(device=probe[0].device).manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g, dtype=torch.float64, device=o.device) for o in probe]
    with ref_mode() if ref_mode is not None else contextlib.nullcontext():
        out_r, grad_r = _run(ref_fn, low, cot, grad)
    # Every run gets the cotangents as the low-precision outputs hold them: the float64 run must not see digits
    # the others never had, or its gradients differ from both by the rounding of the cotangent.
    cot = [c.to(o.dtype).double() for c, o in zip(cot, out_r, strict=True)]
    out_k, grad_k = _run(kernel_fn, low, cot, grad)
    out_64, grad_64 = _run(ref_fn, high, cot, grad)
    if len(out_k) != len(out_r):
        return [f"{name}: {len(out_k)} outputs, the reference gives {len(out_r)}"]
    errors = []
    pairs = [(f"output {i}", t) for i, t in enumerate(zip(out_k, out_r, out_64, strict=True))]
    pairs += [(f"grad of input {i}", t) for i, t in enumerate(zip(grad_k, grad_r, grad_64, strict=True))]
    for what, (k, r, h) in pairs:
        try:
            if k.dtype != r.dtype:
                raise AssertionError(f"{name} {what}: {k.dtype}, the reference gives {r.dtype}")
            assert_within_reference_error(f"{name} {what}", k, r, h, factor, atol)
        except AssertionError as e:
            errors.append(str(e))
    return errors
