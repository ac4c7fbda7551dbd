"""The layout of a job on its processes and devices, checked whole before anything is allocated.

``Layout.from_config(cfg, world, device_type)`` returns the data-parallel degree and the shard group a config's
``parallel`` section takes on ``world`` processes, or refuses with a ConfigError naming the field and what to
change. Every rule that ties the layout to the rest of the job lives here, and nowhere else: the world size and
the degrees (dp x tp x pp x cp), which engine composes with what, what each strategy needs of the model and the
batch, and which fused-kernel backend can run the model on the target device -- the kernels' own limits, asked of
kernels/rules.py for the backend ``auto`` would take there (an explicit backend is checked as given). The
config sections check their own fields only (configs/); the process group and the device mesh are built from the
answer afterwards (mesh.py), as torchtitan's ParallelDims validates before it builds its mesh.

The rules are arithmetic on the config: no torch here, no device, no process group (the world size is read from
the launcher's environment, `launch_world`). Who calls it: the command line, before it imports torch (`check_run`:
a run here, `target_layout`: ``hybridtron submit`` and ``plan``, whose target is a cluster's GPU, not this
machine's), a run again (``Mesh.setup``, before the process group is created, with its device in hand), ``plan``
(each candidate layout), and, for the kernel rules alone, the commands that load a checkpoint to run it here
(``check_kernels``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from hybridtron.configs import ConfigError, JobConfig
from hybridtron.kernels import rules


def launch_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment; (0, 0, 1) for a plain process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK in the environment are not integers ({e}); launch "
                          f"with torchrun, or unset them for one process") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} in the environment do not fit; launch with torchrun")
    return rank, local, world


@dataclass(frozen=True)
class Layout:
    """The degrees of one job on ``world`` processes: pp outermost, then dp (x cp), tp innermost; FSDP2 shards over
    ``dp_shard`` of the dp ranks (all of them unless hybrid sharding); ep groups dp x cp ranks for the experts."""

    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1
    device_type: str = "cpu"  # what the kernel rules were checked for: "cuda" or "cpu"
    group_alone: bool = False  # one process still needs a process group (DeepSpeed's engine wants one)

    @classmethod
    def from_config(cls, cfg: JobConfig, world: int, device_type: str | None = None, *, here: bool = True,
                    gpu_seen: bool = False) -> Layout:
        """Check every layout and kernel rule of ``cfg`` on ``world`` processes whose devices are of ``device_type``
        ("cuda" or "cpu"; None: train.device, auto meaning CUDA when this machine sees one). ``here``: those devices
        are this machine's (a run); False: a cluster's (submit, plan), where a GPU is taken as present and what is
        installed here as installed there. ``gpu_seen``: this machine's CUDA device is taken as present without
        asking torch (`check_run`), and its FP8 capability is left to the run's own check. ConfigError, one line, at
        the first rule broken."""
        device_type = rules.device_type_of(cfg.train.device if device_type is None else device_type)
        check_engine(cfg)
        check_async_checkpoint(cfg)
        check_sparse_attention(cfg)
        dp = data_parallel_size(cfg, world)
        p = cfg.parallel
        if world > 1 and p.backend == "nccl" and device_type != "cuda":
            raise ConfigError("parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo on the CPU")
        if p.dp_shard != -1:
            check_hybrid_shard(cfg, dp)
        if p.pp > 1:
            check_pipeline_parallel(cfg, dp)
        if p.ep > 1:
            check_expert_parallel(cfg, dp)
        if p.cp > 1:
            check_context_parallel(cfg)
        if p.offload != "none":
            check_offload(cfg, dp)
        check_compile(cfg)
        if p.tp > 1:
            check_tensor_parallel(cfg, dp)
        check_self_guided(cfg, dp)
        check_fp8(cfg, device_type, here=here and not gpu_seen)
        check_kernels(cfg, device_type, here=here, gpu_seen=gpu_seen)
        return cls(world, dp, p.tp, p.pp, p.cp, p.ep, dp if p.dp_shard == -1 else p.dp_shard, device_type,
                   group_alone=p.engine == "deepspeed")


def check_run(cfg: JobConfig, world: int) -> None:
    """Every layout and kernel rule of a run of ``cfg`` on ``world`` processes of this machine, asking torch only
    where the answer turns on it: the command line checks a run this way before it imports torch (~2 s of CPU), and
    Mesh.setup checks it again with the device in hand.

    train.device=auto is CUDA when torch sees a device. So auto is checked for both device types, CUDA taken as
    present (as auto would find it): when both give the same answer (valid, or the same refusal), no torch is
    needed; only when they differ is torch asked which this machine has, and the run is checked for that device.
    An explicit cuda device is taken as present too: its absence is the device selection's to report, and what a
    present GPU decides itself (its FP8 capability) is Mesh.setup's check."""
    if cfg.train.device != "auto":
        Layout.from_config(cfg, world, rules.device_type_of(cfg.train.device), gpu_seen=True)
        return
    answers = []
    for device_type in ("cpu", "cuda"):
        try:
            Layout.from_config(cfg, world, device_type, gpu_seen=True)
            answers.append(None)
        except ConfigError as e:
            answers.append(str(e))
    if answers[0] == answers[1]:
        if answers[0] is not None:
            raise ConfigError(answers[0])
        return
    Layout.from_config(cfg, world)  # the devices answer differently: torch says which one this machine has


