"""transformers' Qwen3.5 family on the CPU with its own torch paths, whatever peer kernels are installed.

transformers 5.x binds fla's gated delta rule and causal-conv1d's convolution into its Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next modeling modules when they are imported (``use_kernel_func_from_hub_with_fallback``), whenever those
packages can be imported, whatever the device; their Triton and CUDA kernels then fail on CPU tensors ("0 active
drivers"). Our CPU uses of those models -- the export's logit check, the HF comparison bench on the CPU -- import
the modules first with the two packages hidden, so they take transformers' torch implementations. Our own ``fla``
backend imports fla afterwards, as usual.
"""

from __future__ import annotations

import importlib
import sys

MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
           "transformers.models.qwen3_next.modeling_qwen3_next")
PEERS = ("fla", "causal_conv1d")


def import_with_torch_paths() -> list[str]:
    """Import MODULES with PEERS hidden (a module imported earlier keeps what it bound: its name is returned)."""
    late = [m for m in MODULES if m in sys.modules]
    if len(late) == len(MODULES):
        return late
    hidden = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in PEERS}
    for name in hidden:
        del sys.modules[name]
    saved = {p: sys.modules.get(p) for p in PEERS}
    for p in PEERS:
        sys.modules[p] = None  # `import fla` raises ImportError while this holds
    try:
        for m in MODULES:
            if m not in sys.modules:
                try:
                    importlib.import_module(m)
                except ImportError:
                    pass  # an older transformers without that model: nothing to bind
    finally:
        for p in PEERS:
            if saved[p] is None:
                sys.modules.pop(p, None)
        sys.modules.update(hidden)
    return late
