"""HAX: context-dependent sparse attention inside the Gated DeltaNet mixer (model.deltanet.sparse_attention).

Zhan, Zhao, Zhu and Tang ("Overcoming Long-Context Limitations of State-Space Models via Context-Dependent
Sparse Attention", 2025) show that a state-space mixer cannot solve multi-query *joint recall* in sub-quadratic
time, and that adding sparse attention whose key sets depend on the content can. HAX ("locality-sensitive
Hashing Attention with sparse Key selection") is their instance; in our mixer it reads:

    [q_h | k_h] = x W_hax                   x: the mixer's post-convolution values (B, T, value_dim)
    out_t = softmax over S_t of (q_h,t . k_h,j / sqrt(d)) -> sum_j p_tj x_j      one head; values = the mixer's
    o = delta_rule(...) + e * out           e: a learned vector (init 1), before the gated RMSNorm

S_t, at most ``sparse_keys`` earlier positions j <= t of t's own document, is the union of two sources of
``sparse_keys / 2`` keys each:

- LSH: bucket(x) = the sign bits of R c(x), R a fixed random (d, lsh_bits) projection (a buffer: the same in
  training, decoding and every checkpoint), c(x) the vector centred by the mean of the earlier vectors of its
  kind (queries or keys) in its document, and normalised. S_t takes the most recent keys of q_t's bucket. (The paper
  centres by the mean over the whole sequence, which would let a query's bucket depend on later tokens; the
  running mean keeps the branch causal and lets decoding reproduce the full forward.)
- Key selection (KS): a small MLP scores every key from [k_j, the normalised running sum of queries up to j]
  (both detached); S_t takes the top-scoring keys j <= t. The choice is not differentiable, so the scorer learns
  from the paper's ranking loss: for a random sample of keys, the importance of key j is
  sum_{t >= j, same document} sigmoid(q_t . k_j / sqrt(d)) (detached), and every pair (i, j) of the sample
  contributes BCE-with-logits(s_i - s_j, [imp_i > imp_j] + [imp_i >= imp_j]) / 2). Its mean, times
  ``ranking_loss_weight``, is this module's ``aux_loss`` in training (GatedLM adds it to the loss).

A key chosen by both sources counts once. ``sparse_attention`` "lsh" / "key_selection" keep one source with
the whole budget; "window" is the paper's context-independent baseline (the last ``sparse_keys`` positions).
The gathered attention runs in kernels/hax_attention (Triton or its torch reference: model.kernels.hax); the
key choice here is index bookkeeping without gradients: O(T x keys) memory in query chunks.

Decoding: the cache keeps every key, value, score and bucket of the current document and the running sums, so
a cached call selects exactly the keys the full forward would (tests/model/test_hax.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from ..kernels.hax_attention import hax_attention
from .attention import doc_starts

SOURCES = {"hax": ("lsh", "key_selection"), "lsh": ("lsh",), "key_selection": ("key_selection",),
           "window": ("window",)}
_CHUNK = 256  # queries per selection step: the (B, chunk, keys) masks stay small however long the sequence


def doc_cumsum(x: torch.Tensor, starts: torch.Tensor | None, init: torch.Tensor | None = None) -> torch.Tensor:
    """Running sum within documents: out[:, t] = sum of x over t's document up to t, plus ``init`` (B, C) for
    the first document (it continues a cache). x (B, T, C); starts (B, T) bool (doc_starts) or None."""
    c = x.cumsum(1)
    if init is not None:
        c = c + init[:, None].to(c.dtype)
    if starts is not None:
        pos = torch.arange(x.shape[1], device=x.device)
        last = torch.where(starts, pos, 0).cummax(1).values  # latest document start <= t; 0: the first document
        base = (c - x).gather(1, last[..., None].expand_as(x))  # the running sum just before that start
        c = c - base.masked_fill((last == 0)[..., None], 0)
    return c


@torch.no_grad()
def select_keys(sources: tuple[str, ...], n_per: int, k_pos: torch.Tensor, q_pos: torch.Tensor,
                k_doc: torch.Tensor, q_doc: torch.Tensor, k_bucket: torch.Tensor | None = None,
                q_bucket: torch.Tensor | None = None, score: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, n_per * len(sources)) key positions per query, -1 for an empty slot, none twice in a row.

    Keys at k_pos (N,) with document numbers k_doc (B, N) (-1: a key no query may read); queries at q_pos (T,)
    of documents q_doc (B, T). A query reads keys j with k_pos <= its position and its own document: per
    source, "window" the n_per latest, "lsh" the n_per latest with its bucket, "key_selection" the n_per of
    highest score (minus those another source took already)."""
    B, N = k_doc.shape
    T = q_pos.shape[0]
    n = min(n_per, N)
    out = []
    for a in range(0, T, _CHUNK):
        qp, qd = q_pos[a : a + _CHUNK], q_doc[:, a : a + _CHUNK]
        allowed = (k_pos[None, None, :] <= qp[None, :, None]) & (k_doc[:, None, :] == qd[..., None])
        parts = []
        for src in sources:
            if src == "key_selection":
                val, ix = torch.where(allowed, score.float()[:, None, :], float("-inf")).topk(n, -1)
                ix = ix.masked_fill(val == float("-inf"), -1)
                for prev in parts:  # a key another source chose counts once
                    ix = ix.masked_fill((ix[..., :, None] == prev[..., None, :]).any(-1), -1)
            else:
                ok = allowed if src == "window" else allowed & (k_bucket[:, None, :] == q_bucket[:, a : a + _CHUNK, None])
                val, ix = torch.where(ok, k_pos, -1).topk(n, -1)
                ix = ix.masked_fill(val < 0, -1)
            parts.append(F.pad(ix, (0, n_per - n), value=-1))
        out.append(torch.cat(parts, -1))
    return torch.cat(out, 1)


