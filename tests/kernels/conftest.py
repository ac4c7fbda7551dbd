"""Kernel tests run the Triton kernels on the CPU under Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a kernels/*/triton_kernels.py module is first
imported; those imports are lazy (first Triton launch), and this conftest is loaded at collection, before
any test runs, so setting it here is early enough. auto still resolves to the reference on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
