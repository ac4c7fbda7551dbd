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

Op folders follow one layout (``kernels/<op>/``): ``reference.py`` (pure torch), ``triton_kernels.py``
(the ``@triton.jit`` kernels and their launchers; imported lazily, so the package works without triton),
``op.py`` (torch custom ops with fake implementations, an ``autograd.Function``, and the public function
taking ``backend=``). Nothing under ``kernels/`` imports ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Mapping

import torch

from . import limits

BACKENDS = ("reference", "triton", "sdpa", "flex", "flash-attn", "fla", "causal-conv1d")
CHOICES = ("auto", *BACKENDS)

# Backends each op implements, in the order ``auto`` takes them on CUDA where it does not measure (ops without
# peers, or inside a torch.compile trace): ours first, the path CI tests (kernels/tune.py measures the others).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "norm": ("triton", "reference"),
    "rotary": ("triton", "reference"),
    "swiglu": ("triton", "reference"),
    "attention": ("triton", "sdpa", "flex", "flash-attn", "reference"),
    "cross_entropy": ("triton", "reference"),
    "conv": ("triton", "causal-conv1d", "fla", "reference"),  # short causal depthwise convolution + SiLU (GDN)
    "moe": ("triton", "reference"),  # MoE token permute / unpermute
    "delta_rule": ("triton", "fla", "reference"),  # chunked gated delta rule (training, prefill); recurrent decodes
    "hax": ("triton", "reference"),  # gathered sparse attention of the HAX branch (model/hax.py)
}
# The ops whose ``auto`` is decided by measurement on CUDA (kernels/tune.py): those with a peer library beside
# ours. The others keep AUTO_ORDER: ours against the eager reference only, measured faster on 2026-11-24's H100.
TUNED_OPS = ("attention", "delta_rule", "conv")
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
def installed(module: str) -> bool:
    """Whether ``module`` (a peer library) can be found, without importing it (fla imports triton and probes the
    GPU at import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flash_attn_installed() -> bool:
    return installed("flash_attn")


# backend -> (module to find, what to install): the peer libraries, each an optional GPU extra.
PEERS = {
    "flash-attn": ("flash_attn", "pip install flash-attn (a CUDA build), or the project's .[gpu] extra"),
    "fla": ("fla", "pip install fla-core (pure Python), or the project's .[gpu] extra"),
    "causal-conv1d": ("causal_conv1d", "pip install causal-conv1d (a CUDA build), or the project's .[gpu] extra"),
}


def _device_type(device: str | torch.device | None) -> str:
    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def device_type_of(device: str | None) -> str:
    """The device type of a ``train.device`` value (auto, cpu, cuda, cuda:N): auto is CUDA when one is visible."""
    return _device_type(device)


# Set in tests only: train.fp8 runs on the CPU in torchao's emulation (its casts, the matmul in high precision).
FP8_EMULATE_ENV = "HYBRIDTRON_FP8_EMULATE"


def fp8_emulated() -> bool:
    return os.environ.get(FP8_EMULATE_ENV) == "1"


def fp8_unavailable_reason(recipe: str, device_type: str, *, here: bool = True) -> str | None:
    """None when ``train.fp8=recipe`` (train/parallel/fp8.py) can run on ``device_type`` devices, else why not.
    ``here=False``: a cluster's GPU, taken as one with FP8 tensor cores."""
    if not installed("torchao"):
        return f"train.fp8={recipe} needs torchao: pip install 'hybridtron[fp8]' (or set train.fp8=none)"
    if device_type == "cpu":
        if fp8_emulated():
            return None
        return (f"train.fp8={recipe} needs a GPU with FP8 tensor cores (sm_89 or newer); on the CPU it runs only in "
                f"torchao's emulation, for tests ({FP8_EMULATE_ENV}=1): set train.fp8=none")
    if device_type != "cuda":
        return f"train.fp8={recipe} runs on CUDA GPUs, not on {device_type!r}: set train.fp8=none"
    if here and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return (f"train.fp8={recipe} needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                    f"Blackwell); this GPU, {torch.cuda.get_device_name()}, is sm_{major}{minor}: set train.fp8=none")
    return None


def triton_unavailable_reason(device: str | torch.device | None = None, *, here: bool = True) -> str | None:
    """None when our Triton kernels can run on ``device`` (None/"auto": where a run would go), else why not.
    ``here=False``: a device of that type on another machine (a cluster's node), whose GPU is taken as present."""
    if not triton_installed():
        return "triton is not installed (pip install triton, or the project's .[dev] / .[gpu] extras)"
    dev = _device_type(device)
    if dev == "cuda":
        if here and not torch.cuda.is_available():
            return "no CUDA device is visible"
        return None
    if dev == "cpu":
        if not interpreter_requested():
            return ("Triton kernels need a CUDA GPU; on the CPU they run only under Triton's interpreter: start the "
                    "process with TRITON_INTERPRET=1 in the environment (set before triton is imported)")
        return None
    return f"Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {dev!r}"


