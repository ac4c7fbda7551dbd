"""Tensor parallelism for the layers torch's Linear styles do not cover: Gated DeltaNet and mixture of experts.

``train/parallel/parallelize.py`` shards attention and dense SwiGLU with torch's ``ColwiseParallel``/``RowwiseParallel``.
A Gated DeltaNet or an MoE layer is more than a chain of linears (a depthwise convolution, per-head gates, a
recurrence, routing), so each runs on its tp rank as a smaller copy of itself on plain local tensors, Megatron
style, with one all-gather of the sequence-parallel input before it and one reduce-scatter of its partial output
after it (the communication of a ColwiseParallel/RowwiseParallel pair):

- **Gated DeltaNet**: rank r holds key heads r*Hk/tp ... and their value heads (the grouping of GVA keeps a key
  head's value heads on its rank): its rows of the q, each k_j and each v_j projection and of the convolution
  channels, of z, b, a, A_log and dt_bias, and the matching columns of out_proj. The gated norm's gain (per head
  dim, shared by all heads) is replicated.
- **MoE**: every rank routes all tokens of the micro-batch (the router is replicated, so the choice is the same
  everywhere) and holds 1/tp of every expert's hidden units (gate and up rows, down columns) and of the shared
  expert. Its output is a partial sum over the hidden units, reduced with the sequence scatter.

Parameters stay DTensors over the tp mesh (sharded: whole-model shapes in checkpoints, the grad norm taken over
all ranks; replicated gains and routers get partial gradients, which DTensor sums). The fused projections hold
several segments in one weight (``in_proj_qkv`` = [q | k_1.. | v_1..], ``gate_up_proj`` = [gate | up]), and a
rank needs a slice of each segment: such a weight is stored in a **row order** where each rank's rows are
contiguous (rank 0's q, k, v rows, then rank 1's, ...), which a plain ``Shard`` then splits right. The model
records every reordered weight (``ROW_ORDERS``); checkpoints are written and read in the model's own order
(train/model_order.py), so they load at any other layout.

Gradient bookkeeping of the replicated routing: the MoE auxiliary losses are computed whole on every tp rank, but
the router's gradient is summed over the ranks (its main-loss part is partial there), so the auxiliary part of the
gradient is scaled by 1/tp (the logged value is unchanged).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

# ---- sequence all-gather / reduce-scatter ----------------------------------------------------------------------

def gather_sequence(x: torch.Tensor, mesh) -> torch.Tensor:
    """(B, T/tp, d) sequence shard (plain or DTensor Shard(1)) -> (B, T, d) plain. Backward: the ranks' partial
    input gradients are summed and scattered back along the sequence."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def scatter_sequence(y: torch.Tensor, mesh) -> torch.Tensor:
    """(B, T, d) partial sums (each rank's heads or hidden units) -> (B, T/tp, d) summed sequence shard, plain.
    Backward: the shard gradients are all-gathered."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


# ---- parameters ------------------------------------------------------------------------------------------------

def segment_row_order(widths: list[int], tp: int) -> torch.Tensor:
    """The live row order of a weight made of segments of ``widths`` rows: rank 0's share of every segment, then
    rank 1's, ... (entry i: the model row that live row i holds)."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return torch.cat([torch.arange(s + r * w // tp, s + (r + 1) * w // tp)
                      for r in range(tp) for s, w in zip(starts, widths, strict=True)])


def _shard(module: nn.Module, name: str, mesh, dim: int | None, order: torch.Tensor | None = None,
           orders: dict | None = None, fqn: str = "") -> None:
    """Replace ``module.<name>`` by a DTensor parameter over ``mesh``: Shard(dim) (after reordering ``dim`` by
    ``order``, recorded in ``orders[fqn]``) or, with dim None, Replicate."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    p = getattr(module, name)
    full = p.detach()
    if dim is None:
        local, placement = full.clone(), Replicate()
    else:
        if order is not None:
            full = full.index_select(dim, order.to(full.device))
            orders[fqn] = (dim, order)
        tp, rank = mesh.size(), mesh.get_local_rank()
        local, placement = full.chunk(tp, dim)[rank].clone(), Shard(dim)
    setattr(module, name, nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False),
                                       requires_grad=p.requires_grad))


def _locals(module: nn.Module, replicated: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every DTensor parameter of ``module`` as its local tensor; the ``replicated`` ones get partial gradients."""
    from torch.distributed.tensor import DTensor, Partial

    out = {}
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            out[name] = p.to_local(grad_placements=[Partial()]) if name in replicated else p.to_local()
    return out


