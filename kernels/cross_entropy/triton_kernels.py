"""Triton kernels for the chunked cross-entropy: row statistics of a logits chunk, and its gradient in place.

Per row of a (C, V) logits chunk (the LM head's output for C tokens, in the matmul's dtype):

- `ce_stats`: running max m and sum s = sum(exp(x - m)) over the vocabulary in one pass (online softmax),
  so lse = m + log(s). Under vocabulary parallelism each rank computes these on its shard and the ranks
  combine them (max, then rescaled sums) before the gradient pass.
- `ce_grad_`: overwrites the chunk with d loss / d logits = scale * (softmax * (1 + 2 z lse) - onehot(label)),
  scale = 1 / n_valid for a counted row, 0 for an ignored one. The chunk buffer is reused, so the gradient
  costs no memory of its own.

Both read the chunk once (the gradient pass writes it once); the matmuls around them stay with cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.triton_utils import next_pow2


@triton.jit
def _ce_stats_kernel(X, M, S, C, V, stride, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < C
    base = X + rows.to(tl.int64)[:, None] * stride
    cols = tl.arange(0, BLOCK_V)[None, :]
    # Lanes start at the lowest finite float, not -inf, so a lane past the vocabulary's end (loaded as -inf)
    # never computes exp(-inf - -inf) = NaN; its sum stays 0 and vanishes in the final rescale.
    m = tl.full([BLOCK_R, BLOCK_V], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=rmask[:, None] & (v0 + cols < V), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    m_row = tl.max(m, axis=1)
    s_row = tl.sum(s * tl.exp(m - m_row[:, None]), axis=1)
    tl.store(M + rows, m_row, mask=rmask)
    tl.store(S + rows, s_row, mask=rmask)


@triton.jit
def _ce_grad_kernel(X, LSE, LABELS, SCALE, C, V, stride, vocab_start, z2,
                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < C
    base = X + rows.to(tl.int64)[:, None] * stride
    cols = tl.arange(0, BLOCK_V)[None, :]
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)[:, None]
    scale = tl.load(SCALE + rows, mask=rmask, other=0.0)[:, None]
    target = (tl.load(LABELS + rows, mask=rmask, other=0) - vocab_start)[:, None]  # outside [0, V): elsewhere
    coef = 1.0 + z2 * lse  # d(z lse^2)/d logit = 2 z lse softmax
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        mask = rmask[:, None] & (idx < V)
        x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * coef - tl.where(idx == target, 1.0, 0.0)
        tl.store(base + idx, (g * scale).to(X.dtype.element_ty), mask=mask)


def _blocks(V: int) -> tuple[int, int]:
    """(rows, vocabulary lanes) per program: one row and 4096 lanes at LM vocabularies; several rows of a
    small vocabulary (tests) per program."""
    block_v = min(next_pow2(V), 4096)
    return max(1, 4096 // block_v), block_v


def ce_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (C, V) with unit column stride -> (max, sum of exp(x - max)) per row, fp32."""
    C, V = logits.shape
    m = torch.empty(C, dtype=torch.float32, device=logits.device)
    s = torch.empty(C, dtype=torch.float32, device=logits.device)
    if C:
        check_interpreted(_ce_stats_kernel, logits.device)
        br, bv = _blocks(V)
        _ce_stats_kernel[(triton.cdiv(C, br),)](logits, m, s, C, V, logits.stride(0), BLOCK_R=br, BLOCK_V=bv,
                                                num_warps=8)
    return m, s


def ce_grad_(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
             vocab_start: int, z_loss: float) -> torch.Tensor:
    """Overwrite logits (C, V) with the loss gradient (see module docstring); returns it."""
    C, V = logits.shape
    if C:
        check_interpreted(_ce_grad_kernel, logits.device)
        br, bv = _blocks(V)
        _ce_grad_kernel[(triton.cdiv(C, br),)](logits, lse, labels, scale, C, V, logits.stride(0), vocab_start,
                                               2.0 * z_loss, BLOCK_R=br, BLOCK_V=bv, num_warps=8)
    return logits
