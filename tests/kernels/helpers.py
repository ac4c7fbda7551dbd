"""Run a kernel and its reference on the same inputs and cotangents, in a dtype and in float64, and apply
the accuracy rule of kernels/testing.py to every output and every input gradient."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.kernels.testing import assert_within_reference_error


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _run(fn, leaves, cotangents):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in leaves]
    outs = _as_tuple(fn(*leaves))
    diff = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(outs, diff, [c.to(o.dtype) for c, o in zip(cotangents, outs, strict=True)],
                                allow_unused=True)
    return [o.detach() for o in outs], [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, diff,
                                                                                                   strict=True)]


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


def check_against_reference(name, kernel_fn, ref_fn, inputs, dtypes, factor=3.0, seed=0, ref_mode=None):
    """inputs: float64 tensors (integer tensors pass as they are); dtypes: the dtype each float input takes in
    the low-precision run (None: the input's own). Compares kernel(dtype) and ref(dtype) against ref(float64
    of the same rounded inputs), for outputs and all float inputs' gradients. ``ref_mode``: a context manager
    (e.g. ``Bf16MatmulOperands``) around the low-precision reference run, forward and backward."""
    low = [t.to(d) if (t.is_floating_point() and d is not None) else t for t, d in zip(inputs, dtypes, strict=True)]
    high = [t.double() if t.is_floating_point() else t for t in low]
    with torch.no_grad():
        probe = _as_tuple(ref_fn(*high))
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in probe]
    with ref_mode() if ref_mode is not None else contextlib.nullcontext():
        out_r, grad_r = _run(ref_fn, low, cot)
    # Every run gets the cotangents as the low-precision outputs hold them: the float64 run must not see digits
    # the others never had, or its gradients differ from both by the rounding of the cotangent.
    cot = [c.to(o.dtype).double() for c, o in zip(cot, out_r, strict=True)]
    out_k, grad_k = _run(kernel_fn, low, cot)
    out_64, grad_64 = _run(ref_fn, high, cot)
    for i, (k, r, h) in enumerate(zip(out_k, out_r, out_64, strict=True)):
        assert k.dtype == r.dtype, f"{name}: output {i} is {k.dtype}, the reference gives {r.dtype}"
        assert_within_reference_error(f"{name} output {i}", k, r, h, factor)
    for i, (k, r, h) in enumerate(zip(grad_k, grad_r, grad_64, strict=True)):
        assert k.dtype == r.dtype, f"{name}: gradient {i} is {k.dtype}, the reference gives {r.dtype}"
        assert_within_reference_error(f"{name} grad of input {i}", k, r, h, factor)


def lm_loss_and_grads(model, ids, labels, doc_ids=None):
    """One forward and backward of a language model: its loss and every parameter's gradient by name (the
    ``_orig_mod.`` prefix of a compiled model dropped)."""
    model.zero_grad()
    loss = model(ids, doc_ids=doc_ids, labels=labels)
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_same_loss_and_grads(ref, tri, ids, labels, doc_ids=None) -> dict[str, torch.Tensor]:
    """``tri`` (a kernel backend) gives ``ref``'s loss and gradients on one batch; returns tri's gradients."""
    l_ref, g_ref = lm_loss_and_grads(ref, ids, labels, doc_ids)
    l_tri, g_tri = lm_loss_and_grads(tri, ids, labels, doc_ids)
    torch.testing.assert_close(l_tri, l_ref, rtol=1e-5, atol=1e-6)
    for n, g in g_ref.items():
        torch.testing.assert_close(g_tri[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    return g_tri


def assert_compiled_matches_eager(f, *leaves) -> None:
    """``torch.compile(f, fullgraph=True)`` (aot_eager: the custom ops' fake implementations and autograd through
    the traced graph, no inductor codegen) gives eager's outputs and the gradients of ``leaves``."""
    eager = f(*leaves)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(eager.sum(), leaves), torch.autograd.grad(compiled.sum(), leaves),
                    strict=True):
        torch.testing.assert_close(a, b)
