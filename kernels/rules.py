"""Which backend of a fused op can run where, and which a config may ask for: the backend switch's rules, without
torch.

kernels/backend.py dispatches calls on tensors and needs torch; these rules are asked before anything exists -- by
the job's layout check (train/parallel/layout.py), for a run here, a SLURM submission or a plan -- and the command
line asks them before it imports torch (``import torch`` alone: 2.1 s of CPU on the 2-core VM, 2026-11-28).
So nothing here imports torch at module level: the one question only torch can answer, whether this machine sees a
CUDA device (`cuda_visible`), imports it when asked, and a rule asks it only where a GPU's presence decides the
answer (a CUDA device on this machine, ``here``). The size limits are kernels/limits.py's. backend.py re-exports
every name here, so callers keep asking ``backend.<name>``; tests that replace one of these functions replace it
here, where the rules look it up.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from hybridtron.kernels import limits

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


def cuda_visible() -> bool:
    """Whether torch sees a CUDA device on this machine. Imports torch (the one import here, ~2 s of CPU the first
    time): ask only where the answer decides something."""
    import torch

    return torch.cuda.is_available()


def device_type_of(device: str | None) -> str:
    """The device type of a ``train.device`` value or a device (auto, cpu, cuda, cuda:N, a torch.device; None:
    auto). ``auto`` is CUDA when one is visible: only that asks torch."""
    if device is None or str(device) == "auto":
        return "cuda" if cuda_visible() else "cpu"
    return str(device).split(":", 1)[0]  # str(torch.device("cuda:1")) == "cuda:1"


def interpreter_requested() -> bool:
    """TRITON_INTERPRET is set to a true value in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def installed(module: str) -> bool:
    """Whether ``module`` (a peer library) can be found, without importing it (fla imports triton and probes the
    GPU at import). A top-level name only: find_spec of a dotted one imports its parents."""
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
    if here and cuda_visible():
        import torch  # imported by cuda_visible already

        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return (f"train.fp8={recipe} needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                    f"Blackwell); this GPU, {torch.cuda.get_device_name()}, is sm_{major}{minor}: set train.fp8=none")
    return None


def triton_unavailable_reason(device: str | None = None, *, here: bool = True) -> str | None:
    """None when our Triton kernels can run on ``device`` (None/"auto": where a run would go), else why not.
    ``here=False``: a device of that type on another machine (a cluster's node), whose GPU is taken as present."""
    if not triton_installed():
        return "triton is not installed (pip install triton, or the project's .[dev] / .[gpu] extras)"
    dev = device_type_of(device)
    if dev == "cuda":
        if here and not cuda_visible():
            return "no CUDA device is visible"
        return None
    if dev == "cpu":
        if not interpreter_requested():
            return ("Triton kernels need a CUDA GPU; on the CPU they run only under Triton's interpreter: start the "
                    "process with TRITON_INTERPRET=1 in the environment (set before triton is imported)")
        return None
    return f"Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {dev!r}"


def peer_unavailable_reason(backend: str, device: str | None = None, *, here: bool = True) -> str | None:
    """None when the peer library behind ``backend`` (PEERS) can run on ``device``, else why not: each runs on
    CUDA GPUs only (fla's Triton kernels do not run under Triton's interpreter either). ``here``: as for Triton;
    what is installed here is taken as installed there."""
    module, how = PEERS[backend]
    if device_type_of(device) != "cuda":
        return f"{backend} runs on CUDA GPUs only"
    if here and not cuda_visible():
        return "no CUDA device is visible"
    if not installed(module):
        return f"the {module} package is not installed ({how})"
    return None


def flash_attn_unavailable_reason(device: str | None = None) -> str | None:
    return peer_unavailable_reason("flash-attn", device)


@functools.cache
def _flex_attention_found() -> bool:
    """torch.nn.attention.flex_attention is in the installed torch, looked up on disk: find_spec of the dotted name
    would import torch and torch.nn to search them."""
    spec = importlib.util.find_spec("torch")
    return spec is not None and any((Path(d) / "nn" / "attention" / "flex_attention.py").is_file()
                                    for d in spec.submodule_search_locations or ())


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def flex_unavailable_reason(device: str | None = None) -> str | None:
    """flex_attention ships with torch >= 2.5. Its backward runs on CUDA only (torch 2.13 refuses it on the CPU):
    the adapter refuses a CPU call that needs gradients; a CPU forward (evaluation) runs."""
    if not _flex_attention_found():
        return f"torch {_torch_version()} has no flex_attention (torch >= 2.5 has)"
    if device_type_of(device) not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA (forward also on the CPU), not on {device_type_of(device)!r}"
    return None


def unavailable_reason(backend: str, device: str | None = None, *, here: bool = True) -> str | None:
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
    if device_type_of(device_type) != "cuda":
        return ("reference",)
    runs = [b for b in AUTO_ORDER[op] if b != "reference" and unavailable_reason(b, device_type, here=here) is None]
    refused = {b: why for b in runs if (why := limits.refusal(op, b, sizes)) is not None}
    if runs and len(refused) == len(runs):
        raise BackendError(
            f"model.kernels.{op}=auto on {device_type}: no kernel takes this model ({'; '.join(refused.values())}); "
            f"change that, or choose model.kernels.{op}=reference to run the pure-torch formula on purpose")
    return (*(b for b in runs if b not in refused), "reference")