def target_layout(cfg: JobConfig, world: int) -> Layout:
    """The layout of a job planned or submitted from here for a cluster: its GPUs (the CPU when train.device says
    so), taken as present, with what is installed here taken as installed there."""
    return Layout.from_config(cfg, world, "cpu" if cfg.train.device == "cpu" else "cuda", here=False)


def check_plan_engine(cfg: JobConfig) -> None:
    """``hybridtron plan`` models the torch engine (its memory is traced through the trainer's own code)."""
    if cfg.parallel.engine != "torch":
        raise ConfigError("hybridtron plan models the torch engine (DDP / FSDP2); for DeepSpeed use its own "
                          "estimators (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live), "
                          "or plan with parallel.engine=torch")


def check_plan_layout(cfg: JobConfig, world: int, zero_stages: tuple[int, ...] = (0, 2, 3)) -> None:
    """``hybridtron plan``'s refusal, torch-free: it tabulates every ZeRO stage whose `target_layout` holds on
    ``world`` GPUs and is refused only when none does, with the configured stage's reason (else the first's:
    a pipeline's ZeRO-0 refusal says to use 2 or 3, which misled when 3 was set and refused for another reason)
    (train/plan/table.py's plan_table, which imports torch to count the model: this says it before)."""
    refusals = {}
    for z in zero_stages:
        try:
            target_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=z)), world)
            return
        except ConfigError as e:
            refusals[z] = e
    raise refusals.get(cfg.parallel.zero_stage, next(iter(refusals.values())))


def data_parallel_size(cfg: JobConfig, world: int) -> int:
    """The data-parallel size of ``cfg.parallel`` on ``world`` processes; ConfigError naming what to change."""
    p = cfg.parallel
    others = p.tp * p.pp * p.cp
    dp = p.dp if p.dp != -1 else world // others
    if dp < 1 or dp * others != world:
        raise ConfigError(
            f"the layout parallel.dp={p.dp} x tp={p.tp} x pp={p.pp} x cp={p.cp} needs "
            f"{'a multiple of ' + str(others) if p.dp == -1 else dp * others} processes, but the launcher started "
            f"{world} (WORLD_SIZE); change torchrun --nproc-per-node / --nnodes, or parallel.dp"
        )
    return dp