class HAX(nn.Module):
    """The sparse attention branch of one Gated DeltaNet layer; see the module docstring."""

    def __init__(self, cfg: ModelConfig, value_dim: int):
        super().__init__()
        d = cfg.deltanet
        self.sources = SOURCES[d.sparse_attention]
        self.n_per = d.sparse_keys // len(self.sources)
        self.dim = d.sparse_dim or d.resolved(cfg)[2]
        self.n_bits = d.lsh_bits
        self.weight = d.ranking_loss_weight
        self.qk_proj = nn.Linear(value_dim, 2 * self.dim, bias=False)
        self.out_scale = nn.Parameter(torch.empty(value_dim))
        if "lsh" in self.sources:
            self.register_buffer("lsh_proj", torch.empty(self.dim, self.n_bits))
        if "key_selection" in self.sources:
            w = 2 * self.dim
            self.scorer = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                        nn.Linear(w, 1, bias=False))  # (a shift of every score ranks nothing)
        self.param_decay = {"out_scale": False}  # a gain: decay would shut the branch
        self.backend = cfg.kernels.hax
        self.aux_loss: torch.Tensor | None = None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """The output gain at 1 (the paper's), the LSH projection ~ N(0, 1), the scorer's biases at 0; the LM
        initialises the weight matrices as it does every nn.Linear."""
        self.out_scale.fill_(1.0)
        if "lsh" in self.sources:
            self.lsh_proj.normal_()
        if "key_selection" in self.sources:
            for m in self.scorer:
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.zero_()

    def _bucket(self, x: torch.Tensor, running_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Centred by the mean of the document's earlier vectors (none at its first position: exactly 0 there,
        where a difference of two running sums would leave rounding noise to decide the signs)."""
        earlier = count - 1
        mean = torch.where(earlier > 0, (running_sum - x) / earlier.clamp(min=1), 0.0)
        c = F.normalize(x - mean, dim=-1)  # (normalising changes no sign; it is the paper's form)
        bits = (c @ self.lsh_proj.to(c.dtype)) > 0
        return (bits.long() << torch.arange(self.n_bits, device=x.device)).sum(-1)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache: dict | None = None) -> torch.Tensor:
        """x (B, T, value_dim): the mixer's post-convolution values -> e * sparse attention (B, T, value_dim).
        cache: the layer's decoding dict; the branch keeps its state under "hax"."""
        B, T, _ = x.shape
        D = self.dim
        f = torch.promote_types(x.dtype, torch.float32)
        q, k = self.qk_proj(x).split(D, dim=-1)
        starts = doc_starts(doc_ids) if doc_ids is not None else None
        doc = starts.long().cumsum(1) if starts is not None else torch.zeros(B, T, dtype=torch.long, device=x.device)
        past = {} if cache is None else cache.get("hax", {})
        L = past["k"].shape[1] if past else 0
        new = {}
        if "lsh" in self.sources or "key_selection" in self.sources:
            stats = torch.cat([x.new_ones(B, T, 1, dtype=f), q.detach().to(f), k.detach().to(f)], -1)
            run = doc_cumsum(stats, starts, past.get("sums"))
            new["sums"] = run[:, -1]
            count, qsum, ksum = run.split([1, D, D], -1)
        if "lsh" in self.sources:
            new["q_bucket"] = self._bucket(q.detach().to(f), qsum, count)
            new["bucket"] = self._bucket(k.detach().to(f), ksum, count)
        score = None
        if "key_selection" in self.sources:
            score = self.scorer(torch.cat([k.detach(), F.normalize(qsum, dim=-1).to(k.dtype)], -1)).squeeze(-1)
            new["score"] = score.detach()
        new["k"], new["v"] = k, x

        def keys(name):
            return new[name] if not past else torch.cat([past[name], new[name]], 1)

        k_doc = doc if not past else torch.cat([torch.where(past["live"], 0, -1), doc], 1)
        k_pos = torch.arange(L + T, device=x.device)
        idx = select_keys(self.sources, self.n_per, k_pos, k_pos[L:], k_doc, doc,
                          keys("bucket") if "lsh" in self.sources else None, new.get("q_bucket"),
                          keys("score") if score is not None else None)
        out = hax_attention(q, keys("k"), keys("v"), idx, D ** -0.5, backend=self.backend)
        if cache is not None:  # keys of x's last document stay readable; the rest are kept but marked dead
            kept = {n: keys(n).detach() for n in ("k", "v", "bucket", "score") if n in new}
            cache["hax"] = {**kept, "live": k_doc == doc[:, -1:], **({"sums": new["sums"]} if "sums" in new else {})}
        self.aux_loss = None
        if self.training and score is not None and self.weight > 0 and torch.is_grad_enabled():
            self.aux_loss = self.weight * self.ranking_loss(q.detach(), k.detach(), score, doc)
        return out * self.out_scale.to(out.dtype)

    def ranking_loss(self, q: torch.Tensor, k: torch.Tensor, score: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        """The paper's pairwise ranking loss on a random sample of n_per keys per row (module docstring)."""
        B, T, D = q.shape
        m = min(self.n_per, T)
        sel = torch.rand(B, T, device=q.device).topk(m, -1).indices  # (B, m)
        ks = k.gather(1, sel[..., None].expand(B, m, D))
        pos = torch.arange(T, device=q.device)
        reads = (pos[None, :, None] >= sel[:, None, :]) & (doc[:, :, None] == doc.gather(1, sel)[:, None, :])
        imp = (torch.einsum("btd,bmd->btm", q.float(), ks.float()).mul(D ** -0.5).sigmoid() * reads).sum(1)
        label = ((imp[..., :, None] > imp[..., None, :]).float() + (imp[..., :, None] >= imp[..., None, :]).float()) / 2
        s = score.gather(1, sel).float()
        return F.binary_cross_entropy_with_logits(s[..., :, None] - s[..., None, :], label)
