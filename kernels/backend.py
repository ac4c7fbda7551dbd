"""Which implementation of a fused op runs: the backend switch every op folder and model module uses.

Backends:

- ``reference``: the pure-torch formula kept beside each kernel (``kernels/<op>/reference.py``). Runs
  everywhere; it is what the kernels are tested against.
- ``triton``: our Triton kernels. On a CUDA device always (with triton installed); on the CPU only under
  Triton's interpreter, i.e. ``TRITON_INTERPRET=1`` in the environment *before* the process decorates any
  kernel (set it before starting Python). That is how CI runs them: slowly, at tiny shapes.
- The field's libraries, each through an adapter of ours with the op's exact semantics (imported lazily; the
  ``.[gpu]`` extra installs them): ``sdpa`` (attention: torch's scaled_dot_product_attention, cuDNN's kernel
  where it applies, then the fused gate), ``flex`` (attention: torch's flex_attention with a causal x document
  block mask, compiled once per shape), ``flash-attn`` (attention: flash-attn's CUDA kernels), ``fla``
  (the delta rule: fla-core's chunked kernels, FlashQLA's where fla dispatches to them; the short convolution:
  fla's Triton causal conv), ``causal-conv1d`` (the short convolution: Dao-AILab's CUDA kernel).

A config asks per op (``model.kernels.<op>``) for one of these or ``auto``. ``auto`` is the fastest correct
backend on the device of the tensors: on the CPU ``reference`` (the interpreter is a test tool, not a
speed-up); on CUDA, for the ops with peers (``TUNED_OPS``), the one kernels/tune.py measured fastest among
those that agree with the reference at the call's shape class (cached per machine), and for the others, or
where no measurement may run (inside a torch.compile trace), the first runnable entry of ``AUTO_ORDER``. An
explicit backend that cannot run where it is asked is refused with a `BackendError` naming the op, the
device, why, and what to choose instead -- never silently replaced by another.

Before a run builds anything, `admissible` answers the same questions for the model's sizes (kernels/limits.py:
the chunk sizes, head dims and filter widths each backend takes): the job's layout check asks it
(train/parallel/layout.py), so a config no backend on the device can run stops at load, not at the first forward.
Those rules (which backend runs where, what a config may ask for) live in kernels/rules.py, which imports no torch
so that the command line can check a config without it; this module re-exports them and dispatches the calls.

Op folders follow one layout (``kernels/<op>/``): ``reference.py`` (pure torch), ``triton_kernels.py``
(the ``@triton.jit`` kernels and their launchers; imported lazily, so the package works without triton),
``op.py`` (torch custom ops with fake implementations, an ``autograd.Function``, and the public function
taking ``backend=``). Nothing under ``kernels/`` imports ``torch.distributed``.
"""

from __future__ import annotations

import contextlib

import torch

from hybridtron.kernels import rules
from hybridtron.kernels.rules import (  # noqa: F401  (the switch's rules, asked as backend.<name> by the ops, the model and tests)
    AUTO_ORDER,
    BACKENDS,
    CHOICES,
    FP8_EMULATE_ENV,
    OPS,
    PEERS,
    TUNED_OPS,
    BackendError,
    admissible,
    check_choice,
    device_type_of,
    flash_attn_installed,
    flash_attn_unavailable_reason,
    flex_unavailable_reason,
    fp8_emulated,
    fp8_unavailable_reason,
    installed,
    interpreter_requested,
    peer_unavailable_reason,
    triton_installed,
    triton_unavailable_reason,
    unavailable_reason,
)


def _device_type(device: str | torch.device | None) -> str:  # resolve's seam (a test sees CPU tensors as CUDA)
    return rules.device_type_of(device)


def resolve(op: str, requested: str = "auto", device: str | torch.device | None = None) -> str:
    """The backend that runs ``op`` on ``device`` for the config value ``requested``.

    ``auto``: on CUDA the first runnable backend of ``AUTO_ORDER[op]``, elsewhere ``reference``. An explicit
    backend is returned as is when it can run, and refused (BackendError) when it cannot.
    """
    check_choice(op, requested)
    dev = _device_type(device)
    if requested == "auto":
        if dev != "cuda":
            return "reference"
        return next(b for b in AUTO_ORDER[op] if unavailable_reason(b, dev) is None)
    why = unavailable_reason(requested, dev)
    if why is not None:
        raise BackendError(
            f"model.kernels.{op}={requested} cannot run on {dev}: {why}. Choose model.kernels.{op}=auto (on {dev}: "
            f"{resolve(op, 'auto', dev)}) or reference"
        )
    return requested


_resolved: dict[tuple[str, str, str], str] = {}
_forced: dict[tuple[str, str], str] = {}  # (op, device type) -> backend, while `forced` holds


@contextlib.contextmanager
def forced(choices: dict[str, str], device_type: str):
    """Within: every request of the ops in ``choices`` on ``device_type`` (auto or explicit) runs the given backend,
    unchecked. For the memory planner's fake run (train/plan/memory.py), whose CPU tensors must take the GPU's kernels
    (their custom ops' fake implementations give the shapes, no kernel runs)."""
    saved = dict(_forced)
    _forced.update({(op, device_type): b for op, b in choices.items()})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def forced_choice(op: str, device_type: str) -> str | None:
    """The backend `forced` holds for ``op`` on ``device_type`` now, or None."""
    return _forced.get((op, device_type))


