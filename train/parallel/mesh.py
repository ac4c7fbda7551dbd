"""The process layout of a run: one object owns the process group and the device mesh.

``torchrun`` (or SLURM through it) starts one process per device and sets RANK, WORLD_SIZE, LOCAL_RANK and
the rendezvous address; without them the run is one process and no process group exists. The layout
(``parallel`` section of the config) is checked against the world size before the process group is even
created, so an impossible layout costs no model allocation anywhere. Every collective the train loop needs
(loss and token counts, stop requests, MoE loads, checkpoint agreement) is a method here; nothing else in
the project touches global process-group state.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridtron.configs import ConfigError, JobConfig


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


def resolve_layout(cfg: JobConfig, world: int) -> int:
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
    split = [f"parallel.{n}={getattr(p, n)}" for n in ("pp", "ep", "cp") if getattr(p, n) > 1]
    if cfg.train.compile and split:
        raise ConfigError(f"train.compile=true is not yet tested with {', '.join(split)} (their exchanges run inside "
                          f"the compiled blocks); set train.compile=false for this layout (compile composes with "
                          f"data and tensor parallel)")
    if p.tp > 1:
        check_tensor_parallel(cfg)
        if dp * p.cp > 1 and p.zero_stage == 0:
            data = f"dp={dp}" if p.cp == 1 else f"dp x cp = {dp} x {p.cp}"
            raise ConfigError(f"parallel.tp={p.tp} with {data} needs parallel.zero_stage 2 or 3 (FSDP2 over dp, which "
                              f"composes with tensor parallelism); replicated DDP does not")
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
    return dp


def dp_shard_size(cfg: JobConfig, dp: int) -> int:
    """The ranks FSDP2 shards over: ``parallel.dp_shard``, or all of ``dp`` (-1)."""
    return dp if cfg.parallel.dp_shard == -1 else cfg.parallel.dp_shard


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
    if dp * p.cp > 1 and p.zero_stage == 0:
        data = f"dp={dp}" if p.cp == 1 else f"dp x cp = {dp} x {p.cp}"
        raise ConfigError(f"parallel.pp={p.pp} with {data} needs parallel.zero_stage 2 or 3 (FSDP2 over dp, which "
                          f"the pipeline schedules drive); replicated DDP does not compose with them here")
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
    """What context parallelism of degree ``parallel.cp`` needs: sequences that split evenly (into pieces that
    sequence parallelism splits again)."""
    p = cfg.parallel
    if cfg.data.seq_len % p.cp:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.cp={p.cp}: every context-"
                          f"parallel rank takes an equal piece of each sequence; choose a cp that divides it")
    piece = cfg.data.seq_len // p.cp
    if p.tp > 1 and piece % p.tp:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} splits into context-parallel pieces of {piece} positions, "
                          f"which sequence parallelism cannot divide by parallel.tp={p.tp}; choose data.seq_len a "
                          f"multiple of cp x tp = {p.cp * p.tp}")


def check_tensor_parallel(cfg: JobConfig) -> None:
    """What tensor parallelism of degree ``parallel.tp`` needs of the model; ConfigError naming the field."""
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


@dataclass
class Mesh:
    """Rank, world and the named device mesh of one run: ``pp`` outermost, then ``dp``, ``tp`` innermost."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    dp: int = 1
    tp: int = 1
    zero_stage: int = 0
    # torch DeviceMesh when world_size > 1, its dims those of ("pp", "dp", "tp") with pp, tp > 1 ("dp" always)
    device_mesh: object | None = None
    pp: int = 1
    ep: int = 1  # expert parallel: groups of ep neighbouring dp ranks split every MoE layer's experts
    # parallel.ep > 1: a second view of the same ranks, dims ("pp", "dp_replicate", "ep", "tp"), dp x cp = dp_replicate x ep
    expert_mesh: object | None = None
    cp: int = 1  # context parallel: cp neighbouring ranks of one dp group split each sequence
    # parallel.cp > 1: the process group of this rank's cp neighbours; the device mesh's "dp" spans dp x cp ranks
    cp_group: object | None = None
    # FSDP2's shard group size: all of dp, or (parallel.dp_shard < dp, hybrid sharding) groups of dp_shard
    # neighbouring dp ranks (x the cp ranks of each: torchtitan's dp_shard_cp), replicated over dp / dp_shard; then
    # hsdp_mesh is the device mesh's "dp" dimension (dp x cp ranks) seen as ("dp_replicate", "dp_shard"), which
    # FSDP2 takes for HSDP (everything else keeps using "dp")
    dp_shard: int = 1
    hsdp_mesh: object | None = None

    @property
    def data_ranks(self) -> int:
        """The ranks over which gradients are averaged and the loss is a mean: data x context parallel."""
        return self.dp * self.cp

    @property
    def cp_rank(self) -> int:
        """This rank's piece of each sequence (context parallel)."""
        return (self.rank // self.tp) % self.cp
    owns_group: bool = False  # a one-process group made for DeepSpeed

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's coordinate along dp: the tp ranks and pipeline stages of one dp group read the same batches."""
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline coordinate: it holds stage pp_rank (and pp_rank + pp, ... when interleaved)."""
        return self.rank // (self.dp * self.cp * self.tp)

    @classmethod
    def setup(cls, cfg: JobConfig, device: torch.device) -> Mesh:
        """Check the layout, then (more than one process) create the process group and the device mesh."""
        rank, local, world = launch_world()
        dp = resolve_layout(cfg, world)
        if world == 1:
            mesh = cls(dp=1, zero_stage=cfg.parallel.zero_stage)
            if cfg.parallel.engine == "deepspeed" and not dist.is_initialized():
                # DeepSpeed wants a process group even alone: a one-rank gloo group on an in-memory store
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                mesh.owns_group = True
            return mesh
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError("parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo on the CPU")
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        from torch.distributed.device_mesh import init_device_mesh

        tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
        # tp innermost: the ranks of a tp group are neighbours (one node, fast links); pp outermost: only activations
        # of stage boundaries cross it, so it can span nodes. cp sits between dp and tp, and gradients are averaged
        # over dp x cp ranks: the device mesh's "dp" dimension spans both.
        dims = [(name, n) for name, n in (("pp", pp), ("dp", dp * cp), ("tp", tp)) if n > 1 or name == "dp"]
        mesh = init_device_mesh(device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))
        ep, expert_mesh = cfg.parallel.ep, None
        if ep > 1:  # the same rank order with dp x cp split in two: experts shard over ep, replicate over dp_replicate
            expert_mesh = init_device_mesh(device.type, (pp, dp * cp // ep, ep, tp),
                                           mesh_dim_names=("pp", "dp_replicate", "ep", "tp"))
        cp_group = None
        if cp > 1:  # groups of their own, even when one spans the world (a device mesh would reuse the default
            # group there, whose gradient all-reduces the backward interleaves with the cp exchanges differently
            # on different ranks)
            grid = torch.arange(world).view(pp, dp, cp, tp).movedim(2, -1).reshape(-1, cp)
            for ranks in grid.tolist():  # every rank creates every group, in the same order
                group = dist.new_group(ranks)
                if rank in ranks:
                    cp_group = group
        dp_shard, hsdp_mesh = dp_shard_size(cfg, dp), None
        if dp_shard < dp:  # dp_shard innermost: a shard group is neighbouring ranks (a node), the replicas span nodes.
            # The mesh's "dp" runs over dp x cp (cp inner): FSDP2 shards over dp_shard x cp, as torchtitan's dp_shard_cp
            hsdp_mesh = mesh["dp"]._unflatten(0, (dp // dp_shard, dp_shard * cp), ("dp_replicate", "dp_shard"))
        return cls(rank, local, world, dp, tp, cfg.parallel.zero_stage, mesh, pp, ep, expert_mesh, cp, cp_group,
                   dp_shard=dp_shard, hsdp_mesh=hsdp_mesh)

    def pipeline_ends_group(self):
        """The two-rank group {first stage, last stage} of this rank's (dp, tp) coordinate, or None on a middle
        stage (a tied embedding's two copies sum their gradients in it). Every rank creates every group, in the
        same order, as torch.distributed requires."""
        grid = self.device_mesh.mesh  # (pp, dp[, tp]) rank numbers
        mine = None
        for pair in torch.stack([grid[0].flatten(), grid[-1].flatten()], dim=1).tolist():
            group = dist.new_group(pair)
            if self.rank in pair:
                mine = group
        return mine

    # ---- collectives (no-ops on one process) -----------------------------------------------------
    def mean(self, value: float) -> float:
        """The mean of a per-rank scalar over the data-parallel (x context-parallel) ranks."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self._group())
        return float(t.item()) / self.data_ranks

    def total(self, count: int) -> int:
        """The sum of a per-rank integer over the data-parallel (x context-parallel) ranks (a token count)."""
        if not self.distributed:
            return count
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t, group=self._group())
        return int(t.item())

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any (a stop request, a non-finite value)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def pp_sum(self, value: float) -> float:
        """The sum of a per-rank scalar over the pipeline stages of this rank's (dp, tp) coordinate."""
        if self.pp == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.device_mesh.get_group("pp"))
        return float(t.item())

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the data-parallel ranks in place (its device's backend must take it)."""
        if self.distributed:
            dist.all_reduce(tensor, group=self._group())
        return tensor

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        self.close(failed=exc_type is not None)

    def close(self, failed: bool = False) -> None:
        """Tear the process group down together: a rank that destroys its group while another still uses
        it makes gloo abort that one. After a failure on this rank the others may be inside another
        collective, so nothing is awaited: the process exits and the launcher stops the rest."""
        if self.owns_group and dist.is_initialized():  # our one-process group: nobody else to wait for
            dist.destroy_process_group()
            return
        if failed:
            return
        if self.distributed and dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()

    def _group(self):
        return self.device_mesh.get_group("dp") if self.device_mesh is not None else None