def check_engine(cfg: JobConfig) -> None:
    """What each data-parallel engine composes with, and the pipeline schedule with its stages per rank."""
    p, t = cfg.parallel, cfg.train
    if p.zero_stage == 1 and p.engine == "torch":
        raise ConfigError("parallel.zero_stage=1 (optimizer state sharded alone) needs parallel.engine=deepspeed; "
                          "with the torch engine use parallel.zero_stage=2 (FSDP2: same memory or less) or 0")
    if p.engine != "deepspeed" and (p.deepspeed_config or p.offload_optimizer):
        raise ConfigError("parallel.deepspeed_config and parallel.offload_optimizer need parallel.engine=deepspeed")
    if p.engine == "deepspeed":
        for name, what in (("cp", "parallel.cp > 1"), ("ep", "parallel.ep > 1")):
            if getattr(p, name) > 1:
                raise ConfigError(f"{what} works with parallel.engine=torch only; set parallel.engine=torch, or "
                                  f"parallel.{name}=1 for DeepSpeed")
    multi = p.pp_schedule in ("interleaved_1f1b", "zero_bubble")
    if (multi and p.pp_stages_per_rank < 2) or (not multi and p.pp_stages_per_rank != 1):
        raise ConfigError(
            f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} does not fit parallel.pp_schedule="
            f"{p.pp_schedule}: gpipe and 1f1b run one stage per rank (set 1), interleaved_1f1b and zero_bubble "
            f"two or more (set 2)")
    if p.engine == "deepspeed":
        if p.pp > 1:
            raise ConfigError("parallel.pp > 1 works with parallel.engine=torch only (torch.distributed.pipelining); "
                              "set parallel.engine=torch, or parallel.pp=1 for DeepSpeed")
        if p.tp > 1:
            raise ConfigError("parallel.tp > 1 works with parallel.engine=torch only; set parallel.tp=1 for DeepSpeed")
        if p.dp_shard != -1:
            raise ConfigError(f"parallel.dp_shard={p.dp_shard} is FSDP2's hybrid sharding (parallel.engine=torch); "
                              f"DeepSpeed's own (hpZ / MiCS) is not wired here: set parallel.dp_shard=-1 for DeepSpeed")
        if t.spike_policy == "skip":
            raise ConfigError("train.spike_policy=skip is not available with parallel.engine=deepspeed (its engine "
                              "applies the step before the gradient norm is known); use warn or stop, or the torch "
                              "engine")
        if t.nan_policy == "skip":
            raise ConfigError("train.nan_policy=skip is not available with parallel.engine=deepspeed (its engine "
                              "steps on its own count of micro-batches); use train.nan_policy=stop, or the torch engine")
        if t.compile:
            raise ConfigError("train.compile=true works with parallel.engine=torch only (DeepSpeed wraps the model "
                              "itself); set train.compile=false or parallel.engine=torch")


def check_async_checkpoint(cfg: JobConfig) -> None:
    """checkpoint.async writes through torch.distributed.checkpoint (or our one-process files) from a staged copy;
    DeepSpeed saves through its own engine, and a pipeline's async save is not yet tested."""
    p = cfg.parallel
    if cfg.checkpoint.async_save and p.engine == "deepspeed":
        raise ConfigError("checkpoint.async=true works with parallel.engine=torch only (DeepSpeed writes its "
                          "checkpoints itself); set checkpoint.async=false or parallel.engine=torch")
    if cfg.checkpoint.async_save and p.pp > 1:
        raise ConfigError(f"checkpoint.async=true is not yet tested with parallel.pp={p.pp}; set checkpoint.async="
                          f"false (synchronous saves) or parallel.pp=1")


def check_sharded_data_parallel(cfg: JobConfig, dp: int, what: str, why: str) -> None:
    """Pipeline and tensor parallelism over more than one data rank need FSDP2 (ZeRO 2/3), not DDP."""
    p = cfg.parallel
    if dp * p.cp > 1 and p.zero_stage == 0:
        data = f"dp={dp}" if p.cp == 1 else f"dp x cp = {dp} x {p.cp}"
        raise ConfigError(f"{what} with {data} needs parallel.zero_stage 2 or 3 (FSDP2 over dp, {why}); replicated "
                          f"DDP does not compose with it here")


