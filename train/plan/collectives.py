"""``CollectiveBytes``: the bytes every collective of a real step sent (DDP, FSDP2, DTensor, pipelining and our own
calls alike), as ring algorithms move them, for ``hybridtron plan --measure``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


# ---- what the collectives moved ----------------------------------------------------------------------------------
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends in every collective of a real step, as the ring algorithms the volumes of
    ``comm_bytes`` assume move them (n ranks, f = (n - 1) / n, S the bytes of this rank's tensor): all-reduce
    2 f S; all-gather (n - 1) S of the input; reduce-scatter f S of the input; all-to-all what goes to the other
    ranks; a send S. It sees every collective, whoever issues it: ``torch.distributed``'s calls (DDP, FSDP2,
    pipelining, ours), DTensor's functional collectives (tensor parallel), as the ``c10d`` / ``_c10d_functional``
    ops they dispatch. Ops of the setup (broadcast, barrier) are counted under their names too."""

    _ALL_REDUCE = {"allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                   "all_reduce_coalesced_"}
    _GATHER = {"_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
               "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"}
    _SCATTER = {"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor",
                "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out"}

    def __init__(self):
        super().__init__()
        self.sent: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[1]
        a = {arg.name: v for arg, v in zip(func._schema.arguments, args, strict=False)} | kwargs
        pg = a.get("process_group")
        if pg is None and "group_name" in a:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(a["group_name"])
        if pg is None:
            return
        if isinstance(pg, torch.ScriptObject):  # how the c10d ops receive their group
            pg = dist.ProcessGroup.unbox(pg)
        n = pg.size()
        inputs = next((a[k] for k in ("input_tensor", "input_tensors", "inputs", "input", "input_list", "tensors",
                                      "tensor") if k in a), None)
        size = _nbytes(inputs)
        if name in self._ALL_REDUCE:
            sent = 2 * (n - 1) / n * size
        elif name in self._GATHER:
            sent = (n - 1) * size
        elif name in self._SCATTER:
            sent = (n - 1) / n * size
        elif name in ("alltoall_base_", "all_to_all_single"):
            splits, rows = a.get("input_split_sizes") or [], inputs.shape[0] if inputs.dim() else 1
            own = splits[pg.rank()] if splits else rows / n
            sent = size * (1 - own / max(rows, 1))
        elif name == "alltoall_":
            sent = size - _nbytes(inputs[pg.rank()])
        elif name in ("send", "isend"):
            sent = size
        elif name == "batch_p2p_ops":
            sent = sum(_nbytes(t) for op, t in zip(a["op_list"], a["tensors"], strict=True) if "send" in op)
        else:
            return  # receives, barriers; broadcasts happen at setup, not in a step
        self.sent[name] = self.sent.get(name, 0.0) + sent
