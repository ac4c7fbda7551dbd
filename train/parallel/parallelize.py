"""Apply execution strategies to a single-device model from the outside.

The model under ``model/`` knows nothing of devices, precision or recomputation. ``parallelize`` (at the end of
this file) applies them in one fixed order: pipeline stages, tensor (sequence) parallel, expert parallel, context
parallel, activation checkpointing, compile, data parallel, so that at run time they nest with TP/SP innermost and
data parallel outermost. Data parallel:

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

import dataclasses

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hybridtron.configs import JobConfig, TrainConfig

# Selective activation checkpointing keeps the outputs of the ops that are expensive to recompute and
# recomputes the rest of a block (norms, rotary, activations, gates, residual adds: memory-bound ops whose
# outputs are as large as a matmul's but cost ~1/100 of its time). torchtitan's op-level policy is the model.
_SAVED_ATEN = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::linear", "aten::_scaled_mm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
    # sequence/tensor-parallel collectives: recomputing them would repeat the communication
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_reduce", "_c10d_functional::all_to_all_single",
}


def _op_name(func) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def _saved_by_selective(func) -> bool:
    """Our fused attention and delta-rule forwards are the expensive ops of a mixer: keep their outputs."""
    name = _op_name(func)
    if name in _SAVED_ATEN:
        return True
    ns, _, op = name.partition("::")
    return ns == "hybridtron" and op.endswith("_fwd") and ("attention" in op or "delta_rule" in op)


def _selective_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if _saved_by_selective(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context():
    """The ``context_fn`` of torch.utils.checkpoint for train.activation_checkpointing=selective."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def checkpointing_mode(cfg: TrainConfig) -> str:
    """none | full | selective (configs written before the modes existed say true/false)."""
    mode = cfg.activation_checkpointing
    if isinstance(mode, bool):
        return "full" if mode else "none"
    return mode


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", every: int = 1) -> None:
    """Recompute activations in backward. full: each block (every ``every``-th block) keeps only its input,
    memory O(layers) -> O(1) blocks for ~1/3 more compute; selective: each block keeps its matmul, attention
    and delta-rule outputs and recomputes the elementwise ops between them (most of full's saving of the
    cheap activations, a few percent of its recompute)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use none, full or selective")
    for i, block in enumerate(model.layers):
        if block is None:  # a layer another pipeline rank holds
            continue
        if mode == "selective":
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False,
                                                 context_fn=selective_checkpoint_context)
        elif i % every == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, **compile_kwargs) -> None:
    """torch.compile each block in place (``nn.Module.compile``: names, state dict and checkpoints unchanged;
    tensor/sequence parallel plans and FSDP2 apply to the same modules afterwards). One block's graph is
    compiled once and reused by its siblings where shapes agree. The fused kernels are custom ops with fake
    implementations, so they cause no graph breaks; fullgraph stays off so a layer that does break (MoE's
    data-dependent routing) still runs. compile_kwargs go to torch.compile (tests: a cheaper backend)."""
    for block in model.layers:
        if block is not None:  # (None: a layer another pipeline rank holds)
            block.compile(**compile_kwargs)


def apply_tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    """Megatron-style tensor parallelism with sequence parallelism over ``mesh``'s ``tp`` dimension, in place.

    Between layers the residual stream is split along the sequence (each tp rank holds T/tp positions), and
    so are the RMSNorms that read it. A layer's input is all-gathered along the sequence; q/k/v and gate/up
    are split by output columns (whole heads, whole kv groups: the fused [query | gate] rows of a head stay
    together), o_proj and down_proj by input rows, and their outputs are reduce-scattered back along the
    sequence. QK-norm gains are replicated and applied to each rank's heads. The embedding and the output layer
    are split by vocabulary rows, and the loss is the fused linear + cross-entropy over the shards
    (``vocab_parallel_loss``): the logits never exist, whole or split.
    Gated DeltaNet layers are split by heads and MoE layers by every expert's hidden units, each as a smaller copy
    of itself between the same all-gather and reduce-scatter (``train/parallel/tensor_parallel.py``).
    Parameters become DTensors; torch's DTensor sends every collective.
    """
    if mesh is None or mesh.tp == 1:
        return model
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from hybridtron.train.model_order import ROW_ORDERS
    from hybridtron.train.parallel.fp8 import tensor_parallel_plan as fp8_styles
    from hybridtron.train.parallel.tensor_parallel import (
        parallelize_gated_deltanet,
        parallelize_moe,
        vocab_parallel_loss,
    )

    tp_mesh = mesh.device_mesh["tp"]
    root = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # tied: no lm_head, the logits come from the embedding's own vocabulary shards
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    # A pipeline stage holds some of these only (``train/parallel/pipeline.py``); absent parts are None.
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items() if getattr(model, k) is not None})
    if model.embed_tokens is not None:
        # The embedding's reduce-scatter is asynchronous: its output is an AsyncCollectiveTensor, waited on by the
        # first op that reads it. A compiled block given one as input traces a backward whose gradient reaches the
        # scatter's backward as a plain tensor, not the DTensor it expects (torch 2.13, any backend: pytorch/pytorch
        # #184980, fixed upstream by #179522); a copy made here, outside the compiled blocks, waits and hands the
        # blocks a plain tensor.
        model.embed_tokens.register_forward_hook(_settle_async)
    model.vocab_parallel_loss = vocab_parallel_loss(tp_mesh)
    orders = getattr(model, ROW_ORDERS, None) or {}
    for i, block in enumerate(model.layers):
        if block is None:
            continue
        block = getattr(block, "_checkpoint_wrapped_module", block)  # activation checkpointing wraps blocks
        plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
        block.fused_residual = False  # the norm's input is a sequence shard the plan rewrites: add, then norm
        if block.mixer_type == "A":
            attn = block.self_attn
            plan.update({
                # the layer's inputs: the normed hidden states, gathered along the sequence; cos, sin, mask as they are
                "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                desired_input_layouts=(Replicate(), None, None, None)),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            })
            if getattr(attn, "gate_proj", None) is not None:  # headwise gate: one output per head
                plan["self_attn.gate_proj"] = ColwiseParallel()
            if attn.q_norm is not None:  # over head_dim of (B, T, heads, D): the heads are the split dimension
                attn.fused_qk_norm = False  # hooked norms run as modules; the rotary kernel only rotates
                plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
                plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        else:  # Gated DeltaNet: a head-sharded copy on local tensors (train/parallel/tensor_parallel.py)
            parallelize_gated_deltanet(block.linear_attn, tp_mesh, orders, f"layers.{i}.linear_attn.")
        if hasattr(block.mlp, "experts"):  # mixture of experts: hidden units of every expert sharded
            parallelize_moe(block.mlp, tp_mesh, orders, f"layers.{i}.mlp.")
        else:
            plan.update({
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            })
        parallelize_module(block, tp_mesh, fp8_styles(block, plan))
    setattr(model, ROW_ORDERS, orders)  # reordered fused weights: checkpoints put them back in the model's order
    return model


def _settle_async(_module, _inputs, out):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return out.clone() if isinstance(out, AsyncCollectiveTensor) else out


def apply_data_parallel(model: nn.Module, mesh, amp_dtype: torch.dtype | None, mixed_precision: str = "auto",
                        params_may_leave: bool = False, roots: list[nn.Module] | None = None, offload: bool = False):
    """Replicate (ZeRO 0) or shard (ZeRO 2/3) an initialised model over ``mesh``'s ``dp`` dimension, in place;
    with ``mesh.hsdp_mesh`` (parallel.dp_shard < dp) shard within its ``dp_shard`` groups and replicate over them.
    ``params_may_leave``: parameters leave the model during the run (self-guided FFN guides), so replication
    must not wait for their gradients (DDP's unused-parameter detection, one graph walk per step).
    ``roots``: the modules that run forward (pipeline stages over ``model``'s blocks); default the model.
    ``offload`` (parallel.offload=cpu, ZeRO 2/3): FSDP2 keeps the parameter, gradient and optimizer-state shards in
    host memory (pinned when the device is a GPU); each layer's shards are copied to the device for its all-gather
    and its gradient shards back after the reduce-scatter, and the optimizer steps on the CPU."""
    if mesh is None or mesh.data_ranks == 1:
        return model
    from hybridtron.train.parallel.expert_parallel import expert_modules, expert_params

    experts = expert_params(model)  # expert parallel: sharded over ep, their gradients summed apart
    dp_mesh = mesh.device_mesh["dp"]
    if mesh.zero_stage == 0:
        from torch.distributed._composable.replicate import replicate

        # Gradients live in DDP's communication buckets (views), not beside them: one copy of the gradients.
        replicate(model, device_mesh=dp_mesh, find_unused_parameters=params_may_leave, gradient_as_bucket_view=True,
                  ignored_modules=[m.experts for m in expert_modules(model)] if experts else None)
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = OffloadPolicy()  # the default: none
    if offload:
        on_gpu = any(p.device.type == "cuda" for p in model.parameters())
        policy = CPUOffloadPolicy(pin_memory=on_gpu)  # pinned pages need a GPU driver
    mp = MixedPrecisionPolicy()
    if amp_dtype is not None and mixed_precision == "auto":
        mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    reshard = mesh.zero_stage == 3
    ignored = set(experts) or None
    if mesh.hsdp_mesh is not None:
        # A 2-D mesh is FSDP2's HSDP: parameters Shard(0) over dp_shard, Replicate over dp_replicate; gradients are
        # reduce-scattered in the shard group, then the shards all-reduced across the groups (averaged over all dp).
        dp_mesh = mesh.hsdp_mesh
    for block in model.layers:
        if block is not None:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored,
                        offload_policy=policy)
    # The root holds the embeddings, final norm and head; it is gathered last in forward and used first in
    # backward, so it is never resharded after forward.
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored,
                    offload_policy=policy)
    return model


def data_parallel_summary(model: nn.Module) -> str | None:
    """What FSDP2 actually applied to the first sharded block (None when there is none), read from its state
    rather than the config: sharding, and the dtypes parameters are gathered and gradients reduced in."""
    from torch.distributed.fsdp import FSDPModule

    for block in getattr(model, "layers", []):
        if isinstance(block, FSDPModule):
            group = block._get_fsdp_state()._fsdp_param_groups[0]
            mp = group.mp_policy
            name = lambda dt: "as stored" if dt is None else str(dt).removeprefix("torch.")  # noqa: E731
            reshard = "freed after forward (ZeRO-3)" if group.post_forward_mesh_info is not None else \
                "kept from forward to backward (ZeRO-2)"
            hsdp = " over dp_shard groups, replicated across them (HSDP)" if group.mesh_info.mesh.ndim == 2 else ""
            host = ", shards kept on the CPU (offload)" if group.fsdp_params[0].offload_to_cpu else ""
            return (f"FSDP2 blocks: parameters {reshard}{hsdp}, gathered {name(mp.param_dtype)}, gradients reduced "
                    f"{name(mp.reduce_dtype)}{host}")
    return None


@dataclasses.dataclass
class Parallelized:
    """What ``parallelize`` applied, as the engine that runs the model needs to know it (train/engine.py), told by
    the code that applied it rather than guessed from the modules afterwards."""

    pipeline: object | None = None  # the rank's stages and their schedule (parallel.pp > 1)
    replicated: bool = False  # DDP: gradients all-reduced once per step, after its last micro-batch
    sharded: bool = False  # FSDP2: it casts the weights it gathers itself (MixedPrecisionPolicy)
    hsdp_modules: list[nn.Module] = dataclasses.field(default_factory=list)  # HSDP: all-reduce after the last

    @property
    def roots(self) -> list[nn.Module]:
        """The modules a step calls forward on: the pipeline's stages, or the model (None: the model)."""
        return self.pipeline.stages if self.pipeline is not None else None


def parallelize(model: nn.Module, cfg: JobConfig, mesh, device: torch.device | None = None,
                amp_dtype: torch.dtype | None = None, log=None, data_parallel: bool = True) -> Parallelized:
    """Apply the run's parallel layout and execution strategies to ``model`` (built and initialised, a pipeline rank's
    model already cut to its stages by ``pipeline.rank_cut``), in place and in this one order:

    1. pipeline: the rank's stage modules over the cut model (parallel.pp > 1)
    1b. fp8: the blocks' linears become torchao's Float8Linear (train.fp8; train/parallel/fp8.py)
    2. tensor (with sequence) parallel: DTensor plans over the tp dimension (parallel.tp)
    3. expert parallel: each rank keeps its experts (parallel.ep)
    4. context parallel: each rank runs its piece of every sequence (parallel.cp)
    5. activation checkpointing of the blocks (train.activation_checkpointing)
    6. torch.compile of each block (train.compile)
    7. data parallel: DDP or FSDP2 over the data ranks, outermost (parallel.zero_stage, dp_shard, offload;
       ``apply_run_data_parallel``)

    Returns what it applied (``Parallelized``). With parallel.engine=deepspeed, step 7 is DeepSpeed's (train/
    parallel/deepspeed_engine.py). ``data_parallel=False`` stops before step 7 and leaves the pipeline's schedules
    unbuilt: the planner counts the rank's parameters there, then calls ``apply_run_data_parallel`` itself.
    A one-process mesh (``Mesh()``) applies steps 5 and 6 only."""
    log = log or (lambda _msg: None)
    t = cfg.train
    pipeline = None
    if mesh.pp > 1:
        from hybridtron.train.parallel.pipeline import Pipeline

        pipeline = Pipeline(cfg, model, mesh, device, model.vocab_size)
        log(f"pipeline: {len(pipeline.ranges)} stages of layers "
            f"{', '.join(f'{r.start}-{r.stop - 1}' for r in pipeline.ranges)}, schedule {cfg.parallel.pp_schedule}, "
            f"{t.grad_accum_steps} micro-batches per step")
    if t.fp8 != "none":  # before tensor parallel, whose plans hook the very modules this swaps
        from hybridtron.train.parallel.fp8 import apply_fp8

        apply_fp8(model, cfg, mesh, log)
    apply_tensor_parallel(model, mesh)
    from hybridtron.train.parallel.context_parallel import apply_context_parallel
    from hybridtron.train.parallel.expert_parallel import apply_expert_parallel

    apply_expert_parallel(model, mesh)
    apply_context_parallel(model, mesh)
    apply_activation_checkpointing(model, checkpointing_mode(t), t.activation_checkpointing_every)
    if t.compile:
        apply_compile(model)
    if pipeline is not None:  # the stages run the (now wrapped) blocks of the model they were cut from
        pipeline.relink_layers()
    applied = Parallelized(pipeline)
    if not data_parallel or cfg.parallel.engine != "torch":
        return applied
    return apply_run_data_parallel(model, applied, cfg, mesh, amp_dtype, log)


def apply_run_data_parallel(model: nn.Module, applied: Parallelized, cfg: JobConfig, mesh,
                            amp_dtype: torch.dtype | None, log=None, replicate: bool = True) -> Parallelized:
    """``parallelize``'s step 7 on a model through steps 1-6 (``applied``): data parallel as the config says, then
    the pipeline's schedules; returns ``applied`` with what it did. ``replicate`` False leaves ZeRO-0 unwrapped (the
    planner on fake tensors, where DDP's C++ reducer cannot run: train/plan/__init__.py)."""
    from torch.distributed.fsdp import FSDPModule

    from hybridtron.train.model_hooks import self_guided_end_step

    log = log or (lambda _msg: None)
    pipeline = applied.pipeline
    if replicate or mesh.zero_stage != 0:
        # weights are identical on all ranks; self-guided guide weights leave the model at a step of the run
        apply_data_parallel(model, mesh, amp_dtype, cfg.parallel.mixed_precision,
                            params_may_leave=self_guided_end_step(cfg) is not None, roots=applied.roots,
                            offload=cfg.parallel.offload == "cpu")
        summary = data_parallel_summary(model)
        if summary:
            log(summary)
    if pipeline is not None:
        pipeline.finish()
    shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
    applied.replicated = replicate and mesh.zero_stage == 0 and mesh.data_ranks > 1
    applied.sharded = bool(shards)
    applied.hsdp_modules = shards if getattr(mesh, "hsdp_mesh", None) is not None else []
    return applied