def check_hybrid_shard(cfg: JobConfig, dp: int) -> None:
    """What hybrid sharding (``parallel.dp_shard`` below dp: FSDP2 shards within groups of dp_shard neighbouring dp
    ranks, x cp when context parallel, replicated over dp / dp_shard groups) needs; ConfigError naming what to
    change."""
    p, s = cfg.parallel, cfg.parallel.dp_shard
    if p.zero_stage == 0:
        raise ConfigError(f"parallel.dp_shard={s} says how many ranks FSDP2 shards over, and parallel.zero_stage=0 "
                          f"(DDP) shards nothing; set parallel.zero_stage 2 or 3 (hybrid sharding), or "
                          f"parallel.dp_shard=-1")
    if dp % s:
        raise ConfigError(f"parallel.dp_shard={s} does not divide dp={dp}: the dp ranks form dp / dp_shard groups of "
                          f"dp_shard each; choose a divisor of {dp} (e.g. the GPUs of a node), or -1 (all of dp)")
    if s == 1 < dp and p.cp == 1:  # with cp > 1 the shard group is the cp ranks of one dp coordinate
        raise ConfigError("parallel.dp_shard=1 shards nothing (every rank would hold the whole model); set "
                          "parallel.zero_stage=0 to replicate (DDP), or parallel.dp_shard 2 or more")


def check_offload(cfg: JobConfig, dp: int) -> None:
    """What ``parallel.offload: cpu`` (FSDP2's CPUOffloadPolicy) needs: FSDP2, i.e. the torch engine at ZeRO 2/3
    over at least two data-parallel ranks; ConfigError naming what to use instead."""
    p = cfg.parallel
    if p.engine != "torch":
        raise ConfigError("parallel.offload=cpu is FSDP2's offload (parallel.engine=torch); with DeepSpeed set "
                          "parallel.offload_optimizer=true instead")
    if p.zero_stage < 2:
        raise ConfigError(f"parallel.offload=cpu keeps FSDP2's parameter, gradient and optimizer shards on the host, "
                          f"and parallel.zero_stage={p.zero_stage} shards nothing; set parallel.zero_stage 2 or 3")
    if p.pp > 1:  # the tied embedding's two copies sum their gradients outside FSDP2, where they would be on the host
        raise ConfigError(f"parallel.offload=cpu is not yet tested with parallel.pp={p.pp} (pipeline stages exchange "
                          f"gradients outside FSDP2); set parallel.offload=none, or use more data-parallel ranks "
                          f"with parallel.zero_stage=3 to spread the state")
    if dp * p.cp == 1:
        raise ConfigError("parallel.offload=cpu needs FSDP2 over two or more data-parallel ranks, and this layout has "
                          "one; on one process use parallel.engine=deepspeed with parallel.offload_optimizer=true")


def check_pipeline_parallel(cfg: JobConfig, dp: int) -> None:
    """What pipeline parallelism of degree ``parallel.pp`` needs of the model and the batch; ConfigError."""
    p, m, accum = cfg.parallel, cfg.model, cfg.train.grad_accum_steps
    stages = p.pp * p.pp_stages_per_rank
    if m.n_layers < stages:
        raise ConfigError(f"model.n_layers={m.n_layers} cannot fill parallel.pp={p.pp} x pp_stages_per_rank="
                          f"{p.pp_stages_per_rank} = {stages} pipeline stages (each needs a layer); lower parallel.pp "
                          f"or pp_stages_per_rank")
    if p.pp_schedule != "gpipe" and accum < p.pp:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule} needs at least parallel.pp={p.pp} micro-batches per "
                          f"step, and train.grad_accum_steps={accum} gives {accum}; raise train.grad_accum_steps (the "
                          f"pipeline's micro-batches; more of them shrink its idle bubble) or lower the pp degree")
    if p.pp_stages_per_rank > 1 and accum % p.pp:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule} runs the micro-batches in rounds of parallel.pp="
                          f"{p.pp}; set train.grad_accum_steps to a multiple of {p.pp} (now {accum})")
    check_sharded_data_parallel(cfg, dp, f"parallel.pp={p.pp}", "which the pipeline schedules drive")
    if m.ffn.kind != "dense" and m.ffn.self_guided:
        raise ConfigError("model.ffn.self_guided changes the model during the run, which fixed pipeline stages "
                          "cannot follow; set parallel.pp=1 for self-guided runs")


