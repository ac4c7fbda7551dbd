"""Apply execution strategies to a single-device model from the outside.

The model under ``model/`` knows nothing of devices, precision or recomputation. This module
applies them in the fixed order later parallelisms slot into: TP/SP -> activation checkpointing ->
compile -> data parallel. Today: device/precision selection, activation checkpointing and data parallel:

- ``parallel.zero_stage: 0`` -- the model is replicated (torch's composable ``replicate``, DDP underneath:
  gradients all-reduced in buckets during backward). Parameter names and the module class stay as they are.
- ``2`` / ``3`` -- FSDP2 (``fully_shard``) per layer and on the root: parameters, gradients and optimizer
  state are sharded over ``dp``; with 3 the parameters are freed after each layer's forward and gathered
  again for backward, with 2 they stay gathered from forward to backward (more memory, less traffic).
  With bf16 training on a GPU the gathered parameters are bf16 and gradients are reduced in fp32.

Data parallelism is applied to a model whose weights are already initialised (identically on every rank),
so a run starts from the same weights at every layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hybridtron.configs import TrainConfig


def select_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={cfg.device!r} but no CUDA device is visible; use train.device=cpu or auto")
    return dev


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU (weights and optimizer stay fp32); plain fp32 on CPU unless asked."""
    if cfg.dtype == "fp32" or (cfg.dtype == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward: memory O(layers) -> O(1) blocks, ~1/3 more compute."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def parallelize(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """What is applied before the weights exist (on the meta device): activation checkpointing."""
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


def apply_data_parallel(model: nn.Module, mesh, amp_dtype: torch.dtype | None, mixed_precision: str = "auto",
                        params_may_leave: bool = False):
    """Replicate (ZeRO 0) or shard (ZeRO 2/3) an initialised model over ``mesh``'s ``dp`` dimension, in place.
    ``params_may_leave``: parameters leave the model during the run (self-guided FFN guides), so replication
    must not wait for their gradients (DDP's unused-parameter detection, one graph walk per step)."""
    if mesh is None or mesh.dp == 1:
        return model
    dp_mesh = mesh.device_mesh["dp"]
    if mesh.zero_stage == 0:
        from torch.distributed._composable.replicate import replicate

        # Gradients live in DDP's communication buckets (views), not beside them: one copy of the gradients.
        replicate(model, device_mesh=dp_mesh, find_unused_parameters=params_may_leave, gradient_as_bucket_view=True)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if amp_dtype is not None and mixed_precision == "auto":
        mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    reshard = mesh.zero_stage == 3
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root holds the embeddings, final norm and head; it is gathered last in forward and used first in
    # backward, so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model
