"""Gated attention through torch's fused ``scaled_dot_product_attention`` (cuDNN, flash or memory-efficient on
CUDA), then the sigmoid gate as one fused pass (`gate.sigmoid_gate`): a backend the attention tuner measures
beside our Triton kernel (on an H100 that kernel ran at 0.44x the speed of SDPA plus a separate gate).

Backend choice, per call: cuDNN first where it applies, then flash, then memory-efficient, then math (which
takes anything: fp64, odd head dims in fp16). Why this order and what each does with our inputs (torch
2.11-2.13, ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``):

- cuDNN: bf16/fp16 on sm80+, head dim a multiple of 8 (up to 128, or 256 on sm90/sm100 with cuDNN > 9.22);
  takes a boolean mask (made additive) and honours ``enable_gqa`` (since torch 2.8, pytorch PR #149976 /
  #150337; before, it ignored the flag and took KV < H heads as they came). torch's own default order puts
  it first only on sm90/sm100 with cuDNN > 9.15.
- flash: bf16/fp16, head dim <= 256, honours ``enable_gqa``; takes no mask, so it serves only the calls
  without documents (``is_causal``).
- memory-efficient: also fp32, honours ``enable_gqa``, takes the mask (as an additive bias: a (B, 1, T, T)
  tensor in q's dtype, padded to 16 columns, beside our boolean one).
- math: materialises the B x H x T x T scores (and repeats kv heads for GQA); last so a call never fails.

Documents (``doc_ids`` or ``cu_seqlens``) become one boolean (B, 1, T, T) mask, causal and same-document,
built once per call: this backend's cost with documents is O(T^2) mask memory (T = 4096, B = 8: 128 MiB of
bool plus the kernels' 256 MiB bf16 bias); `flex.py` builds no T x T tensor.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridtron.kernels.gated_attention.checks import check_shapes
from hybridtron.kernels.gated_attention.gate import sigmoid_gate
from hybridtron.kernels.gated_attention.reference import doc_bounds

PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# set_priority makes the list an order, not only a set (torch 2.5's sdpa_kernel lacks it; 2.13's and the docs of the
# releases between have it). Without it, torch's default order among the enabled backends applies (in its current
# source: cuDNN first only on sm90/sm100 with cuDNN > 9.15, else flash, memory-efficient, math).
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def _backends():
    return sdpa_kernel(PRIORITY, set_priority=True) if _HAS_PRIORITY else sdpa_kernel(PRIORITY)


def check_inputs(name: str, q, k, v, gate, cu_seqlens, doc_ids) -> tuple[int, int]:
    """`checks.check_shapes` (shapes, devices, document layout: one clear error each) plus the one dtype every input
    of torch's attention shares; returns (B, T) of the flattened tokens."""
    B, T = check_shapes(q, k, v, gate, cu_seqlens, doc_ids)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"{name}: q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}. Cast them, or "
            f"call gated_attention, which casts to the autocast dtype under autocast"
        )
    return B, T


def as_rows(q, k, v, cu_seqlens, B: int, T: int):
    """(q, k, v) as (B', T', heads, D) views. A packed (N, H, D) q is one row; with ``cu_seqlens`` a (B, T, H, D) q
    is one row of B * T tokens too, since a document may cross the batch split there (``doc_bounds``'
    convention); ``doc_ids`` keep the rows."""
    if q.dim() == 3 or cu_seqlens is not None:
        return tuple(t.reshape(1, B * T, *t.shape[-2:]) for t in (q, k, v))
    return q, k, v


def doc_numbers(cu_seqlens, doc_ids, B: int, T: int, rows: tuple[int, int], device) -> torch.Tensor | None:
    """Each token's document number in the (B', T') = ``rows`` layout of `as_rows` (the flattened index of its
    document's first token: equal numbers, one document; non-decreasing along a row); None without documents."""
    if cu_seqlens is None and doc_ids is None:
        return None
    start, _ = doc_bounds(B, T, cu_seqlens=cu_seqlens, doc_ids=doc_ids, device=device)
    return start.view(rows)


def sdpa_gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`gated_attention_reference`'s result by torch SDPA (cuDNN > flash > memory-efficient > math) and
    `sigmoid_gate`. q (B, T, H, D) or packed (N, H, D); k, v (..., KV, D); gate None, (..., H) or (..., H, D);
    documents from ``doc_ids`` (B, T) or ``cu_seqlens``, else each row (a packed q: all of it) is one. Returns
    (..., H, D) in q's dtype; q, k, v share one dtype (`gated_attention` casts them under autocast)."""
    B, T = check_inputs("sdpa_gated_attention", q, k, v, gate, cu_seqlens, doc_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q4, k4, v4 = as_rows(q, k, v, cu_seqlens, B, T)
    docs = doc_numbers(cu_seqlens, doc_ids, B, T, q4.shape[:2], q.device)
    if docs is None:
        mask = None
    else:
        # (B', 1, T', T'): key j visible to query i when j <= i in the same document (broadcast over heads)
        same = docs[:, None, :, None] == docs[:, None, None, :]
        mask = same & torch.ones(docs.shape[1], docs.shape[1], dtype=torch.bool, device=q.device).tril()
    with _backends():
        attn = F.scaled_dot_product_attention(
            q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=k.shape[-2] != q.shape[-2],
        )
    return sigmoid_gate(attn.transpose(1, 2).reshape(q.shape), gate)
