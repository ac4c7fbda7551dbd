"""Pure-torch short causal depthwise convolution (+ SiLU), the formula the fused kernel is tested against.

`causal_conv` is the Gated DeltaNet mixer's convolution (model/gated_deltanet.py imports it from here; its
context-parallel path uses it without the SiLU); `short_conv_reference` is ``silu(causal_conv(...))``, what
the kernel computes in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None,
                past: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution: out[t, c] = sum_i weight[c, 0, K-1-i] * x[t-i, c] over earlier
    inputs of the same document. x (B, T, C); weight (C, 1, K) as nn.Conv1d stores it; past (B, K-1, C):
    the inputs before x (decoding), zeros when absent. With doc_ids, past belongs to x's first document
    (the call continues the cached one, as the delta rule's state does: doc_starts never marks t = 0), so
    it feeds the positions of x's first document only."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if past is None:
        past = x.new_zeros(B, K - 1, C)
    xe = torch.cat([past.to(x.dtype), x], dim=1)  # (B, T + K - 1, C)
    if doc_ids is None:
        return F.conv1d(xe.transpose(1, 2), weight, groups=C).transpose(1, 2)
    # With documents: sum the K shifted inputs, each masked where it belongs to another document; the past
    # rows carry x's first document id.
    ide = torch.cat([doc_ids[:, :1].repeat(1, K - 1), doc_ids], dim=1)  # (B, T + K - 1)
    out = x * weight[:, 0, K - 1]
    for i in range(1, K):
        same = ide[:, K - 1 - i : K - 1 - i + T] == doc_ids
        out = out + xe[:, K - 1 - i : K - 1 - i + T] * weight[:, 0, K - 1 - i] * same[..., None]
    return out


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None,
                         past: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal_conv(x, weight, doc_ids, past))`` in the inputs' dtype (the convolution and the SiLU
    each round once in bf16; the kernel accumulates in fp32 and rounds once)."""
    return F.silu(causal_conv(x, weight, doc_ids, past))