def check_expert_parallel(cfg: JobConfig, dp: int) -> None:
    """What expert parallelism of degree ``parallel.ep`` needs: MoE layers whose experts split evenly over ep ranks
    taken from the data-parallel ones."""
    p, m = cfg.parallel, cfg.model
    if not m.moe.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} splits the experts of MoE layers, and this model has none "
                          f"(model.moe.n_experts=0); set parallel.ep=1")
    if m.moe.n_experts % p.ep:
        raise ConfigError(f"model.moe.n_experts={m.moe.n_experts} is not divisible by parallel.ep={p.ep}: every "
                          f"expert-parallel rank holds an equal share; choose an ep that divides it")
    if (dp * p.cp) % p.ep:
        data = f"dp={dp}" if p.cp == 1 else f"dp x cp = {dp} x {p.cp} = {dp * p.cp}"
        raise ConfigError(f"parallel.ep={p.ep} groups data- (and context-) parallel ranks, and {data} is not a "
                          f"multiple of it; choose an ep that divides it (ep ranks share their tokens' experts, each "
                          f"still runs its own tokens)")


def check_context_parallel(cfg: JobConfig) -> None:
    """What context parallelism of degree ``parallel.cp`` needs: sequences that split evenly into 2 cp chunks (the
    zig-zag layout: rank r holds chunks r and 2 cp - 1 - r), pieces that sequence parallelism splits again, chunks no
    shorter than the Gated DeltaNet convolution's reach, and an attention backend with a ring-attention form."""
    p, m = cfg.parallel, cfg.model
    if cfg.data.seq_len % (2 * p.cp):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is not a multiple of 2 x parallel.cp = {2 * p.cp}: context "
                          f"parallelism cuts every sequence into 2 cp equal chunks and gives each rank two of them "
                          f"(an early and a late one, so the causal work is balanced); choose a cp with seq_len a "
                          f"multiple of 2 cp")
    piece = cfg.data.seq_len // p.cp
    if p.tp > 1 and piece % p.tp:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} splits into context-parallel pieces of {piece} positions, "
                          f"which sequence parallelism cannot divide by parallel.tp={p.tp}; choose data.seq_len a "
                          f"multiple of cp x tp = {p.cp * p.tp}")
    chunk = piece // 2
    if "L" in m.layer_types() and chunk < m.deltanet.conv_size - 1:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} at parallel.cp={p.cp} gives chunks of {chunk} positions, "
                          f"fewer than the Gated DeltaNet convolution reads before each (model.deltanet.conv_size - 1 "
                          f"= {m.deltanet.conv_size - 1}); use a longer sequence or a smaller cp")
    attention = m.kernels.attention
    if attention in ("flex", "flash-attn"):
        raise ConfigError(
            f"model.kernels.attention={attention} with parallel.cp={p.cp}: ring attention runs its blocks on sdpa "
            f"(torch's fused kernels), triton (ours) or reference, not {attention}; set model.kernels.attention to "
            f"auto, sdpa, triton or reference, or parallel.cp=1")


