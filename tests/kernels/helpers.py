"""Run a kernel and its reference on the same inputs and cotangents, in a dtype and in float64, and apply
the accuracy rule of kernels/testing.py to every output and every input gradient."""

from __future__ import annotations

import torch

from hybridtron.kernels.testing import Bf16MatmulOperands, reference_errors  # noqa: F401  (re-exported)


def check_against_reference(name, kernel_fn, ref_fn, inputs, dtypes, factor=3.0, seed=0, ref_mode=None):
    """inputs: float64 tensors (integer tensors pass as they are); dtypes: the dtype each float input takes in
    the low-precision run (None: the input's own). Compares kernel(dtype) and ref(dtype) against ref(float64
    of the same rounded inputs), for outputs and all float inputs' gradients (kernels/testing.py's
    `reference_errors`, the check the backend tuner makes too). ``ref_mode``: a context manager (e.g.
    ``Bf16MatmulOperands``) around the low-precision reference run, forward and backward."""
    errors = reference_errors(name, kernel_fn, ref_fn, inputs, dtypes, factor=factor, seed=seed, ref_mode=ref_mode)
    assert not errors, "; ".join(errors)


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


def fake_timer(times: dict[str, float], log: list | None = None, tick=None):
    """A timer for kernels/tune.py (``tune.configure(timer=...)``): each candidate runs once, so a failure in it
    becomes its entry, and is given the time the test names (3.0 ms for one it does not name). ``log`` collects the
    candidates of every call; ``tick()`` runs once per call (a test's clock)."""
    def timer(fns, device):
        if tick is not None:
            tick()
        out = {}
        for name, fn in fns.items():
            try:
                fn()
                out[name] = times.get(name, 3.0)
            except Exception as e:  # noqa: BLE001  (the tuner drops it with this as the reason)
                out[name] = e
        if log is not None:
            log.append(sorted(fns))
        return out

    return timer
