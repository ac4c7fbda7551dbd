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
key choice here is index bookkeeping without gradients, O(T log T + T x keys): a sort for LSH, a running top-k
for key selection.

Decoding: the cache keeps every key, value, score and bucket of the current document and the running sums, so
a cached call selects exactly the keys the full forward would (tests/model/test_hax.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.kernels.hax_attention import hax_attention
from hybridtron.model.attention import doc_starts

SOURCES = {"hax": ("lsh", "key_selection"), "lsh": ("lsh",), "key_selection": ("key_selection",),
           "window": ("window",)}
_CHUNK = 128  # queries per key-selection step: (B, chunk, n_per + chunk) candidates, whatever the length


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
def select_keys(sources: tuple[str, ...], n_per: int, k_doc: torch.Tensor, q_doc: torch.Tensor,
                k_bucket: torch.Tensor | None = None, q_bucket: torch.Tensor | None = None,
                score: torch.Tensor | None = None, chunk: int = _CHUNK) -> torch.Tensor:
    """(B, T, n_per * len(sources)) key positions per query, -1 for an empty slot, none twice in a row.

    Keys 0 .. N-1 with document numbers k_doc (B, N), never decreasing along a row (documents are contiguous;
    -1: keys of a cache's earlier documents, which no query may read); the queries are the last T of them (a
    cache's L = N - T keys come first), of documents q_doc (B, T). A query reads keys j <= its own
    position in its own document: per source, "window" the n_per latest, "lsh" the n_per latest with its
    bucket, "key_selection" the n_per of highest score (minus those another source took already). Cost
    O(N log N + T n_per) for window and LSH (a sort of the keys by (bucket, position)), O(T (n_per + chunk))
    for key selection (a running top-n_per carried from chunk to chunk of queries)."""
    B, N = k_doc.shape
    T = q_doc.shape[1]
    L = N - T
    dev = k_doc.device
    p = torch.arange(L, N, device=dev)  # the queries' positions
    back = torch.arange(n_per, device=dev)

    def take(x, pos):  # x (B, N) at positions pos (B, T, k)
        return x.gather(1, pos.reshape(B, -1)).view(pos.shape)

    parts = []
    for src in sources:
        if src == "window":
            j = (p[:, None] - back).expand(B, T, n_per)
            ok = (j >= 0) & (take(k_doc, j.clamp(min=0)) == q_doc[..., None])
            ix = torch.where(ok, j, -1)
        elif src == "lsh":  # the run of q's bucket in (bucket, position) order ends at its latest key <= p
            order_key, order = (k_bucket * N + torch.arange(N, device=dev)).sort(dim=1)
            end = torch.searchsorted(order_key, q_bucket * N + p, right=True) - 1
            at = end[..., None] - back  # (B, T, n_per): the run's last n_per entries, latest first
            j = take(order, at.clamp(min=0))
            ok = (at >= 0) & (take(k_bucket, j) == q_bucket[..., None]) & (take(k_doc, j) == q_doc[..., None])
            ix = torch.where(ok, j, -1)
        else:
            ix = _top_scored(n_per, k_doc, q_doc, score.float(), L, chunk)
            for prev in parts:  # a key another source chose counts once
                ix = ix.masked_fill((ix[..., :, None] == prev[..., None, :]).any(-1), -1)
        parts.append(ix)
    return torch.cat(parts, -1)


def _top_scored(n: int, k_doc: torch.Tensor, q_doc: torch.Tensor, score: torch.Tensor, L: int,
                chunk: int) -> torch.Tensor:
    """(B, T, n): per query the n best-scored keys j <= its position in its document. The scores do not depend
    on the query, so the best n before a chunk of queries (in the document of its first query) and the
    chunk's own keys hold every query's answer; the carry for the next chunk is the best n of those in the
    next chunk's first document (a document starting inside the chunk has no key before it)."""
    B, N = k_doc.shape
    T = q_doc.shape[1]
    dev = k_doc.device
    inf = float("-inf")

    def best(cand, ok, scores):  # cand (B, M) positions; ok (B, [Q,] M) -> the n best per row, -1 padded
        val, ix = torch.where(ok, scores, inf).topk(min(n, cand.shape[-1]), -1)
        got = cand.gather(-1, ix) if ix.dim() == 2 else cand[:, None, :].expand(*ix.shape[:2], -1).gather(-1, ix)
        got = torch.where(val > inf, got, -1)
        return F.pad(got, (0, n - got.shape[-1]), value=-1)

    if L:
        carry = best(torch.arange(L, device=dev).expand(B, L), k_doc[:, :L] == q_doc[:, :1], score[:, :L])
    else:
        carry = torch.full((B, n), -1, dtype=torch.long, device=dev)
    out = []
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        cand = torch.cat([carry, torch.arange(L + a, L + b, device=dev).expand(B, -1)], 1)  # (B, M)
        valid = cand >= 0
        cs = torch.where(valid, score.gather(1, cand.clamp(min=0)), inf)
        cd = torch.where(valid, k_doc.gather(1, cand.clamp(min=0)), -2)
        qp = torch.arange(L + a, L + b, device=dev)
        ok = (cand[:, None, :] <= qp[None, :, None]) & (cd[:, None, :] == q_doc[:, a:b, None])
        out.append(best(cand, ok, cs[:, None, :].expand_as(ok)))
        if b < T:
            carry = best(cand, cd == q_doc[:, b : b + 1], cs)
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
        idx = select_keys(self.sources, self.n_per, k_doc, doc, keys("bucket") if "lsh" in self.sources else None,
                          new.get("q_bucket"), keys("score") if score is not None else None)
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
