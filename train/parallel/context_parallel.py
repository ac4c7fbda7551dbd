"""Context parallelism: the ``cp`` ranks of one data-parallel group split every sequence, and each runs the whole
model on its piece.

**Layout (zig-zag).** Each sequence is cut into 2 cp chunks of seq_len / (2 cp) positions, and rank r holds chunks r
and 2 cp - 1 - r, in that order (``local_piece``): under a causal mask the late chunks see the most keys, so pairing
an early with a late chunk gives every rank the same attention work (with cp contiguous pieces the last rank would
do cp times the first's). Rotary tables are taken at the chunks' global positions (``positions``).

Only the sequence mixers need the other ranks' chunks:

- **Attention**: ring attention. The key/value blocks pass round the ring of cp ranks (each send overlapped with
  the step before it); each rank attends with its queries to every block by the attention backend the model chose
  (``kernels/gated_attention/blocks.py``: torch's fused SDPA kernels, our Triton kernel, or the pure-torch
  reference), and merges the partial results by their log-sum-exp; in the backward the blocks go round again,
  carrying their key and value gradients home (``_RingAttention``). Under zig-zag every step is the same work:
  step 0 the rank's own block (causal), then from an earlier rank its first chunk against all the queries, from a
  later rank all its keys against the second query chunk (both unmasked: those keys all precede those queries).
  Documents: a key block that precedes its queries shares at most one document with them, the one its last key is
  in, whose queries are a prefix of the rank's and whose keys a suffix of the block; so each such step is one
  unmasked rectangle per batch row (bounds found once per forward, one host sync), and the own block is causal
  within documents. No block's scores exist outside the kernels.
- **Gated DeltaNet**: the short convolution reads the last conv_size - 1 inputs of the chunk before each of the
  rank's chunks (all-gathered: a few positions per chunk; the gradient returns through the gather). The delta
  rule's state is affine in the state a chunk starts from, so every rank runs its two chunks at once (as a batch of
  2 B rows) and learns those maps (one run, ``delta_rule``); the maps are all-gathered, and each rank composes, in
  sequence order, the states its chunks start from and corrects their outputs. A document boundary between two
  chunks resets the state as it would on one device.

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

from hybridtron.kernels.backend import BackendError, forced_choice, pick
from hybridtron.kernels.gated_attention import blocks

RING = 8  # message tags of ring attention's blocks (RING + i for the i-th tensor passed on)


def zigzag(x: torch.Tensor, n: int, r: int, dim: int = 1) -> torch.Tensor:
    """Rank r's piece of ``x`` along ``dim``: chunks r and 2n - 1 - r of its 2n equal chunks, in that order."""
    chunks = x.chunk(2 * n, dim=dim)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=dim)


def local_piece(batch: dict, mesh) -> dict:
    """This rank's piece of every (B, T) tensor of ``batch`` (all cp ranks read the same batches)."""
    if mesh is None or mesh.cp == 1:
        return batch
    return {k: zigzag(v, mesh.cp, mesh.cp_rank).contiguous() for k, v in batch.items()}


def ring_backend(requested: str, device: torch.device, docs: bool) -> str:
    """The block backend of ring attention for ``model.kernels.attention``: reference, sdpa and triton as asked;
    ``auto`` the reference on the CPU, and on CUDA our Triton kernel with documents (bounds, one call) and SDPA's
    flash kernel without (the faster of the two at D 128 in our H100 measurement of whole attention); flex and
    flash-attn have no block form here (refused when the config loads)."""
    held = forced_choice("attention", device.type)  # the planner's fake run: the kernels of the GPU it plans for
    if held is not None:
        return held if held in blocks.RING_BACKENDS else "triton"
    if requested == "auto":
        if device.type != "cuda":
            return "reference"
        requested = "triton" if docs else "sdpa"
    if requested not in blocks.RING_BACKENDS:
        raise BackendError(f"model.kernels.attention={requested} has no ring-attention form under context "
                           f"parallelism; choose one of auto, {', '.join(blocks.RING_BACKENDS)}")
    if requested != "reference":
        pick("attention", requested, device.type)  # refuses what cannot run here (cached: every layer asks)
    return requested


def ring_rectangle(rank: int, src: int, t: int) -> tuple[int, int, int, int]:
    """(q0, q1, k0, k1): which of rank ``rank``'s t queries see the block of rank ``src`` != rank, and which of its
    keys they see, without documents. From an earlier rank its first chunk precedes both of this rank's chunks;
    from a later rank both its chunks precede only this rank's second. Either way t x t / 2 pairs, unmasked."""
    c = t // 2
    return (0, t, 0, c) if src < rank else (c, t, 0, t)


