"""The short causal depthwise convolution + SiLU on the field's kernels: the ``causal-conv1d`` and ``fla``
backends of ``model.kernels.conv``, adapters with exactly the semantics of `short_conv_reference` (reference.py)
for training and prefill (``past=None``; decoding with a cache stays on our kernel, the caller sees to that).

- ``causal-conv1d`` (Dao-AILab's CUDA kernel, ``causal_conv1d_fn``): x as (batch, dim, seqlen), weight (dim,
  width) with width 2-4, fused SiLU (``activation="silu"``). Documents go in as ``seq_idx``, an int32 index per
  position (positions with different indices do not mix), which the kernel takes in the channel-last layout
  only -- x's (B, T, C) memory transposed, free for a contiguous x, with C and the strides multiples of 8.
- ``fla`` (fla-core's Triton kernel, ``fla.modules.causal_conv1d.causal_conv1d``): x (B, T, C), weight (C,
  width), any width, fused SiLU. Documents go in as packed sequences: the rows flattened into one (B = 1) with
  cumulative lengths ``cu_seqlens`` starting a sequence at every row start and every document start.

A document is a run of equal doc_ids (where the ids change, one starts): both peers are handed run indices or run
boundaries. The reference compares ids inside the K-wide window instead; the two agree wherever an id does not
come back within K-1 positions after another (doc_ids from the data pipeline never come back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtron.kernels.backend import BackendError
from hybridtron.kernels.limits import CAUSAL_CONV1D_WIDTHS
from hybridtron.kernels.short_conv.checks import check_shapes

PEERS = ("causal-conv1d", "fla")
CAUSAL_CONV1D_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INSTEAD = "choose model.kernels.conv=triton or reference"


def _check(x, weight, doc_ids) -> None:
    """ValueError naming the first argument that does not fit short_conv's shapes (the op's own check)."""
    check_shapes(x, weight, doc_ids, None)


def _starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a document starts (the ids change), and at every row start."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def _channel_last_ok(xt: torch.Tensor) -> bool:
    """causal_conv1d's channel-last rule for xt (B, C, T): unit channel stride, C and the batch and time strides
    multiples of 8."""
    return (xt.stride(1) == 1 and xt.stride(2) > 1 and xt.shape[1] % 8 == 0 and xt.stride(2) % 8 == 0
            and xt.stride(0) % 8 == 0)


def _causal_conv1d(x, weight, doc_ids):
    K = weight.shape[-1]
    C = x.shape[-1]
    if K not in CAUSAL_CONV1D_WIDTHS:
        raise BackendError(f"causal-conv1d takes filter widths 2-4, not K={K}; {_INSTEAD}")
    if x.dtype not in CAUSAL_CONV1D_DTYPES or weight.dtype not in CAUSAL_CONV1D_DTYPES:
        raise BackendError(f"causal-conv1d takes float32, float16 or bfloat16, not x {x.dtype} and weight "
                           f"{weight.dtype}; {_INSTEAD}")
    if doc_ids is not None and C % 8:
        raise BackendError(f"causal-conv1d takes documents (seq_idx) only in its channel-last layout, which needs "
                           f"the channels to be a multiple of 8, not C={C}; {_INSTEAD}")
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError as e:
        raise BackendError(f"causal-conv1d is not installed ({e}; pip install causal-conv1d, a CUDA build); "
                           f"{_INSTEAD}") from e
    xt = x.transpose(1, 2)  # (B, C, T): channel-last in memory when x is (B, T, C) contiguous
    if not _channel_last_ok(xt):
        # a copy into channel-last where the channels allow it (documents need it), else the plain layout
        xt = x.contiguous().transpose(1, 2) if C % 8 == 0 else xt.contiguous()
    seq_idx = None
    if doc_ids is not None:
        # int32 run index per position: ids of any range or sign become 0, 1, 2, ... (the kernel treats a negative
        # index as padding and zeroes its output)
        seq_idx = (_starts(doc_ids).to(torch.int32).cumsum(1, dtype=torch.int32) - 1).contiguous()
    return causal_conv1d_fn(xt, weight.reshape(C, K), seq_idx=seq_idx, activation="silu").transpose(1, 2)


def _fla(x, weight, doc_ids):
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError as e:
        raise BackendError(f"fla-core is not installed ({e}; pip install fla-core); {_INSTEAD}") from e
    B, T, C = x.shape
    w = weight.reshape(C, weight.shape[-1])
    if doc_ids is None:
        y, _ = causal_conv1d(x, w, activation="silu")
        return y
    # One device-to-host copy: fla prepares its chunk indices on the host, from cu_seqlens_cpu without another.
    starts = _starts(doc_ids).to("cpu")
    cu_cpu = F.pad(starts.flatten().nonzero().flatten(), (0, 1), value=B * T).to(torch.int64)
    cu = cu_cpu.to(x.device, non_blocking=True)
    y, _ = causal_conv1d(x.reshape(1, B * T, C), w, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return y.reshape(B, T, C)


@torch.compiler.disable
def peer_short_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None, *,
                    backend: str) -> torch.Tensor:
    """``silu(causal_conv(x, weight, doc_ids))`` (short_conv_reference with past=None) on a peer library's kernel:
    the depthwise causal convolution over earlier inputs of the same document, then SiLU. x (B, T, C); weight
    (C, 1, K) as nn.Conv1d stores it; doc_ids (B, T) integer document ids (a run of equal ids is a document) or
    None. backend: "causal-conv1d" or "fla". Returns (B, T, C) in x's dtype, differentiable in x and weight.
    What the peer cannot take is refused with a BackendError.

    torch.compile does not trace this: the peers' autograd.Functions are not written for it (fla's launch Triton
    kernels through autotuners and host-side index preparation; causal-conv1d releases before its custom ops call
    the CUDA extension directly), and the fla path copies the document boundaries to the host, so the call is
    one graph break."""
    if backend not in PEERS:
        raise BackendError(f"peer_short_conv: backend={backend!r} is not a peer of the short convolution; choose one "
                           f"of {list(PEERS)}")
    _check(x, weight, doc_ids)
    return _causal_conv1d(x, weight, doc_ids) if backend == "causal-conv1d" else _fla(x, weight, doc_ids)
