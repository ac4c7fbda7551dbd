"""Context parallelism: the ``cp`` ranks of one data-parallel group split every sequence into cp contiguous
pieces of seq_len / cp positions, and each runs the whole model on its piece.

Only the sequence mixers need the other pieces:

- **Attention**: ring attention. The key/value blocks of the pieces pass round the ring of cp ranks; each rank
  scores its queries against every block it holds (causal and document masks at global positions; later
  pieces skipped) and merges the partial results by their log-sum-exp, and in the backward the blocks go round
  again carrying their gradients home (``_RingAttention``). Rotary positions are the global ones.
- **Gated DeltaNet**: the short convolution reads the last conv_size - 1 inputs of the previous piece (sent
  point to point; the gradient goes back the same way). The delta rule's state is affine in the state a piece
  starts from, so every rank runs its piece at once and learns that map (one run, ``delta_rule``); the maps
  are all-gathered, and each rank composes the state its piece starts from and corrects its outputs. A
  document boundary between two pieces resets the state as it would on one device.

The loss of each rank is the mean over its own positions, so gradients are averaged over dp x cp ranks (the
data-parallel wrapper runs over both) and the logged loss is the mean over them, which is the one-device loss
when every position carries a label. MoE layers route each piece's tokens; their balance loss takes the whole
sequences' expert loads (``sum_counts``) with the piece's mean router probabilities, so the mean over the
pieces is the one-device loss, gradient included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def local_piece(batch: dict, mesh) -> dict:
    """This rank's piece of every (B, T) tensor of ``batch`` (all cp ranks read the same batches)."""
    if mesh is None or mesh.cp == 1:
        return batch
    r, n = mesh.cp_rank, mesh.cp
    return {k: v.chunk(n, dim=1)[r].contiguous() for k, v in batch.items()}


HALO, RING = 2, 8  # message tags: the convolution halo; ring attention's blocks (RING + i for the i-th tensor)