def ring_steps(n: int, rank: int, fake: bool) -> list[tuple[int, int]]:
    """(step, src) of the ring steps after the own block: step i attends to the block of rank (rank - i) mod n.

    On fake tensors (the planner's run: shapes only, and the planned rank stands for every cp rank) the heaviest
    rank's steps, each kind once: a step's memory is the same from one step to the next of its kind (the block
    received, the next one posted, the kernel's and the merge's temporaries of its rectangle), and the last step
    posts no next block. A block from an earlier rank gives t queries' outputs and t x H x D query gradients
    against a later one's t / 2 (``ring_rectangle``; H >= KV): so a step from an earlier rank with the next block
    posted, then one from a later rank, last (one step with n = 2). The plan then takes two steps at any cp."""
    if not fake:
        return [(i, (rank - i) % n) for i in range(1, n)]
    return [(1, -1), (2, n)][:n - 1]  # sources before and after every rank: one rectangle of each kind


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class _Documents:
    """One forward's documents as this rank needs them (``ContextParallel.begin``): the whole sequences'
    document numbers in sequence order (``canon``, a run of equal ids = one document, numbered 0, 1, ...), each
    rank's zig-zag piece of them, this rank's as a `blocks.Docs`, and ring attention's rectangles per step."""

    def __init__(self, cp: ContextParallel, doc_ids: torch.Tensor):
        n, r = cp.n, cp.rank
        parts = [torch.empty_like(doc_ids) for _ in range(n)]
        dist.all_gather(parts, doc_ids.contiguous(), group=cp.group)
        c = doc_ids.shape[1] // 2
        chunks: list = [None] * (2 * n)
        for j, part in enumerate(parts):
            chunks[j], chunks[2 * n - 1 - j] = part[:, :c], part[:, c:]
        whole = torch.cat(chunks, dim=1)  # (B, T) in sequence order
        first = torch.zeros_like(whole, dtype=torch.bool)
        first[:, 1:] = whole[:, 1:] != whole[:, :-1]
        self.canon = first.long().cumsum(1)
        self.pieces = [zigzag(self.canon, n, j) for j in range(n)]
        self.local = blocks.Docs(self.pieces[r])
        # Step i > 0 attends to the block of rank src = r - i: with documents only the document its last key is in
        # can reach the queries: (q0, q1, k0, k1) per batch row, counted (its queries a prefix, its keys a suffix).
        mine, spans = self.pieces[r], []
        for i in range(1, n):
            src = (r - i) % n
            q0, q1, k0, k1 = ring_rectangle(r, src, 2 * c)
            keys = self.pieces[src][:, k0:k1]
            last = keys[:, -1:]
            a = (mine[:, q0:q1] == last).sum(1)
            b = (keys == last).sum(1)
            spans.append(torch.stack([torch.full_like(a, q0), q0 + a, k1 - b, torch.full_like(b, k1)], dim=1))
        # (n - 1, B, 4): one host sync per forward. A fake tensor (the planner's) has no values: the rectangles are
        # then taken whole, as without documents (the most any step of a real run does).
        self.spans = None if _is_fake(doc_ids) else torch.stack(spans).tolist() if spans else []


