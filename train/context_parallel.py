"""Context parallelism: the ``cp`` ranks of one data-parallel group split every sequence into cp contiguous
pieces of seq_len / cp positions, and each runs the whole model on its piece.

Only the sequence mixers need the other pieces:

- **Attention**: keys and values are all-gathered along the sequence (a differentiable all-gather: the
  backward reduce-scatters their gradients), and each rank's queries attend over the whole sequence with the
  causal (and document) mask shifted to the piece's position. Rotary positions are the global ones.
- **Gated DeltaNet**: the short convolution reads the last conv_size - 1 inputs of the previous piece (sent
  point to point; the gradient goes back the same way). The delta rule's state is affine in the state a piece
  starts from, so every rank runs its piece at once and learns that map (one run, ``delta_rule``); the maps
  are all-gathered, and each rank composes the state its piece starts from and corrects its outputs. A
  document boundary between two pieces resets the state as it would on one device.

The loss of each rank is the mean over its own positions, so gradients are averaged over dp x cp ranks (the
data-parallel wrapper runs over both) and the logged loss is the mean over them, which is the one-device loss
when every position carries a label.
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


HALO = 2  # message tag of the convolution halo


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
    def attention_inputs(self, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None):
        """(B, t, KV, D) local keys and values -> the whole sequence's (a differentiable all-gather), and the
        (B, 1, t, T) bool mask of this piece's queries over all keys (causal at global positions, within
        documents)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        t = k.shape[1]
        k, v = (all_gather_tensor_autograd(x.transpose(0, 1).contiguous(), gather_dim=0, group=self.group)
                .transpose(0, 1) for x in (k, v))
        T = k.shape[1]
        start = self.offset(t)
        q_pos = torch.arange(start, start + t, device=k.device)
        mask = (torch.arange(T, device=k.device)[None, :] <= q_pos[:, None])[None, None]  # (1, 1, t, T)
        if doc_ids is not None:
            mask = mask & (doc_ids[:, None, :, None] == self.whole_ids[:, None, None, :])
        return k, v, mask

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
            halo_ids = (self.whole_ids[:, self.rank * t - width:self.rank * t] if self.rank
                        else torch.full_like(doc_ids[:, :width], -1))
        return halo, halo_ids, zero

    def first_is_doc_start(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """(B,) True where this piece's first token starts a document the previous piece did not end in."""
        if self.rank == 0:
            return torch.zeros(doc_ids.shape[0], dtype=torch.bool, device=doc_ids.device)
        return doc_ids[:, 0] != self.whole_ids[:, self.rank * doc_ids.shape[1] - 1]

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


def apply_context_parallel(model: nn.Module, mesh) -> nn.Module:
    """Give the LM and its sequence mixers the hooks above."""
    if mesh is None or mesh.cp == 1:
        return model
    hooks = ContextParallel(mesh.cp_group)
    for m in model.modules():
        if hasattr(m, "context_parallel"):
            m.context_parallel = hooks
    return model