def check_tensor_parallel(cfg: JobConfig, dp: int) -> None:
    """What tensor parallelism of degree ``parallel.tp`` needs of the model, the data-parallel engine and the norm
    kernel; ConfigError naming the field."""
    m, tp = cfg.model, cfg.parallel.tp
    unsupported = []
    if m.ffn.kind != "dense":
        unsupported.append(f"structured feed-forwards (model.ffn.kind={m.ffn.kind})")
    if m.scale.any:
        unsupported.append("scale vectors (model.scale)")
    if unsupported:
        raise ConfigError(f"parallel.tp={tp} shards gated attention, Gated DeltaNet, SwiGLU and MoE layers in this "
                          f"version, not {', '.join(unsupported)}; set parallel.tp=1 (data parallel covers every model)")
    sizes = [("data.seq_len", cfg.data.seq_len)]
    if "A" in m.layer_types():
        sizes += [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)]
    if any(not m.moe.is_moe_layer(i) for i in range(m.n_layers)):
        sizes.append(("model.ffn_hidden", m.resolved_ffn_hidden()))
    if "L" in m.layer_types():
        hk, hv, _, _ = m.deltanet.resolved(m)
        sizes += [("model.deltanet.n_k_heads (Gated DeltaNet key heads)", hk),
                  ("model.deltanet.n_v_heads (Gated DeltaNet value heads)", hv)]
    if m.moe.n_experts:
        hidden = m.moe.expert_hidden or m.resolved_ffn_hidden()
        sizes.append(("model.moe.expert_hidden (each expert's hidden units)", hidden))
        if m.moe.shared_expert_hidden:
            sizes.append(("model.moe.shared_expert_hidden", m.moe.shared_expert_hidden))
    for name, value in sizes:
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp}: every tensor-parallel rank "
                              f"takes an equal share; choose a tp that divides it")
    vocab = m.resolve_vocab(cfg.data.tokenizer.vocab_size)
    if vocab % tp:
        raise ConfigError(f"the vocabulary ({vocab} embeddings) is not divisible by parallel.tp={tp}; set "
                          f"model.vocab_size to a multiple of {tp} (at least the tokenizer's size)")
    check_sharded_data_parallel(cfg, dp, f"parallel.tp={tp}", "which composes with tensor parallelism")
    if m.kernels.norm == "triton":
        raise ConfigError(
            f"model.kernels.norm=triton with parallel.tp={tp}: tensor parallelism hands the norms DTensors, which the "
            f"Triton norm kernel does not take; set model.kernels.norm=auto (the reference under tensor parallelism) "
            f"or parallel.tp=1")


def check_compile(cfg: JobConfig) -> None:
    """torch.compile composes with data and tensor parallelism; the strategies that exchange inside a block are not
    yet tested under it."""
    p = cfg.parallel
    split = [f"parallel.{n}={getattr(p, n)}" for n in ("pp", "ep", "cp") if getattr(p, n) > 1]
    if cfg.train.compile and split:
        raise ConfigError(f"train.compile=true is not yet tested with {', '.join(split)} (their exchanges run inside "
                          f"the compiled blocks); set train.compile=false for this layout (compile composes with "
                          f"data and tensor parallel)")


def check_fp8(cfg: JobConfig, device_type: str, *, here: bool = True) -> None:
    """train.fp8 needs torchao, FP8 tensor cores (on the CPU: torchao's emulation, tests only) and the torch engine."""
    recipe, p = cfg.train.fp8, cfg.parallel
    if recipe == "none":
        return
    if p.engine == "deepspeed":
        raise ConfigError(f"train.fp8={recipe} works with parallel.engine=torch only (DeepSpeed wraps the model and "
                          f"its linears itself); set train.fp8=none or parallel.engine=torch")
    if p.offload != "none":
        raise ConfigError(f"train.fp8={recipe} with parallel.offload={p.offload} is not tested together (torchao's FP8 "
                          f"weight casts on host-held shards); set train.fp8=none or parallel.offload=none")
    if (why := rules.fp8_unavailable_reason(recipe, device_type, here=here)) is not None:
        raise ConfigError(why)