class ContextParallel:
    """The hooks the LM and its sequence mixers call under context parallelism (``context_parallel`` attribute)."""

    def __init__(self, group):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global = [dist.get_global_rank(group, i) for i in range(self.n)]
        self.docs: _Documents | None = None
        # A pipeline runs several micro-batches' forwards before their backwards (and recomputation runs a forward
        # again in the backward): each forward's documents, by its doc_ids tensor's identity.
        self._docs: dict[int, tuple[torch.Tensor, _Documents]] = {}

    # ---- shared -----------------------------------------------------------------------------------------------
    def begin(self, doc_ids: torch.Tensor | None) -> None:
        """At the start of every forward: the whole sequences' documents (attention's rectangles, the convolution
        halos' ids and the state resets need them)."""
        self.docs = None
        if doc_ids is not None:
            self.docs = _Documents(self, doc_ids)
            if len(self._docs) >= 64:  # a step's micro-batches at most are in flight at once
                self._docs.pop(next(iter(self._docs)))
            self._docs[id(doc_ids)] = (doc_ids, self.docs)

    def documents(self, doc_ids: torch.Tensor | None) -> _Documents | None:
        """The documents of the forward whose piece ``doc_ids`` is (seen by ``begin``)."""
        if doc_ids is None:
            return None
        known = self._docs.get(id(doc_ids))
        return known[1] if known is not None and known[0] is doc_ids else self.docs

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """(local_len,) the global positions of this rank's piece (its two chunks)."""
        c = local_len // 2
        a, b = self.rank * c, (2 * self.n - 1 - self.rank) * c
        return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """A count tensor summed over the pieces (MoE expert loads: the balance loss is over whole sequences)."""
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.group)
        return counts

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """(n, *t.shape): every rank's ``t``, differentiable (the backward returns each its gradient)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(t.unsqueeze(0).contiguous(), gather_dim=0, group=self.group)

    def _where(self, chunk: int) -> tuple[int, int]:
        """(rank, slot) holding global chunk ``chunk``."""
        return (chunk, 0) if chunk < self.n else (2 * self.n - 1 - chunk, 1)

    def _mine(self) -> tuple[int, int]:
        return self.rank, 2 * self.n - 1 - self.rank

    @staticmethod
    def stack(x: torch.Tensor) -> torch.Tensor:
        """(B, 2c, ...) -> (2B, c, ...): the rank's two chunks as batch rows (row 2b + j: chunk j of row b)."""
        B, t = x.shape[:2]
        return x.reshape(B * 2, t // 2, *x.shape[2:])

    @staticmethod
    def unstack(x: torch.Tensor) -> torch.Tensor:
        """Inverse of ``stack``."""
        B2, c = x.shape[:2]
        return x.reshape(B2 // 2, 2 * c, *x.shape[2:])

    # ---- attention ---------------------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None,
                  backend: str = "reference"):
        """Ring attention of this piece's queries over every piece's keys and values: (B, t, H, D) q and
        (B, t, KV, D) k, v -> (B, t, H, D), causal at global positions and within documents (``_RingAttention``)."""
        docs = self.documents(doc_ids)
        return _RingAttention.apply(q, k, v, self, ring_backend(backend, q.device, docs is not None), docs)

    def _start_rotate(self, tensors: list[torch.Tensor], tag: int = RING) -> tuple[list, list[torch.Tensor]]:
        """Send ``tensors`` to the next rank of the ring and post the receives of the previous rank's, of the same
        shapes: (requests, receive buffers); ``_finish`` waits."""
        nxt, prv = self._global[(self.rank + 1) % self.n], self._global[(self.rank - 1) % self.n]
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, o, prv, self.group, tag + i) for i, o in enumerate(out)]
        return dist.batch_isend_irecv(ops), out

    @staticmethod
    def _finish(pending) -> list[torch.Tensor]:
        works, out = pending
        for w in works:
            w.wait()
        return out

    def _segments(self, step: int, src: int, t: int, docs: _Documents | None):
        """The (rows, q0, q1, k0, k1) rectangles of ring step ``step`` > 0, over the block of rank ``src`` (rows: a
        batch slice)."""
        if docs is None or docs.spans is None:
            yield slice(None), *ring_rectangle(self.rank, src, t)
            return
        for b, (q0, q1, k0, k1) in enumerate(docs.spans[step - 1]):
            if q1 > q0 and k1 > k0:
                yield slice(b, b + 1), q0, q1, k0, k1

    # ---- Gated DeltaNet ----------------------------------------------------------------------------------------
    def conv_input(self, mixed: torch.Tensor, doc_ids: torch.Tensor | None, width: int):
        """(x, ids): the rank's two chunks as batch rows (``stack``), each after the last ``width`` convolution
        inputs of the chunk before it in the sequence (zeros before the first chunk, whose halo id -1 matches no
        token): (2B, width + c, C), and their document numbers (2B, width + c) or None. A causal convolution over
        it, minus the first ``width`` outputs, is the one-device convolution of the chunks."""
        B, t, C = mixed.shape
        c = t // 2
        tails = self._gather(mixed.view(B, 2, c, C)[:, :, c - width:])  # (n, B, 2, width, C)
        halos = []
        for j in self._mine():
            if j == 0:
                halos.append(mixed.new_zeros(B, width, C))
            else:
                rank, slot = self._where(j - 1)
                halos.append(tails[rank, :, slot])
        x = torch.cat([torch.stack(halos, dim=1), mixed.view(B, 2, c, C)], dim=2).view(2 * B, width + c, C)
        docs = self.documents(doc_ids)
        if docs is None:
            return x, None
        canon = docs.canon
        ids = [torch.cat([canon[:, j * c - width:j * c] if j else torch.full_like(canon[:, :width], -1),
                          canon[:, j * c:(j + 1) * c]], dim=1) for j in self._mine()]
        return x, torch.stack(ids, dim=1).view(2 * B, width + c)

    def chunk_resets(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """(2B, c) bool, in ``stack``'s rows: where a document starts in each of the rank's chunks, its first
        token included when the chunk before it ended another document."""
        canon = self.documents(doc_ids).canon
        c = doc_ids.shape[1] // 2
        rows = []
        for j in self._mine():
            piece = canon[:, j * c:(j + 1) * c]
            prev = canon[:, j * c - 1:j * c] if j else piece[:, :1]
            rows.append(torch.cat([prev, piece], dim=1).diff(dim=1) != 0)
        return torch.stack(rows, dim=1).view(-1, c)

    def delta_rule(self, fn, q, k, v, g, beta, resets, **kw):
        """``fn`` (a delta rule: reference or kernel) on this rank's two chunks as if every chunk before each had
        run first, with every rank computing at once. Inputs (B, 2c, ...) in the rank's layout; ``resets`` (2B, c)
        from ``chunk_resets`` or None.

        A chunk's state is affine in the state it starts from, S_end = A S_0 + B, and so is every output,
        o_t = o_t(0) + S_0^T Q_t. The state's columns evolve independently, so one run of ``fn`` from the
        state [I | 0] with the values [0 | v] gives both at once: the first Dk output columns are Q, the others
        o(0), and its final state is [A | B]. The ranks all-gather (A, B) of their chunks (Dk x (Dk + Dv) per head:
        small), each composes in sequence order the states its chunks start from, S_{j+1} = A_j S_j + B_j with
        S_0 = 0, and adds S_j^T Q. The all-gather is differentiable: its backward returns each (A, B) its gradient
        from the later chunks that used it."""
        B, T, n_h, Hv, Dv = v.shape
        Dk = k.shape[-1]
        q, k, v, g, beta = (self.stack(x) for x in (q, k, v, g, beta))
        dtype = torch.promote_types(q.dtype, torch.float32)
        eye = torch.eye(Dk, dtype=dtype, device=q.device).expand(2 * B, Hv, Dk, Dk)
        start = torch.cat([eye, eye.new_zeros(2 * B, Hv, Dk, Dv)], dim=-1)  # (2B, Hv, Dk, Dk + Dv)
        values = torch.cat([v.new_zeros(2 * B, T // 2, n_h, Hv, Dk), v], dim=-1)
        out, final = fn(q, k, values, g, beta, resets=resets, initial_state=start, output_final_state=True, **kw)
        q_eff, o = out.split([Dk, Dv], dim=-1)  # (2B, c, Hv, Dk): Q; (2B, c, Hv, Dv): the output from a zero state
        maps = self._gather(final.view(B, 2, Hv, Dk, Dk + Dv))  # (n, B, 2, Hv, Dk, Dk + Dv)
        first, second = self._mine()
        starts, state = {}, None
        for j in range(second):  # the chunks before the rank's later one, in sequence order
            if j == first:
                starts[j] = state
            rank, slot = self._where(j)
            a, b = maps[rank][:, slot].split([Dk, Dv], dim=-1)  # (B, Hv, Dk, Dk), (B, Hv, Dk, Dv)
            state = b if state is None else a @ state + b
        starts[second] = state
        c = T // 2
        o, q_eff = o.reshape(B, 2, c, Hv, Dv), q_eff.reshape(B, 2, c, Hv, Dk)
        outs = []
        for slot, j in enumerate((first, second)):
            s, oj = starts[j], o[:, slot]
            if s is not None:  # (chunk 0 starts from zero)
                oj = oj + torch.einsum("bthk,bhkv->bthv", q_eff[:, slot].to(s.dtype), s).to(o.dtype)
            outs.append(oj)
        return torch.stack(outs, dim=1).reshape(B, T, Hv, Dv)


class _RingAttention(torch.autograd.Function):
    """Softmax attention of a piece's queries over all pieces' keys and values, the blocks passed round the ring.

    Forward: each rank starts with its own (k, v) block and passes it on cp - 1 times (the next send posted before
    the current block is computed), so every block visits every rank; each step's rectangles run through the
    block backend and merge into a float32 (at least) output by their log-sum-exp. Backward: the blocks go round
    again, now with their key and value gradients travelling along: each rank adds its queries' share (the
    backend's backward with the merged output and log-sum-exp) and passes them on, and after cp passes every block
    is home with its whole gradient. Kernels see their own dtype: the autocast dtype under autocast."""

    @staticmethod
    def forward(ctx, q, k, v, cp, backend, docs):
        dtype = q.dtype
        if backend != "reference" and torch.is_autocast_enabled(q.device.type):
            dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (x.to(dtype) for x in (q, k, v))
        B, t, H, D = q.shape
        scale = D ** -0.5
        f32 = torch.promote_types(dtype, torch.float32)
        acc = torch.zeros(B, t, H, D, dtype=f32, device=q.device)
        lse = torch.full((B, H, t), float("-inf"), dtype=f32, device=q.device)
        out, lse0 = blocks.forward(backend, q, k, v, causal=True, scale=scale,
                                   docs=docs.local if docs is not None else None)
        _merge(acc, lse, out, lse0, slice(None), 0, t)
        del out, lse0  # (a step's kernel outputs, once merged, are not held into the next step's kernel)
        block = [k, v]
        steps = ring_steps(cp.n, cp.rank, _is_fake(q))
        pending = cp._start_rotate(block) if steps else None
        for n, (step, src) in enumerate(steps, 1):
            block = cp._finish(pending)
            pending = cp._start_rotate(block) if n < len(steps) else None
            for rows, q0, q1, k0, k1 in cp._segments(step, src, t, docs):
                o, l_ = blocks.forward(backend, q[rows, q0:q1], block[0][rows, k0:k1], block[1][rows, k0:k1],
                                       causal=False, scale=scale)
                _merge(acc, lse, o, l_, rows, q0, q1)
                del o, l_
        out = acc.to(dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.backend, ctx.docs, ctx.scale = cp, backend, docs, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, backend, docs, scale = ctx.cp, ctx.backend, ctx.docs, ctx.scale
        dout = dout.to(q.dtype)
        t = q.shape[1]
        f32 = lse.dtype
        dq, dk, dv = blocks.backward(backend, dout, q, k, v, out, lse, causal=True, scale=scale,
                                     docs=docs.local if docs is not None else None)
        dq = dq.to(f32)
        grads = [dk.to(f32), dv.to(f32)]
        del dk, dv  # (as in the forward: a step's kernel outputs are not held into the next step's kernel)
        block = [k, v]
        steps = ring_steps(cp.n, cp.rank, _is_fake(q))
        kv = cp._start_rotate(block) if steps else None
        for n, (step, src) in enumerate(steps, 1):
            grads = cp._finish(cp._start_rotate(grads, RING + 2))  # the block's gradients so far go on with it
            block = cp._finish(kv)
            kv = cp._start_rotate(block) if n < len(steps) else None  # the next block, while this one computes
            for rows, q0, q1, k0, k1 in cp._segments(step, src, t, docs):
                sq = (rows, slice(q0, q1))
                gq, gk, gv = blocks.backward(backend, dout[sq], q[sq], block[0][rows, k0:k1],
                                             block[1][rows, k0:k1], out[sq], lse[rows, :, q0:q1], causal=False,
                                             scale=scale)
                dq[sq] += gq
                grads[0][rows, k0:k1] += gk
                grads[1][rows, k0:k1] += gv
                del gq, gk, gv
        if cp.n > 1:
            grads = cp._finish(cp._start_rotate(grads, RING + 2))  # the last pass brings every block's home
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None


def _merge(acc, lse, out, blk, rows, q0: int, q1: int) -> None:
    """Merge a block's (out (b, q, H, D), lse (b, H, q)) into the running (acc, lse) at rows ``rows``, queries
    [q0, q1), by their log-sum-exp (the online softmax), in place: the merged output moves towards the block's by
    the block's share of the new total, exp(blk - new); rows that see nothing (-inf) stay zero. Few ops (a GPU
    launches each, the planner traces each at every ring step of every layer)."""
    a, old = acc[rows, q0:q1], lse[rows, :, q0:q1]  # views
    blk = blk.to(old.dtype)
    new = torch.logaddexp(old, blk)
    share = torch.exp(blk - new).nan_to_num_(0.0)  # -inf - -inf where neither has seen a key yet
    a.lerp_(out.to(a.dtype), share.transpose(1, 2).unsqueeze(-1))  # (b, q, H, 1)
    old.copy_(new)


def apply_context_parallel(model: nn.Module, mesh) -> nn.Module:
    """Give the LM and its sequence mixers the hooks above."""
    if mesh is None or mesh.cp == 1:
        return model
    hooks = ContextParallel(mesh.cp_group)
    for m in model.modules():
        if hasattr(m, "context_parallel"):
            m.context_parallel = hooks
    return model
