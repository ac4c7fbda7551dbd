"""Gated attention through torch's flex attention, with a block mask built from the document layout, then the
sigmoid gate as one fused pass (`gate.sigmoid_gate`): a backend the attention tuner measures beside our Triton
kernel and SDPA (`sdpa.py`).

The mask: ``mask_mod(b, h, q, kv) = kv <= q and doc[b, q] == doc[b, kv]``, ``doc`` the per-token document
number (B, T) (the flattened index of the document's first token, `doc_bounds`' start). flex skips the key
blocks the block mask marks empty, applies ``mask_mod`` in the partial ones and nothing in the full ones.

The block mask is built here from the documents' block-level bounds, O((T / 128)^2) per row, not by
``create_block_mask``: that evaluates ``mask_mod`` on the whole (B, 1, T, T) grid in eager (at T = 4096,
B = 8: a 128 MiB bool grid plus its block sums, per layout). It holds the same blocks (the tests compare the
two), and it is built once per document layout: every attention layer of one forward passes the same
``doc_ids`` / ``cu_seqlens`` tensor, so the last mask is kept, keyed by that tensor's identity and version,
B, T and the device.

On CUDA flex runs through one module-level ``torch.compile(flex_attention, dynamic=False)`` (a kernel compiled
per shape class): eager flex on the GPU materialises the B x H x T x T scores and runs unfused, far slower
than any fused backend. On the CPU it runs eagerly (torch 2.13 runs flex's forward there; compiling it took
30 s in one try); its backward there is refused by torch ("FlexAttention does not support backward on CPU"),
so a call that would need it is refused first, by `BackendError`.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from hybridtron.kernels.backend import BackendError
from hybridtron.kernels.gated_attention.gate import sigmoid_gate
from hybridtron.kernels.gated_attention.sdpa import as_rows, check_inputs, doc_numbers

BLOCK = 128  # flex's default sparse block (``_DEFAULT_SPARSE_BLOCK_SIZE``), which its GPU kernels are tuned for

_compiled = None  # torch.compile(flex_attention), made at the first CUDA call (importing dynamo costs seconds)
_last: dict = {}  # the last block mask: {"docs": the document tensor it was built for, "key": ..., "mask": ...}


def _flex_cuda():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, nQ, nKV) bool -> BlockMask's (count, indices): per query block the number of marked key blocks,
    and the key block indices with the marked ones first, each part in increasing order."""
    counts = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, idx


def document_block_mask(docs: torch.Tensor | None, B: int, T: int, device, block: int = BLOCK) -> BlockMask:
    """The BlockMask of causal attention within documents over B rows of T tokens (``docs`` (B, T): per token
    the flattened index of its document's first token, non-decreasing along a row; None: each row is one
    document, a (1, ...) mask broadcast over the rows). No (T, T) tensor: blocks from the documents' bounds.

    Query q sees key kv iff s(q) <= kv <= q, s(q) the row position of q's document's first token. Query block
    [a, b) and key block [c, d) (the last ones shorter when T is not a multiple of ``block``):
    - some pair visible iff q* = max(a, c) < b and s(q*) <= d - 1 (s does not decrease, so q* has the smallest
      start among the queries that may see the block's keys at all);
    - every pair visible iff d - 1 <= a and s(b - 1) <= c, in a whole block (``create_block_mask`` pads a last
      short block with masked positions, so it is never full; the same here).
    """
    n = -(-T // block)
    lo = torch.arange(n, device=device) * block
    hi = (lo + block).clamp(max=T)
    if docs is None:
        s = torch.zeros(1, T, dtype=torch.int64, device=device)
    else:
        s = docs.to(torch.int64) - (docs[:, :1].to(torch.int64))  # row positions (a row's first token starts one)
    q_star = torch.maximum(lo[:, None], lo[None, :])  # (nQ, nKV)
    s_star = s[:, q_star.clamp(max=max(T - 1, 0))]  # (B', nQ, nKV)
    some = (q_star < hi[:, None]) & (s_star <= (hi - 1)[None, :])
    whole = (hi - lo) == block
    every = ((hi - 1)[None, :] <= lo[:, None]) & whole[:, None] & whole[None, :]
    every = every & (s[:, hi - 1][:, :, None] <= lo[None, None, :])
    partial, full = (some & ~every)[:, None], every[:, None]
    kv_n, kv_idx = _ordered(partial)
    full_n, full_idx = _ordered(full)

    if docs is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return BlockMask.from_kv_blocks(kv_n, kv_idx, full_n, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def _block_mask(layout: torch.Tensor | None, docs, B: int, T: int, device) -> BlockMask:
    """`document_block_mask` of the documents ``docs()`` computes, reused while the layout tensor (doc_ids or
    cu_seqlens; None: no documents) is the same object at the same version (an in-place write bumps it), for the
    same B, T and device: the other layers of a forward neither rebuild the mask nor recompute the documents."""
    if torch.compiler.is_compiling():
        return document_block_mask(docs(), B, T, device)  # in a traced graph: built there, no Python-side state
    key = (None if layout is None else layout._version, B, T, str(device))
    if _last.get("docs", 0) is layout and _last.get("key") == key:
        return _last["mask"]
    mask = document_block_mask(docs(), B, T, device)
    # The layout tensor itself is kept (not its id, which a new tensor may reuse once this one is freed).
    _last.update(docs=layout, key=key, mask=mask)
    return mask


def flex_gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`gated_attention_reference`'s result by torch flex attention (compiled on CUDA, eager elsewhere) and
    `sigmoid_gate`. q (B, T, H, D) or packed (N, H, D); k, v (..., KV, D); gate None, (..., H) or (..., H, D);
    documents from ``doc_ids`` (B, T) or ``cu_seqlens``, else each row (a packed q: all of it) is one. Returns
    (..., H, D) in q's dtype; q, k, v share one dtype. On the CPU forward only: BackendError when q, k or v
    would need a gradient."""
    B, T = check_inputs("flex_gated_attention", q, k, v, gate, cu_seqlens, doc_ids)
    dev = q.device
    if dev.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise BackendError(
                "flex_gated_attention: flex attention's backward needs CUDA (torch runs only its forward on the "
                "CPU); on the CPU use model.kernels.attention=reference (or flex for evaluation only, without "
                "gradients)"
            )
        # Under no_grad nothing is recorded, but torch's CPU check reads requires_grad alone (and would refuse
        # evaluation with leaves that require grad): hand it detached views.
        q, k, v = q.detach(), k.detach(), v.detach()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q4, k4, v4 = as_rows(q, k, v, cu_seqlens, B, T)
    rows = q4.shape[:2]
    layout = cu_seqlens if cu_seqlens is not None else doc_ids
    mask = _block_mask(layout, lambda: doc_numbers(cu_seqlens, doc_ids, B, T, rows, dev), *rows, dev)
    args = (q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2))
    kw = dict(block_mask=mask, scale=scale, enable_gqa=True)
    if torch.compiler.is_compiling():
        attn = flex_attention(*args, **kw)  # inside the caller's compiled graph: compiled with it
    elif dev.type == "cuda":
        attn = _flex_cuda()(*args, **kw)
    else:
        with warnings.catch_warnings():  # eager on purpose here (see the module docstring); torch warns once
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            attn = flex_attention(*args, **kw)
    return sigmoid_gate(attn.transpose(1, 2).reshape(q.shape), gate)
