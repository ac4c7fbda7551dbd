"""The model's own parameter names and row order: what checkpoints, exports and the gradient dump speak, whatever
wrappers (activation checkpointing, torch.compile) and tensor-parallel row orders the live model carries.

Tensor parallelism stores a fused weight (``in_proj_qkv`` = [q | k_1.. | v_1..], ``gate_up_proj`` = [gate | up]) in a
row order where each rank's rows are contiguous (train/parallel/tensor_parallel.py) and records it on the root model
(``ROW_ORDERS``); everything that reads or writes parameters by name goes through this module, so a checkpoint holds
the model's order and loads at any other layout.
"""

from __future__ import annotations

import torch
from torch import nn

ROW_ORDERS = "_tp_row_orders"  # attribute of the root model: {parameter name: (dim, live-to-model index)}


def canonical_name(name: str) -> str:
    """A live parameter name without the wrappers' prefixes (activation checkpointing's, torch.compile's): the model's
    own name, as checkpoints, exports and the gradient dump write it."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def row_orders(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return getattr(model, ROW_ORDERS, None) or {}


def to_row_order(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor in the model's order -> the live order of parameter ``name`` (unchanged if not reordered)."""
    entry = row_orders(model).get(canonical_name(name))
    if entry is None or tensor.dim() == 0:
        return tensor
    dim, order = entry
    return tensor.index_select(dim, order.to(tensor.device))


def from_row_order(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_row_order``: a whole tensor in parameter ``name``'s live order -> the model's order."""
    entry = row_orders(model).get(canonical_name(name))
    if entry is None or tensor.dim() == 0:
        return tensor
    dim, order = entry
    return torch.empty_like(tensor).index_copy_(dim, order.to(tensor.device), tensor)  # live row i is model row order[i]


class _ModelOrderChunks(torch.Tensor):
    """A DTensor's local shard of a reordered parameter, presented to torch.distributed.checkpoint as the chunks
    of the whole tensor in the model's order that it holds (runs of consecutive model rows). The chunks are views
    of the local shard, so a load writes straight into the parameter or optimizer state."""

    @staticmethod
    def __new__(cls, dtensor, dim: int, order: torch.Tensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = dtensor.to_local()
        out = torch.Tensor._make_wrapper_subclass(cls, dtensor.shape, dtype=local.dtype, device=local.device)
        sizes, offsets = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh,
                                                               dtensor.placements)
        rows = order[offsets[dim]:offsets[dim] + sizes[dim]].tolist()  # model row of each local row along dim
        out._chunks = []
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                off = list(offsets)
                off[dim] = rows[start]
                out._chunks.append((torch.Size(off), local.narrow(dim, start, i - start)))
                start = i
        out._local = local
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on a checkpoint view of a tensor-parallel parameter")

    # torch.distributed.checkpoint's protocol (as DTensor implements it)
    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=view.shape),
                                                      properties=TensorProperties.create_from_tensor(self._local),
                                                      size=self.shape))
                for off, view in self._chunks]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=off, sizes=view.shape) for off, view in self._chunks]

    def __get_tensor_shard__(self, index):
        for off, view in self._chunks:
            if index.offset is None or off == torch.Size(index.offset):
                return view
        raise ValueError(f"no chunk at offset {index.offset} of {index.fqn}")


def canonical_state_dicts(model: nn.Module, msd: dict, osd: dict | None) -> tuple[dict, dict | None]:
    """Copies of the model and optimizer state dicts (of ``get_state_dict``) in which every reordered parameter
    and its optimizer state appear in the model's order, for ``dcp.save`` / ``dcp.load`` (the load writes into
    the tensors of the originals, which then go to ``set_state_dict``)."""
    orders = {canonical_name(k): v for k, v in row_orders(model).items()}
    if not orders:
        return msd, osd

    def wrap(name, t):
        entry = orders.get(canonical_name(name))
        if entry is None or not hasattr(t, "to_local") or t.dim() == 0:
            return t
        return _ModelOrderChunks(t, *entry)

    msd = {k: wrap(k, v) for k, v in msd.items()}
    if osd is not None and "state" in osd:  # torch's nested form: {"state": {fqn: {name: tensor}}, "param_groups"}
        state = {k: ({n: wrap(k, t) for n, t in v.items()} if isinstance(v, dict) else v)
                 for k, v in osd.get("state", {}).items()}
        osd = {**osd, "state": state}
    elif osd is not None:  # flattened (``flatten_optimizer_state_dict``): "state.<fqn>.<name>" -> tensor
        osd = {k: wrap(k[len("state."):].rpartition(".")[0], v) if k.startswith("state.") else v
               for k, v in osd.items()}
    return msd, osd