def peer_unavailable_reason(backend: str, device: str | torch.device | None = None, *, here: bool = True
                            ) -> str | None:
    """None when the peer library behind ``backend`` (PEERS) can run on ``device``, else why not: each runs on
    CUDA GPUs only (fla's Triton kernels do not run under Triton's interpreter either). ``here``: as for Triton;
    what is installed here is taken as installed there."""
    module, how = PEERS[backend]
    if _device_type(device) != "cuda":
        return f"{backend} runs on CUDA GPUs only"
    if here and not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not installed(module):
        return f"the {module} package is not installed ({how})"
    return None


def flash_attn_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    return peer_unavailable_reason("flash-attn", device)


def flex_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    """flex_attention ships with torch >= 2.5. Its backward runs on CUDA only (torch 2.13 refuses it on the CPU):
    the adapter refuses a CPU call that needs gradients; a CPU forward (evaluation) runs."""
    if not installed("torch.nn.attention.flex_attention"):
        return f"torch {torch.__version__} has no flex_attention (torch >= 2.5 has)"
    if _device_type(device) not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA (forward also on the CPU), not on {_device_type(device)!r}"
    return None


def unavailable_reason(backend: str, device: str | torch.device | None = None, *, here: bool = True) -> str | None:
    """None when ``backend`` can run on ``device``, else a sentence saying why not. ``here=False``: a device of that
    type on another machine (a cluster's node): a GPU taken as present there, what is installed here as installed
    there."""
    if backend in ("reference", "sdpa"):
        return None  # pure torch: wherever torch runs
    if backend == "triton":
        return triton_unavailable_reason(device, here=here)
    if backend == "flex":
        return flex_unavailable_reason(device)
    if backend in PEERS:
        return peer_unavailable_reason(backend, device, here=here)
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


def admissible(op: str, requested: str, device_type: str, sizes: Mapping, *, here: bool = True) -> tuple[str, ...]:
    """The backends that may run ``op`` for a model of ``sizes`` (kernels/limits.py) on ``device_type``, refused
    before anything is built: BackendError naming the field and what to choose instead.

    An explicit backend must run on the device (``here``: this machine's; else one of that type elsewhere, see
    `unavailable_reason`) and take the sizes. ``auto`` takes, on CUDA, the backends of AUTO_ORDER that run there and
    take the sizes (kernels/tune.py measures among them), the reference last; when every kernel that runs there
    refuses the sizes it is refused too, rather than running the pure-torch formula on a GPU unasked (the
    reference stays a choice: ``model.kernels.<op>=reference``). Elsewhere ``auto`` is the reference."""
    check_choice(op, requested)
    if requested != "auto":
        if (why := unavailable_reason(requested, device_type, here=here)) is not None:
            raise BackendError(f"model.kernels.{op}={requested} cannot run on {device_type}: {why}. Choose "
                               f"model.kernels.{op}=auto or reference")
        why = limits.refusal(op, requested, sizes)
        if why is not None:
            raise BackendError(f"model.kernels.{op}={requested}: {why}; change that, or choose model.kernels.{op}="
                               f"auto or reference")
        return (requested,)
    if _device_type(device_type) != "cuda":
        return ("reference",)
    runs = [b for b in AUTO_ORDER[op] if b != "reference" and unavailable_reason(b, device_type, here=here) is None]
    refused = {b: why for b in runs if (why := limits.refusal(op, b, sizes)) is not None}
    if runs and len(refused) == len(runs):
        raise BackendError(
            f"model.kernels.{op}=auto on {device_type}: no kernel takes this model ({'; '.join(refused.values())}); "
            f"change that, or choose model.kernels.{op}=reference to run the pure-torch formula on purpose")
    return (*(b for b in runs if b not in refused), "reference")


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


def _constant_under_compile(fn):
    """What ``torch.compiler.assume_constant_result`` does (torch 2.13: it sets this mark), without importing
    torch._dynamo when this module is imported: that import costs ~3.5 s of CPU in every process (every rank,
    every CLI command), also in those that never compile. The compile tests fail if the mark stops working."""
    fn._dynamo_marked_constant = True
    return fn


# kernels/tune.py, set when it is imported (kernels/__init__ imports it): an object with ``measures_on(device_type)``
# and ``choose(op, shape, device_type)``. The tuner builds on this module, so this module asks it through this slot
# rather than importing it back.
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
    for fn in (triton_installed, installed):
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