@contextlib.contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Run ``module`` with some parameters replaced by plain tensors (restored on exit)."""
    saved = []
    for name, t in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        saved.append((owner, attr, owner._parameters[attr]))
        owner._parameters[attr] = t
    try:
        yield
    finally:
        for owner, attr, p in saved:
            owner._parameters[attr] = p


def _run_locally(module: nn.Module, mesh, run, replicated: tuple[str, ...]) -> None:
    """Make ``module``'s forward ``run(module, x, ...)`` on the whole sequence with its local parameters, between
    the sequence all-gather of its input and the reduce-scatter of its partial output."""

    def forward(self, x, *args, **kwargs):
        x = gather_sequence(x, mesh)
        with _swapped(self, _locals(self, replicated)):
            y = run(self, x, *args, **kwargs)
        return scatter_sequence(y, mesh)

    module.forward = types.MethodType(forward, module)


# ---- Gated DeltaNet ------------------------------------------------------------------------------------------

def parallelize_gated_deltanet(gdn: nn.Module, mesh, orders: dict, prefix: str) -> None:
    """Shard one GatedDeltaNet over the tp ``mesh`` by heads (module docstring); its forward then takes and
    returns sequence shards."""
    tp = mesh.size()
    n_h, kd, vd, hv = gdn.n_h, gdn.key_dim, gdn.value_dim, gdn.n_v_heads
    qkv = segment_row_order([kd] * (1 + n_h) + [vd] * n_h, tp)
    _shard(gdn.in_proj_qkv, "weight", mesh, 0, qkv, orders, prefix + "in_proj_qkv.weight")
    _shard(gdn.conv1d, "weight", mesh, 0, qkv, orders, prefix + "conv1d.weight")  # depthwise: one filter per row
    b = segment_row_order([hv] * n_h, tp) if n_h > 1 else None  # (n_h, Hv) rows, sub-step major
    _shard(gdn.in_proj_b, "weight", mesh, 0, b, orders, prefix + "in_proj_b.weight")
    for module, name in ((gdn.in_proj_z, "weight"), (gdn.in_proj_a, "weight"), (gdn, "A_log"), (gdn, "dt_bias")):
        _shard(module, name, mesh, 0)
    _shard(gdn.out_proj, "weight", mesh, 1)
    _shard(gdn.norm, "weight", mesh, None)
    # The forward reads its sizes from these: each rank is a GatedDeltaNet of 1/tp of the heads.
    gdn.n_k_heads, gdn.n_v_heads = gdn.n_k_heads // tp, hv // tp
    gdn.key_dim, gdn.value_dim, gdn.conv_dim = kd // tp, vd // tp, gdn.conv_dim // tp
    forward = type(gdn).forward

    def run(self, x, doc_ids=None, cache=None):
        if cache is not None:
            raise RuntimeError("decoding with a cache runs on one process; tensor parallelism trains only")
        return forward(self, x, doc_ids)

    _run_locally(gdn, mesh, run, replicated=("norm.weight",))


# ---- mixture of experts ----------------------------------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def parallelize_moe(moe: nn.Module, mesh, orders: dict, prefix: str) -> None:
    """Shard one MoE layer's experts (and shared expert) over the tp ``mesh`` by hidden units (module docstring)."""
    tp = mesh.size()
    experts = moe.experts
    gate_up = segment_row_order([experts.hidden, experts.hidden], tp)  # [gate | up] rows of every expert
    _shard(experts, "gate_up_proj", mesh, 1, gate_up, orders, prefix + "experts.gate_up_proj")
    _shard(experts, "down_proj", mesh, 2)
    replicated = ["gate.weight"]
    _shard(moe.gate, "weight", mesh, None)
    if moe.shared_expert is not None:
        se = moe.shared_expert
        _shard(se.gate_proj, "weight", mesh, 0)
        _shard(se.up_proj, "weight", mesh, 0)
        _shard(se.down_proj, "weight", mesh, 1)
        _shard(moe.shared_expert_gate, "weight", mesh, None)
        replicated.append("shared_expert_gate.weight")
    experts.hidden //= tp
    forward = type(moe).forward

    def run(self, x):
        y = forward(self, x)
        if self.aux_loss is not None:  # whole on every rank, its router gradient summed over them: count it once
            self.aux_loss = _ScaleGrad.apply(self.aux_loss, 1.0 / tp)
        return y

    _run_locally(moe, mesh, run, replicated=tuple(replicated))


# ---- the loss over a vocabulary-split head -----------------------------------------------------------------

def vocab_parallel_loss(mesh):
    """``GatedLM.vocab_parallel_loss`` over the tp ``mesh``: the fused linear + cross-entropy of
    kernels/cross_entropy on each rank's rows of the head (ColwiseParallel lm_head or RowwiseParallel tied
    embedding: Shard(0) over the vocabulary), with the ranks' softmax statistics combined, z-loss included. The
    (B, T, V) logits exist nowhere, not even split: they are made and consumed in chunks."""
    import torch.distributed as dist

    from hybridtron.kernels.cross_entropy import vocab_parallel_linear_cross_entropy

    group = mesh.get_group()

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return t

    def loss(h, head, labels, z_loss, backend):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, mesh, [Shard(1)], run_check=False)
        # the whole sequence on every rank; the loss's backward gives every rank the whole dh already (summed
        # over the vocabulary shards), so the gather's backward only takes this rank's part of it
        h = h.redistribute(mesh, [Replicate()]).to_local()
        shard = head.to_local()
        return vocab_parallel_linear_cross_entropy(h.flatten(0, 1), shard, labels.flatten(),
                                                   vocab_start=mesh.get_local_rank() * shard.shape[0],
                                                   all_reduce=all_reduce, z_loss=z_loss, backend=backend)

    return loss


