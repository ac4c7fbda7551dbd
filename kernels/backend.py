"""Which implementation of a fused op runs: the backend switch every op folder and model module uses.

Backends:

- ``reference``: the pure-torch formula kept beside each kernel (``kernels/<op>/reference.py``). Runs
  everywhere; it is what the kernels are tested against.
- ``triton``: our Triton kernels. On a CUDA device always (with triton installed); on the CPU only under
  Triton's interpreter, i.e. ``TRITON_INTERPRET=1`` in the environment *before* the process decorates any
  kernel (set it before starting Python). That is how CI runs them: slowly, at tiny shapes.
- ``flash-attn``: the flash-attn package's CUDA kernels (attention only; CUDA only).

A config asks per op (``model.kernels.<op>``) for one of these or ``auto``. ``auto`` is the fastest
correct backend that can run on the device of the tensors: on CUDA the first runnable entry of the op's
``AUTO_ORDER``; on the CPU ``reference`` (the interpreter is a test tool, not a speed-up). An explicit
backend that cannot run where it is asked is refused with a `BackendError` naming the op, the device, why,
and what to choose instead -- never silently replaced by another.

Op folders follow one layout (``kernels/<op>/``): ``reference.py`` (pure torch), ``triton_kernels.py``
(the ``@triton.jit`` kernels and their launchers; imported lazily, so the package works without triton),
``op.py`` (torch custom ops with fake implementations, an ``autograd.Function``, and the public function
taking ``backend=``). Nothing under ``kernels/`` imports ``torch.distributed``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("reference", "triton", "flash-attn")
CHOICES = ("auto", *BACKENDS)

# Backends each op implements, and the order ``auto`` tries them in on CUDA (fastest correct first).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "norm": ("triton", "reference"),
    "rotary": ("triton", "reference"),
    "swiglu": ("triton", "reference"),
    # Ours first: it fuses the gate, takes fp32 and any head dim up to 256, and reads documents without a host
    # sync; flash-attn (bf16/fp16, head dims a multiple of 8, gate applied apart) when asked for by name.
    "attention": ("triton", "flash-attn", "reference"),
    "cross_entropy": ("triton", "reference"),
    "conv": ("triton", "reference"),  # short causal depthwise convolution + SiLU (Gated DeltaNet)
    "moe": ("triton", "reference"),  # MoE token permute / unpermute
    "delta_rule": ("triton", "reference"),  # chunked gated delta rule (training, prefill); recurrent for decoding
    "hax": ("triton", "reference"),  # gathered sparse attention of the HAX branch (model/hax.py)
}
OPS = tuple(AUTO_ORDER)

_TRUE = ("1", "true", "yes", "on", "y")  # what triton's knobs read as true


class BackendError(ValueError):
    """A kernel backend that is unknown, not implemented for an op, or cannot run on this device."""


def interpreter_requested() -> bool:
    """TRITON_INTERPRET is set to a true value in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _device_type(device: str | torch.device | None) -> str:
    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def triton_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    """None when our Triton kernels can run on ``device`` (None/"auto": where a run would go), else why not."""
    if not triton_installed():
        return "triton is not installed (pip install triton, or the project's .[dev] / .[gpu] extras)"
    dev = _device_type(device)
    if dev == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        return None
    if dev == "cpu":
        if not interpreter_requested():
            return ("Triton kernels need a CUDA GPU; on the CPU they run only under Triton's interpreter: start the "
                    "process with TRITON_INTERPRET=1 in the environment (set before triton is imported)")
        return None
    return f"Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {dev!r}"


def flash_attn_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    if _device_type(device) != "cuda":
        return "flash-attn runs on CUDA GPUs only"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not flash_attn_installed():
        return "the flash-attn package is not installed (pip install flash-attn, or the project's .[gpu] extra)"
    return None


def unavailable_reason(backend: str, device: str | torch.device | None = None) -> str | None:
    """None when ``backend`` can run on ``device``, else a sentence saying why not."""
    if backend == "reference":
        return None
    if backend == "triton":
        return triton_unavailable_reason(device)
    if backend == "flash-attn":
        return flash_attn_unavailable_reason(device)
    raise BackendError(f"unknown kernel backend {backend!r}; choose one of {list(CHOICES)}")


def check_choice(op: str, requested: str) -> None:
    """Static checks (no device): the op exists and implements the requested backend."""
    if op not in AUTO_ORDER:
        raise BackendError(f"unknown fused op {op!r}; the ops are {list(OPS)}")
    if requested not in CHOICES:
        raise BackendError(f"model.kernels.{op}={requested!r} is not a backend; choose one of {list(CHOICES)}")
    if requested != "auto" and requested not in AUTO_ORDER[op]:
        raise BackendError(
            f"model.kernels.{op}={requested}: {requested} does not implement {op}; choose one of "
            f"{['auto', *AUTO_ORDER[op]]}"
        )


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


def _constant_under_compile(fn):
    """What ``torch.compiler.assume_constant_result`` does (torch 2.13: it sets this mark), without importing
    torch._dynamo when this module is imported: that import costs ~3.5 s of CPU in every process (every rank,
    every CLI command), also in those that never compile. The compile tests fail if the mark stops working."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def pick(op: str, requested: str, device_type: str) -> str:
    """`resolve` for a model's forward, cached per (op, request, device type). torch.compile treats the answer
    as a constant, so the switch costs nothing in a compiled graph and causes no graph break."""
    key = (op, requested, device_type)
    hit = _resolved.get(key)
    if hit is None:
        hit = _resolved[key] = resolve(op, requested, device_type)
    return hit


def is_distributed(t: torch.Tensor | None) -> bool:
    """A DTensor (tensor parallel hands them to modules whose inputs its plans rewrite). Duck-typed, so
    nothing under kernels/ imports torch.distributed."""
    return t is not None and type(t) is not torch.Tensor and hasattr(t, "placements") and hasattr(t, "to_local")


def pick_for(op: str, requested: str, *tensors: torch.Tensor | None) -> str:
    """`pick` for the device of ``tensors[0]``, except that DTensor inputs go to the reference (torch's DTensor
    rules know its ops; our custom ops take plain tensors): ``auto`` resolves to it, an explicit Triton or
    flash-attn request is refused."""
    if any(is_distributed(t) for t in tensors):
        if requested in ("auto", "reference"):
            return "reference"
        raise BackendError(
            f"model.kernels.{op}={requested} takes plain tensors, but tensor parallelism hands this op DTensors; "
            f"choose model.kernels.{op}=auto (the reference under tensor parallelism) or reference"
        )
    return pick(op, requested, tensors[0].device.type)


def clear_cache() -> None:
    """Forget resolved backends (tests that change TRITON_INTERPRET or what is installed)."""
    _resolved.clear()
    for fn in (triton_installed, flash_attn_installed):
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
