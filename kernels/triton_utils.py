"""Small helpers the Triton launchers share (imported by ``kernels/*/triton_kernels.py`` only, so triton is
needed only where a Triton backend runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def compute_dtype(*tensors: torch.Tensor | None):
    """Triton dtype the kernels compute in: fp32, or fp64 when an input is fp64 (the tests' float64 runs)."""
    return tl.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else tl.float32


def interpreted(device: torch.device) -> bool:
    """The kernels run under Triton's interpreter here (CPU tensors), where a few launch choices differ from
    the GPU's. One place to ask, so bench/compile_report.py can compile the GPU's choices from CPU tensors."""
    return device.type != "cuda"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def num_programs(device: torch.device, n_blocks: int, per_sm: int = 4) -> int:
    """Programs for a persistent kernel that loops over ``n_blocks`` row blocks: a few per SM on a GPU,
    at most 4 under the interpreter (there every program is a Python loop iteration; fewer is faster)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_blocks, per_sm * sms))
    return max(1, min(n_blocks, 4))


def row_block(d_block: int, target: int = 4096, max_rows: int = 64) -> int:
    """Rows per program so that a [rows, d_block] tile holds about ``target`` elements (a power of two)."""
    return max(1, min(max_rows, target // d_block))


def warps(elements: int) -> int:
    """num_warps for a tile of ``elements``: one warp per 256 elements, between 1 and 16, a power of two."""
    return max(1, min(16, next_pow2(elements // 256)))


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """sigmoid of fp32 ``x``. FAST (compiled for an NVIDIA GPU, fp32): 1 / (1 + 2^(-x log2 e)) with the
    approximate ex2 and rcp instructions, flushing denormals (4 instructions; within a few fp32 ulps, far below
    a bf16 rounding); tl.sigmoid's IEEE-guarded exp and division take ~11. Otherwise (the interpreter, fp64)
    tl.sigmoid."""
    if FAST:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.sigmoid(x)


def fast_math(device: torch.device, compute) -> bool:
    """Whether ``sigmoid(..., FAST)`` may take the approximate instructions: fp32 compute on a GPU."""
    return compute == tl.float32 and not interpreted(device)
