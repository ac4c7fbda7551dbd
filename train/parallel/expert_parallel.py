"""Expert parallelism: each of ``ep`` ranks holds n_experts / ep of every MoE layer's experts.

The ``ep`` ranks are carved out of the data- and context-parallel ranks (``dp x cp = dp_replicate x ep``, ep
innermost, next to the tp ranks; a context-parallel rank's tokens are a piece of a sequence, routed like any): every rank still routes its own tokens over all experts with the replicated router, then an
all-to-all sends each (token, expert) assignment to the rank that holds the expert, the experts run as a
grouped matmul over what arrived, and a second all-to-all brings the outputs back, where the token's k
outputs are combined as on one device. Both all-to-alls are differentiable, so the backward sends the
gradients the same way back.

Expert weights become DTensors sharded by expert over the ``ep`` mesh dimension (the checkpoint stores the
whole (E, ...) tensors, so it loads at any other layout); every other parameter stays data parallel over all
of ``dp`` (DDP or FSDP2, which leave the experts alone). The expert gradients of the ``dp_replicate`` copies
are summed after the backward and scaled like data-parallel gradients (``sync_expert_grads``).

With tensor parallel as well, every tp rank routes the same tokens (train/parallel/tensor_parallel.py), the all-to-all
runs among the ranks of one tp coordinate, and each holds its experts' share of hidden units: the experts are
DTensors over the (ep, tp) mesh, and their outputs partial sums that the tensor-parallel reduce-scatter adds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class AllToAllDispatch:
    """The ``expert_dispatch`` of one MoE layer under expert parallelism (see ``MoE.forward``)."""

    def __init__(self, ep_mesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(self, moe: nn.Module, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, local_experts = self.ep, moe.n_experts // self.ep
        send = counts.view(ep, local_experts)  # rows for rank r's experts, in their order
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)  # recv[src, e]: rows from src for expert e
        # the layer's one device-to-host copy: the row all-to-all takes its split sizes on the host
        sizes = torch.cat([send.sum(1), recv.sum(1)]).tolist()
        to_send, to_recv = sizes[:ep], sizes[ep:]
        xr = all_to_all_single_autograd(xs, to_recv, to_send, self.group)  # by source rank, then local expert
        # regroup by local expert (stable: within an expert, the sources in rank order); output_size: no sync
        expert_of_row = torch.arange(local_experts, device=xs.device).repeat(ep).repeat_interleave(
            recv.flatten(), output_size=sum(to_recv))
        order = torch.argsort(expert_of_row, stable=True)
        ys = moe.run_experts(xr[order], recv.sum(0), _local(moe.experts.gate_up_proj), _local(moe.experts.down_proj))
        yr = torch.empty_like(ys).index_copy(0, order, ys)
        return all_to_all_single_autograd(yr, to_send, to_recv, self.group)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "expert_dispatch")]


def apply_expert_parallel(model: nn.Module, mesh) -> nn.Module:
    """Keep this rank's share of every MoE layer's experts (as DTensors over ``ep``) and route through all-to-all."""
    if mesh is None or mesh.ep == 1:
        return model
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh.expert_mesh["ep"]
    rank = ep_mesh.get_local_rank()
    for moe in expert_modules(model):
        experts = moe.experts
        n = moe.n_experts // mesh.ep
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, name)
            if isinstance(whole, DTensor):  # tensor parallel split every expert's hidden units already: keep that
                # split as the second dimension of a (ep, tp) mesh (train/parallel/tensor_parallel.py)
                mine = whole.to_local().detach()[rank * n:(rank + 1) * n].clone()
                on, placements = mesh.expert_mesh["ep", "tp"], [Shard(0), *whole.placements]
            else:
                mine = whole.detach()[rank * n:(rank + 1) * n].clone()
                on, placements = ep_mesh, [Shard(0)]
            setattr(experts, name, nn.Parameter(DTensor.from_local(mine, on, placements, run_check=False)))
        moe.expert_dispatch = AllToAllDispatch(ep_mesh)
    return model


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters expert parallelism shards (data parallelism must leave them alone), in module order: the
    same order on every rank, as the collectives over them need."""
    return [p for moe in expert_modules(model) if moe.expert_dispatch is not None for p in moe.experts.parameters()]


def sync_expert_grads(model: nn.Module, mesh) -> None:
    """After the backward: each expert's gradient summed over the ranks holding a copy of it (dp_replicate) and
    scaled by 1/(dp x cp), as data parallelism averages every other gradient over the dp (x cp) ranks."""
    if mesh is None or mesh.ep == 1:
        return
    group = mesh.expert_mesh["dp_replicate"].get_group() if mesh.data_ranks > mesh.ep else None
    for p in expert_params(model):
        if p.grad is None:
            continue
        grad = _local(p.grad)
        if group is not None:
            dist.all_reduce(grad, group=group)
        grad.div_(mesh.data_ranks)