class ContextParallel:
    """The hooks the LM and its sequence mixers call under context parallelism (``context_parallel`` attribute).

    The convolution halos form a chain (rank r - 1 -> r forward, r -> r - 1 backward). Every send is
    non-blocking and only receives wait, so no rank waits on one that is itself waiting, whatever order
    autograd runs a rank's backward nodes in; the exchanges use a process group of their own."""

    def __init__(self, group):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global = [dist.get_global_rank(group, i) for i in range(self.n)]
        self._pending: list = []  # (work, tensor) of sends not known to be complete
        self.whole_ids: torch.Tensor | None = None
        # A pipeline runs several micro-batches' forwards before their backwards (and recomputation runs a forward
        # again in the backward): the whole document ids of each piece's doc_ids, by that tensor's identity.
        self._wholes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- shared -----------------------------------------------------------------------------------------------
    def begin(self, doc_ids: torch.Tensor | None) -> None:
        """At the start of every forward: the sends of the last step are complete, and the whole sequence's
        document ids (attention masks, convolution halos and state resets need them) are known."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self.whole_ids = None
        if doc_ids is not None:
            parts = [torch.empty_like(doc_ids) for _ in range(self.n)]
            dist.all_gather(parts, doc_ids.contiguous(), group=self.group)
            self.whole_ids = torch.cat(parts, dim=1)
            if len(self._wholes) >= 64:  # a step's micro-batches at most are in flight at once
                self._wholes.pop(next(iter(self._wholes)))
            self._wholes[id(doc_ids)] = (doc_ids, self.whole_ids)

    def whole(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """The whole sequences' document ids of which ``doc_ids`` is this rank's piece (seen by ``begin``)."""
        known = self._wholes.get(id(doc_ids))
        return known[1] if known is not None and known[0] is doc_ids else self.whole_ids

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """A count tensor summed over the pieces (MoE expert loads: the balance loss is over whole sequences)."""
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.group)
        return counts

    def offset(self, local_len: int) -> int:
        """The global position of this piece's first token."""
        return self.rank * local_len

    def _send(self, t: torch.Tensor, to: int, tag: int) -> None:
        t = t.detach().contiguous()
        self._pending.append((dist.isend(t, dst=self._global[to], group=self.group, tag=tag), t))

    def _recv(self, like: tuple, frm: int, tag: int) -> torch.Tensor:
        shape, dtype, device = like
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=self._global[frm], group=self.group, tag=tag)
        return t

    def from_previous(self, shape, dtype, device, tag: int) -> torch.Tensor:
        """What the previous rank sent with ``to_next``; its gradient goes back there in the backward."""
        anchor = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())  # puts the receive in the graph
        return _FromPrevious.apply(anchor, self, (tuple(shape), dtype, device), tag)

    def to_next(self, t: torch.Tensor, tag: int) -> torch.Tensor:
        """Send ``t`` to the next rank; returns a zero to add to an output, whose backward fetches t's gradient."""
        return _ToNext.apply(t, self, tag)

    # ---- attention ---------------------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None):
        """Ring attention of this piece's queries over every piece's keys and values: (B, t, H, D) q and
        (B, t, KV, D) k, v -> (B, t, H, D), causal at global positions and within documents (``_RingAttention``)."""
        return _RingAttention.apply(q, k, v, doc_ids, self)

    def _rotate(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors`` to the next rank of the ring and receive the previous rank's, of the same shapes."""
        nxt, prv = self._global[(self.rank + 1) % self.n], self._global[(self.rank - 1) % self.n]
        out = [torch.empty_like(t) for t in tensors]
        works = [dist.isend(t.contiguous(), dst=nxt, group=self.group, tag=RING + i) for i, t in enumerate(tensors)]
        works += [dist.irecv(o, src=prv, group=self.group, tag=RING + i) for i, o in enumerate(out)]
        for w in works:
            w.wait()
        return out

    def _block_mask(self, src: int, t: int, doc_ids: torch.Tensor | None, device) -> torch.Tensor | None:
        """(B or 1, 1, t, t) bool: which keys of piece ``src`` this piece's queries see; None when none does."""
        if src > self.rank:  # a later piece: causally invisible
            return None
        if src == self.rank:
            mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None, None]
        else:
            mask = torch.ones(1, 1, t, t, dtype=torch.bool, device=device)
        if doc_ids is not None:
            keys = self.whole(doc_ids)[:, src * t:(src + 1) * t]
            mask = mask & (doc_ids[:, None, :, None] == keys[:, None, None, :])
        return mask

    # ---- Gated DeltaNet ----------------------------------------------------------------------------------------
    def conv_halo(self, mixed: torch.Tensor, doc_ids: torch.Tensor | None, width: int):
        """(halo, halo document ids, zero): the previous piece's last ``width`` convolution inputs (zeros on the
        first rank, whose halo id -1 matches no token) for a causal convolution over [halo | piece], and a zero
        to add to the convolution's output that carries this piece's tail gradient back from the next rank."""
        zero = self.to_next(mixed[:, -width:], HALO) if self.rank < self.n - 1 else None
        if self.rank == 0:
            halo = torch.zeros_like(mixed[:, :width])
        else:
            halo = self.from_previous((mixed.shape[0], width, mixed.shape[2]), mixed.dtype, mixed.device, HALO)
        halo_ids = None
        if doc_ids is not None:
            t = doc_ids.shape[1]
            halo_ids = (self.whole(doc_ids)[:, self.rank * t - width:self.rank * t] if self.rank
                        else torch.full_like(doc_ids[:, :width], -1))
        return halo, halo_ids, zero

    def first_is_doc_start(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """(B,) True where this piece's first token starts a document the previous piece did not end in."""
        if self.rank == 0:
            return torch.zeros(doc_ids.shape[0], dtype=torch.bool, device=doc_ids.device)
        return doc_ids[:, 0] != self.whole(doc_ids)[:, self.rank * doc_ids.shape[1] - 1]

    def delta_rule(self, fn, q, k, v, g, beta, resets, **kw):
        """``fn`` (a delta rule: reference or kernel) on this piece as if the pieces before it had run first, with
        every rank computing at once.

        The piece's state is affine in the state it starts from, S_end = A S_0 + B, and so is every output,
        o_t = o_t(0) + S_0^T Q_t. The state's columns evolve independently, so one run of ``fn`` from the
        state [I | 0] with the values [0 | v] gives both at once: the first Dk output columns are Q, the others
        o(0), and its final state is [A | B]. The ranks all-gather (A, B) (Dk x (Dk + Dv) per head: small),
        each composes the state its piece starts from, S_r = A_{r-1} S_{r-1} + B_{r-1} with S_0 = 0, and adds
        S_r^T Q. The all-gather is differentiable: its backward returns each (A, B) its gradient from the
        later pieces that used it."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        B, T, n_h, Hv, Dv = v.shape
        Dk = k.shape[-1]
        dtype = torch.promote_types(q.dtype, torch.float32)
        eye = torch.eye(Dk, dtype=dtype, device=q.device).expand(B, Hv, Dk, Dk)
        start = torch.cat([eye, eye.new_zeros(B, Hv, Dk, Dv)], dim=-1)  # (B, Hv, Dk, Dk + Dv)
        values = torch.cat([v.new_zeros(B, T, n_h, Hv, Dk), v], dim=-1)
        out, final = fn(q, k, values, g, beta, resets=resets, initial_state=start, output_final_state=True, **kw)
        q_eff, o = out.split([Dk, Dv], dim=-1)  # (B, T, Hv, Dk): Q; (B, T, Hv, Dv): the output from a zero state
        pieces = all_gather_tensor_autograd(final.unsqueeze(0).contiguous(), gather_dim=0, group=self.group)
        if self.rank == 0:  # starts from zero; the zero term keeps the gather in its graph, so that its backward
            return o + (pieces.sum() * 0).to(o.dtype)  # (a collective) runs here as on the ranks that use it
        state = None
        for j in range(self.rank):  # (B, Hv, Dk, Dk) A_j and (B, Hv, Dk, Dv) B_j of the pieces before this one
            a, b = pieces[j].split([Dk, Dv], dim=-1)
            state = b if state is None else a @ state + b
        return o + torch.einsum("bthk,bhkv->bthv", q_eff.to(state.dtype), state).to(o.dtype)


class _FromPrevious(torch.autograd.Function):
    """Forward: receive from the previous cp rank. Backward: send the gradient back to it (without waiting)."""

    @staticmethod
    def forward(ctx, anchor, cp, like, tag):
        ctx.cp, ctx.tag = cp, tag
        return cp._recv(like, cp.rank - 1, tag)

    @staticmethod
    def backward(ctx, grad):
        ctx.cp._send(grad, ctx.cp.rank - 1, ctx.tag)
        return torch.zeros((), device=grad.device), None, None, None


class _ToNext(torch.autograd.Function):
    """Forward: send to the next cp rank (without waiting), return a zero. Backward: receive the gradient."""

    @staticmethod
    def forward(ctx, t, cp, tag):
        ctx.cp, ctx.tag, ctx.like = cp, tag, (t.shape, t.dtype, t.device)
        cp._send(t, cp.rank + 1, tag)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        return ctx.cp._recv(ctx.like, ctx.cp.rank + 1, ctx.tag), None, None


class _RingAttention(torch.autograd.Function):
    """Softmax attention of a piece's queries over all pieces' keys and values, the blocks passed round the ring.

    Forward: each rank starts with its own (k, v) block and passes it on cp - 1 times, so every block visits
    every rank; a block from a later piece is skipped (causally invisible), the others are scored under the
    causal / document mask, and the partial outputs are merged by their log-sum-exp (the online softmax).
    Backward: the blocks go round again, now with their key and value gradients travelling along: each rank
    adds its queries' contribution and passes them on, and after cp passes every block is home with its whole
    gradient. The scores of one block exist at a time, (B, H, t, t) for t = T / cp: nothing of size T x T.
    Computation in fp32 at least; grouped-query heads map query head h to kv head h // (H / KV)."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, cp):
        B, t, H, D = q.shape
        f32 = torch.promote_types(q.dtype, torch.float32)
        qh = q.to(f32).transpose(1, 2) * D**-0.5  # (B, H, t, D)
        out = torch.zeros(B, H, t, D, dtype=f32, device=q.device)
        lse = torch.full((B, H, t), float("-inf"), dtype=f32, device=q.device)
        block = [k, v]
        for step in range(cp.n):
            src = (cp.rank - step) % cp.n
            mask = cp._block_mask(src, t, doc_ids, q.device)
            if mask is not None:
                kb, vb, scores = _block_scores(qh, block[0], block[1], mask)
                blk = torch.logsumexp(scores, dim=-1)  # (B, H, t): -inf where a row sees nothing here
                new = torch.logaddexp(lse, blk)
                safe = torch.where(torch.isinf(new), 0.0, new)[..., None]
                p = torch.exp(scores - safe)
                out = out * torch.exp(lse[..., None] - safe) + p @ vb
                lse = new
            if step < cp.n - 1:
                block = cp._rotate(block)
        ctx.save_for_backward(q, k, v, doc_ids, out, lse)
        ctx.cp = cp
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, doc_ids, out, lse = ctx.saved_tensors
        cp = ctx.cp
        B, t, H, D = q.shape
        KV = k.shape[2]
        f32 = out.dtype
        qh = q.to(f32).transpose(1, 2) * D**-0.5
        do = dout.to(f32).transpose(1, 2)  # (B, H, t, D)
        delta = (do * out).sum(-1, keepdim=True)  # (B, H, t, 1): rowsum(dO * O)
        safe = torch.where(torch.isinf(lse), 0.0, lse)[..., None]
        dq = torch.zeros_like(qh)
        block = [k, v, torch.zeros(k.shape, dtype=f32, device=k.device), torch.zeros(v.shape, dtype=f32,
                                                                                    device=v.device)]
        for step in range(cp.n):
            src = (cp.rank - step) % cp.n
            mask = cp._block_mask(src, t, doc_ids, q.device)
            if mask is not None:
                kb, vb, scores = _block_scores(qh, block[0], block[1], mask)
                p = torch.exp(scores - safe)  # the final softmax's probabilities of this block's keys
                dp = do @ vb.transpose(-1, -2)
                ds = p * (dp - delta)
                dq += ds @ kb
                block[2] += _kv_heads(ds.transpose(-1, -2) @ qh, KV).transpose(1, 2)  # (B, t, KV, D)
                block[3] += _kv_heads(p.transpose(-1, -2) @ do, KV).transpose(1, 2)
            block = cp._rotate(block)  # after cp passes every block, with its gradients, is back home
        dq = (dq * D**-0.5).transpose(1, 2)
        return dq.to(q.dtype), block[2].to(k.dtype), block[3].to(v.dtype), None, None


def _block_scores(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """One key/value block against the scaled queries qh (B, H, t, D): its keys and values per query head
    (B, H, t, D), in qh's dtype, and the masked scores (B, H, t, t)."""
    group = qh.shape[1] // k.shape[2]
    kb, vb = (_heads(x.to(qh.dtype), group) for x in (k, v))
    return kb, vb, (qh @ kb.transpose(-1, -2)).masked_fill(~mask, float("-inf"))


def _heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, t, KV, D) -> (B, KV * group, t, D): kv head j serves query heads j * group .. (j + 1) * group - 1."""
    return x.transpose(1, 2).repeat_interleave(group, dim=1)


def _kv_heads(x: torch.Tensor, kv: int) -> torch.Tensor:
    """(B, H, t, D) gradients per query head -> (B, KV, t, D), summed over each kv head's query heads."""
    B, H, t, D = x.shape
    return x.view(B, kv, H // kv, t, D).sum(2)


def apply_context_parallel(model: nn.Module, mesh) -> nn.Module:
    """Give the LM and its sequence mixers the hooks above."""
    if mesh is None or mesh.cp == 1:
        return model
    hooks = ContextParallel(mesh.cp_group)
    for m in model.modules():
        if hasattr(m, "context_parallel"):
            m.context_parallel = hooks
    return model
