"""The chunked linear + cross-entropy loop shared by the single-device op and the vocabulary-parallel one.

For each chunk of C rows: logits = h_c W^T (C, V) in the inputs' dtype (cuBLAS), row statistics, loss
rows, then -- in the same pass, when gradients are wanted -- the chunk is overwritten by d loss / d logits
and multiplied back: dh_c = G W, dW += G^T h_c (in place, in W's dtype: each product accumulates in fp32
inside the GEMM, and dW is rounded once per chunk). So the full (N, V) logits never exist: peak extra memory
is one (C, V) chunk plus dW, against the plain path's logits, their fp32 copy and their gradient. The gradients are computed in the forward (the backward only scales
them by the incoming gradient); under ``torch.no_grad`` they are skipped.

The per-chunk steps (statistics, gradient) come in two implementations with one contract: Triton
(`triton_kernels.py`) and pure torch (`torch_stats`, `torch_grad_`, below: the chunked reference, used by
the vocabulary-parallel op on the reference backend).

Vocabulary parallel: W is this rank's shard of rows [vocab_start, vocab_start + V_local); ``all_reduce(t,
op)`` with op "max" or "sum" combines a tensor over the tensor-parallel ranks (supplied by the caller, so
nothing here imports torch.distributed). The statistics are combined before the gradient pass, the target
logit is summed from the one rank that holds it, and dh (partial per rank) is summed at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]


def torch_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    m = x.amax(dim=-1)
    s = torch.exp(x - m[:, None].clamp_min(torch.finfo(torch.float32).min)).sum(-1)
    return m, s


def torch_grad_(logits, lse, labels, scale, vocab_start: int, z_loss: float) -> torch.Tensor:
    x = logits.float()
    g = torch.exp(x - lse[:, None]) * (1.0 + 2.0 * z_loss * lse[:, None])
    local = labels - vocab_start
    rows = torch.nonzero((local >= 0) & (local < x.shape[1])).squeeze(1)
    g[rows, local[rows]] -= 1.0
    logits.copy_(g * scale[:, None])
    return logits


def default_chunk(n_rows: int, vocab: int, d_model: int, max_chunks: int = 8) -> int:
    """Rows per chunk: ceil(V / d) chunks (a (C, V) chunk about as large as the (N, d) hidden states), at most
    ``max_chunks``: dW gains one rounding to its dtype per chunk, so fewer, larger chunks keep it within a few
    roundings of the plain path's single one (at N 8192, d 4096, V 152k: 8 chunks of 1024 rows, a 311 MB bf16
    logits chunk against the plain path's 2.5 GB logits, 5 GB fp32 copy and 5 GB gradient)."""
    n_chunks = max(1, min(max_chunks, -(-vocab // max(d_model, 1))))
    return max(1, -(-n_rows // n_chunks))


def chunked_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 0,
    compute_grad: bool = True,
    impl: str = "triton",
    vocab_start: int = 0,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (N, d), weight (V_local, d), labels (N,) -> (loss, dh (N, d) or empty, dW (V_local, d) or empty).

    loss is the mean over rows with label != ignore_index (NaN when there is none, as F.cross_entropy).
    """
    if impl == "triton":
        from hybridtron.kernels.cross_entropy.triton_kernels import ce_grad_, ce_stats
    else:
        ce_stats, ce_grad_ = torch_stats, torch_grad_
    N, d = h.shape
    V = weight.shape[0]
    C = chunk_size or default_chunk(N, V, d)
    valid = labels != ignore_index
    n_valid = valid.sum().to(torch.float32)
    scale_all = valid.to(torch.float32) / n_valid  # a row's share of the mean
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    loss = torch.zeros((), dtype=acc, device=h.device)
    dh = torch.empty_like(h) if compute_grad else h.new_empty(0)
    dw = torch.zeros((V, d), dtype=weight.dtype, device=h.device) if compute_grad else h.new_empty(0)
    for c0 in range(0, N, C):
        hc, lab = h[c0:c0 + C], labels[c0:c0 + C]
        logits = hc @ weight.t()  # (C, V) in the inputs' dtype
        m, s = ce_stats(logits)
        local = lab - vocab_start
        own = (local >= 0) & (local < V)
        target = torch.where(own, logits.gather(1, local.clamp(0, V - 1)[:, None]).squeeze(1).float(), 0.0)
        if all_reduce is not None:
            m_all = all_reduce(m.clone(), "max")
            s = all_reduce(s * torch.exp(m - m_all), "sum")
            m = m_all
            target = all_reduce(target, "sum")
        lse = m + torch.log(s)
        row_loss = lse - target
        if z_loss:
            row_loss = row_loss + z_loss * lse.square()
        loss = loss + (row_loss * scale_all[c0:c0 + C]).sum(dtype=acc)
        if compute_grad:
            g = ce_grad_(logits, lse, lab, scale_all[c0:c0 + C].contiguous(), vocab_start, z_loss)
            dh[c0:c0 + C] = g @ weight
            dw.addmm_(g.t(), hc)
    if compute_grad and all_reduce is not None:
        dh = all_reduce(dh, "sum")
    return loss, dh, dw