def check_self_guided(cfg: JobConfig, dp: int) -> None:
    """Self-guided training changes the model during the run, which fixed shards cannot follow."""
    p = cfg.parallel
    self_guided = cfg.model.ffn.kind != "dense" and cfg.model.ffn.self_guided
    if self_guided and p.engine == "deepspeed":
        raise ConfigError("model.ffn.self_guided changes the model during the run (its alpha schedule, then the "
                          "dense guides leave), which the DeepSpeed engine's fixed parameter partitions cannot follow; "
                          "use parallel.engine=torch with parallel.zero_stage=0 for self-guided runs")
    if dp > 1 and self_guided and p.zero_stage >= 2:
        raise ConfigError(
            "model.ffn.self_guided drops the dense guide weights during the run, which FSDP's flat shards "
            "(parallel.zero_stage 2/3) cannot follow; use parallel.zero_stage=0 for self-guided runs"
        )


def check_sparse_attention(cfg: JobConfig) -> None:
    """The HAX branch's single head reads every value channel at every earlier position."""
    d, p = cfg.model.deltanet, cfg.parallel
    if d.sparse_attention != "none" and (p.cp > 1 or p.tp > 1):
        raise ConfigError(
            f"model.deltanet.sparse_attention={d.sparse_attention} with parallel.cp={p.cp}, parallel.tp={p.tp}: the "
            f"branch's single head reads every value channel at every earlier position, which neither a sequence "
            f"piece nor a head shard holds; set parallel.cp=1 and parallel.tp=1, or "
            f"model.deltanet.sparse_attention=none")


def kernel_sizes(cfg: JobConfig, device_type: str) -> dict[str, dict]:
    """op -> the model's sizes its backends are asked about (kernels/limits.py), for the ops the model runs."""
    m = cfg.model
    dtype = "fp32" if cfg.train.dtype == "fp32" or (cfg.train.dtype == "auto" and device_type != "cuda") else "bf16"
    types = m.layer_types()
    sizes: dict[str, dict] = {op: {} for op in rules.OPS}
    if "A" in types:
        sizes["attention"] = {"head_dim": m.resolved_head_dim(), "dtype": dtype}
    if "L" in types:
        _, _, dk, dv = m.deltanet.resolved(m)
        sizes["delta_rule"] = {"chunk_size": m.deltanet.chunk_size, "k_head_dim": dk, "v_head_dim": dv,
                               "n_householder": m.deltanet.n_householder, "dtype": dtype, "grad": True}
        sizes["conv"] = {"width": m.deltanet.conv_size}
    return sizes


def check_kernels(cfg: JobConfig, device_type: str | None = None, *, here: bool = True, gpu_seen: bool = False
                  ) -> None:
    """Every ``model.kernels`` choice against the device (``device_type``; None: train.device) and the model's
    sizes: an explicit backend must run there and take the model; ``auto`` must have a kernel that takes it on
    CUDA (or be asked for the reference by name). ``here`` and ``gpu_seen`` as in `Layout.from_config`. ConfigError
    naming the op, the field and what to choose."""
    device_type = rules.device_type_of(cfg.train.device if device_type is None else device_type)
    moe = cfg.model.moe
    if moe.n_experts and moe.backend == "megablocks" and not rules.installed("grouped_gemm"):
        raise ConfigError("model.moe.backend=megablocks needs megablocks and its grouped_gemm kernels, which build on "
                          "CUDA machines only (pip install 'hybridtron[gpu]'); use model.moe.backend=native elsewhere")
    for op, sizes in kernel_sizes(cfg, device_type).items():
        try:
            rules.admissible(op, getattr(cfg.model.kernels, op), device_type, sizes, here=here and not gpu_seen)
        except rules.BackendError as e:
            raise ConfigError(f"{e} (train.device={cfg.train.device})" if here else str(e)) from None

