"""Keep the dependencies' known, harmless messages off the command line's stderr, so what a user reads there is ours.

Each entry below was seen on a `hybridtron` command's stderr (2026-11-28, torch 2.13 CPU, transformers 5.24, torchao
0.18, fla-core 0.6) and says nothing the user can act on. Only these exact messages are dropped: any other warning
of the same libraries still shows. ``quiet_dependencies`` runs first thing in the CLI's ``main``, before torch is
imported. No torch here. (kineto's ``STAGE:`` / ``USDT:`` lines during a profiled range are written by C++ straight to
the file descriptor: train/profile.py filters them there.)

- torchao (the ``dev`` and ``fp8`` extras; transformers imports it whenever it is installed) tries to load compiled
  extensions built for CUDA torch (``_C_mxfp8``, ``_C_cutlass_90a``) and logs ``Failed to load ...`` on a CPU
  build; ``train.fp8`` does not use them. Its import also registers two Enums with torch's pytree, which torch 2.13
  answers with a deprecation warning (``... is an Enum subclass and is now natively supported ...``).
- transformers says a Qwen3.5-family kernel ``is falling back to its reference PyTorch implementation``: on the
  CPU that is the path export's logit check takes on purpose (train/hf/torch_paths.py).
"""

from __future__ import annotations

import logging
import warnings

# logger name -> substrings: a record of that logger whose message holds one of them is dropped
DROPPED: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "transformers.integrations.hub_kernels": ("is falling back to its reference PyTorch implementation",),
}


class _Drop(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record that cannot format itself is shown as it is
            return True
        return not any(n in text for n in self.needles)


def _one_line(message, category, filename, lineno, line=None) -> str:
    """Our own warnings (the kernel tuner's, say) as one line in the CLI's voice, not Python's two (the file and
    line, then the source line of the call): a user reads what happened, not where in hybridtron it was said."""
    if getattr(category, "__module__", "").startswith("hybridtron"):
        return f"[hybridtron] warning: {message}\n"
    return _one_line.python(message, category, filename, lineno, line)


def quiet_dependencies() -> None:
    """Drop the messages listed in DROPPED, and show our own warnings on one line (idempotent)."""
    if warnings.formatwarning is not _one_line:
        _one_line.python = warnings.formatwarning
        warnings.formatwarning = _one_line
    for name, needles in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(needles))
