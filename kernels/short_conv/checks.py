"""What every short-convolution backend (ours, causal-conv1d, fla) requires of its inputs: one clear error each."""

from __future__ import annotations


def check_shapes(x, weight, doc_ids, past) -> int:
    if x.dim() != 3:
        raise ValueError(f"short_conv: x has shape {tuple(x.shape)}; it must be (B, T, C)")
    B, T, C = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (C, 1) or weight.shape[2] < 1:
        raise ValueError(f"short_conv: weight has shape {tuple(weight.shape)}; it must be ({C}, 1, K) with K >= 1, "
                         f"as a depthwise nn.Conv1d({C}, {C}, K, groups={C}) stores it")
    K = weight.shape[2]
    if doc_ids is not None:
        if doc_ids.shape != (B, T) or doc_ids.is_floating_point():
            raise ValueError(f"short_conv: doc_ids is {doc_ids.dtype} {tuple(doc_ids.shape)}; it must be integer "
                             f"document ids of shape ({B}, {T}), one per position of x")
    if past is not None and past.shape != (B, K - 1, C):
        raise ValueError(f"short_conv: past has shape {tuple(past.shape)}; it must be ({B}, {K - 1}, {C}), the "
                         f"K-1 inputs before x (decoding cache)")
    return K
