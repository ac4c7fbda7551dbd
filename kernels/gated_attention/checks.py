"""What every gated-attention backend (ours, SDPA, flex, flash-attention) requires of its inputs: shapes, devices,
the document layout; one clear error each. The op checks before it dispatches, and each adapter called directly
checks the same way."""

from __future__ import annotations

import torch


def check_shapes(q, k, v, gate, cu_seqlens, doc_ids) -> tuple[int, int]:
    """Shapes, devices and document layout valid for every backend; returns (B, T) of the flattened tokens."""
    if q.dim() not in (3, 4):
        raise ValueError(f"gated_attention: q must be (B, T, H, D) or packed (N, H, D); got shape {tuple(q.shape)}")
    if k.shape != v.shape or k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"gated_attention: k and v must be q's shape {tuple(q.shape)} with the kv head count in dim -2; got "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    H, KV = q.shape[-2], k.shape[-2]
    if KV == 0 or H % KV:
        raise ValueError(f"gated_attention: {H} query heads are not a multiple of {KV} kv heads (grouped-query "
                         f"attention maps query head h to kv head h // (H // KV))")
    if gate is not None and gate.shape not in (q.shape, q.shape[:-1]):
        raise ValueError(
            f"gated_attention: gate has shape {tuple(gate.shape)}; it must be q's shape {tuple(q.shape)} (elementwise) "
            f"or {tuple(q.shape[:-1])} (headwise)"
        )
    for name, t in (("k", k), ("v", v), ("gate", gate), ("cu_seqlens", cu_seqlens), ("doc_ids", doc_ids)):
        if t is not None and t.device != q.device:
            raise ValueError(f"gated_attention: {name} is on {t.device}, q on {q.device}; move them to one device")
    B, T = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    if cu_seqlens is not None and doc_ids is not None:
        raise ValueError("gated_attention: give the documents as cu_seqlens or as doc_ids, not both")
    if doc_ids is not None and (q.dim() != 4 or doc_ids.shape != (B, T)):
        raise ValueError(
            f"gated_attention: doc_ids has shape {tuple(doc_ids.shape)}; it must be (B, T) = q.shape[:2] of a "
            f"(B, T, H, D) q (q has shape {tuple(q.shape)}); for a packed (N, H, D) q pass cu_seqlens"
        )
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B * T, q.shape)
    return B, T


def check_cu_seqlens(cu: torch.Tensor, n_tokens: int, q_shape) -> None:
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"gated_attention: cu_seqlens must be a 1-D int32/int64 tensor [0, len_0, len_0 + len_1, ..., N] of at "
            f"least 2 entries; got {cu.dtype} of shape {tuple(cu.shape)}"
        )
    if torch.compiler.is_compiling():
        return  # the value checks read the tensor (a host sync and a graph break); eager calls make them
    first, last, n_down = torch.stack([cu[0], cu[-1], (cu[1:] < cu[:-1]).sum()]).tolist()
    if first != 0 or last != n_tokens or n_down:
        raise ValueError(
            f"gated_attention: cu_seqlens must start at 0, never decrease and end at the number of tokens "
            f"N={n_tokens} (q has shape {tuple(q_shape)}: N = B * T); got first {first}, last {last}, "
            f"{n_down} decreasing step(s). Build it as [0, *cumsum(document lengths)] over the packed tokens"
        )