def _constant_under_compile(fn):
    """What ``torch.compiler.assume_constant_result`` does (torch 2.13: it sets this mark), without importing
    torch._dynamo when this module is imported: that import costs ~3.5 s of CPU in every process (every rank,
    every CLI command), also in those that never compile. The compile tests fail if the mark stops working."""
    fn._dynamo_marked_constant = True
    return fn


# kernels/tune.py, registered by hybridtron.model (for its ops: model/__init__.py) or by a caller measuring ops itself: an object with
# ``measures_on(device_type)`` and ``choose(op, shape, device_type)``. The tuner builds on this module, so this module
# asks it through this slot rather than importing it back.
_tuner = None


def use_tuner(tuner) -> None:
    """Let ``auto`` of the TUNED_OPS be decided by ``tuner`` on the device types its ``measures_on`` accepts."""
    global _tuner
    _tuner = tuner


@_constant_under_compile
def pick(op: str, requested: str, device_type: str, shape: tuple | None = None) -> str:
    """`resolve` for a model's forward, cached per (op, request, device type); for ``auto`` on a device the tuner
    measures on (CUDA), the decision kernels/tune.py keeps for the call's ``shape`` class (each op's
    ``shape_class``). torch.compile treats the answer as a constant, so the switch costs nothing in a compiled
    graph and causes no graph break (no measurement runs inside a trace: the tuner answers from what it knows)."""
    hit = _forced.get((op, device_type))
    if hit is not None:
        return hit
    if requested == "auto" and shape is not None and op in TUNED_OPS and _tuner is not None:
        if _tuner.measures_on(device_type):
            return _tuner.choose(op, shape, device_type)
    key = (op, requested, device_type)
    hit = _resolved.get(key)
    if hit is None:
        hit = _resolved[key] = resolve(op, requested, device_type)
    return hit


def is_distributed(t: torch.Tensor | None) -> bool:
    """A DTensor (tensor parallel hands them to modules whose inputs its plans rewrite). Duck-typed, so
    nothing under kernels/ imports torch.distributed."""
    return t is not None and type(t) is not torch.Tensor and hasattr(t, "placements") and hasattr(t, "to_local")


def pick_for(op: str, requested: str, *tensors: torch.Tensor | None, shape: tuple | None = None) -> str:
    """`pick` for the device of ``tensors[0]`` (and the call's ``shape`` class, for the tuned ops), except that
    DTensor inputs go to the reference (torch's DTensor rules know its ops; our custom ops take plain tensors):
    ``auto`` resolves to it, an explicit kernel request is refused."""
    if any(is_distributed(t) for t in tensors):
        if requested in ("auto", "reference"):
            return "reference"
        raise BackendError(
            f"model.kernels.{op}={requested} takes plain tensors, but tensor parallelism hands this op DTensors; "
            f"choose model.kernels.{op}=auto (the reference under tensor parallelism) or reference"
        )
    return pick(op, requested, tensors[0].device.type, shape)


def clear_cache() -> None:
    """Forget resolved backends (tests that change TRITON_INTERPRET or what is installed)."""
    _resolved.clear()
    for fn in (rules.triton_installed, rules.installed, rules._flex_attention_found):
        getattr(fn, "cache_clear", lambda: None)()  # (a test may have replaced them)


def check_interpreted(kernel, device: torch.device) -> None:
    """Before launching ``kernel`` on a CPU tensor: it must have been decorated under the interpreter.

    TRITON_INTERPRET is read when ``@triton.jit`` runs (at import of a kernel module), so setting it later in
    the process has no effect; say so instead of failing deep inside triton's GPU launcher.
    """
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    inner = kernel
    while not isinstance(inner, InterpretedFunction) and hasattr(inner, "fn"):  # autotuner / heuristics wrappers
        inner = inner.fn
    if not isinstance(inner, InterpretedFunction):
        raise BackendError(
            f"Triton kernel {getattr(kernel, '__name__', kernel)!r} was compiled for the GPU, but its tensors are on "
            f"{device.type}: TRITON_INTERPRET=1 must be in the environment before the kernels are imported (set it "
            f"before starting Python), or choose the reference backend"
        )


def starts_from_cu_seqlens(cu_seqlens: torch.Tensor, T: int, op: str) -> torch.Tensor:
    """(1, T) bool, True where a packed sequence after the first starts, from cumulative sequence lengths
    [0, l0, l0 + l1, ..., T] (flash-attn's and fla's convention, batch 1). The first sequence is not marked: it
    continues a given initial state or cache, as a call's first document does everywhere in this project."""
    cu = cu_seqlens
    if cu.dim() != 1 or cu.is_floating_point() or cu.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor [0, ..., T]; got {cu.dtype} {tuple(cu.shape)}")
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens must rise from 0 to the packed length T={T}; got {cu.tolist()}")
    starts = torch.zeros(1, T + 1, dtype=torch.bool, device=cu.device)
    starts[0, cu[1:-1].long()] = True
    return starts[:, :T]
