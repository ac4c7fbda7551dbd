"""Pure-torch gated causal attention over packed documents: the formula the Triton kernel is tested against.

``out = sigmoid(gate) * softmax(scale * q k^T + causal/document mask) v`` per query head, the query head h
reading kv head ``h // (H // KV)`` (grouped-query attention, the grouping of SDPA's ``enable_gqa`` and
transformers' ``repeat_kv``). Each document is attended on its own with causal SDPA, so no T x T mask is
built even here; the document layout is given by ``bounds``: per token, the flattened index of its
document's first token and one past its last (see `doc_bounds`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def doc_bounds(
    B: int, T: int, *, cu_seqlens: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of the flattened (B * T) sequence: (start, end) int32, its document's first index and one
    past its last, with fixed-shape ops only (no host sync, traceable by torch.compile).

    - neither: every batch row is one document.
    - ``doc_ids`` (B, T): a document is a run of equal ids within a row (a row boundary always ends one).
    - ``cu_seqlens`` (n_docs + 1,): document i is tokens [cu[i], cu[i+1]) of the flattened sequence
      (flash-attn's varlen convention; the batch split is not a boundary of its own).
    """
    N = B * T
    if doc_ids is not None:
        device = doc_ids.device
    elif cu_seqlens is not None:
        device = cu_seqlens.device
    idx = torch.arange(N, device=device, dtype=torch.int64)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        doc = torch.searchsorted(cu, idx, right=True) - 1  # the last document starting at or before each token
        return cu[doc].to(torch.int32), cu[doc + 1].to(torch.int32)
    if doc_ids is None:
        start = idx // max(T, 1) * T
        return start.to(torch.int32), (start + T).to(torch.int32)
    idx = idx.view(B, T)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, idx, 0).cummax(dim=1).values
    end = torch.where(last, idx + 1, N).flip(1).cummin(dim=1).values.flip(1)
    return start.reshape(N).to(torch.int32), end.reshape(N).to(torch.int32)


def apply_gate(attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """attn (..., H, D) times sigmoid(gate), gate (..., H, D) elementwise or (..., H) headwise."""
    if gate is None:
        return attn
    g = torch.sigmoid(gate)
    return attn * (g.unsqueeze(-1) if gate.dim() == attn.dim() - 1 else g)


def gated_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q (B, T, H, D) or (N, H, D); k, v (..., KV, D); gate None, (..., H) or (..., H, D) -> (..., H, D).

    A 3-D input is one packed sequence of N tokens (documents from ``cu_seqlens``, else one document).
    Arguments are as for `hybridtron.kernels.gated_attention.gated_attention`, which checks them.
    """
    H, KV = q.shape[-2], k.shape[-2]
    gqa = H != KV
    if q.dim() == 4 and cu_seqlens is None and doc_ids is None:
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=gqa,
        ).transpose(1, 2)
        return apply_gate(attn, gate)
    B, T = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    q3, k3, v3 = (t.reshape(B * T, *t.shape[-2:]) for t in (q, k, v))
    start, _ = doc_bounds(B, T, cu_seqlens=cu_seqlens, doc_ids=doc_ids, device=q.device)
    firsts = (start == torch.arange(B * T, device=q.device)).nonzero().flatten().tolist()
    outs = []
    for s, e in zip(firsts, [*firsts[1:], B * T], strict=True):
        # (H, L, D) per document, causal within it
        outs.append(F.scaled_dot_product_attention(
            q3[s:e].transpose(0, 1), k3[s:e].transpose(0, 1), v3[s:e].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=gqa,
        ).transpose(0, 1))
    attn = torch.cat(outs).view(q.shape) if outs else torch.empty_like(q)
    return apply_gate(attn, gate)
