"""The process layout of a run: one object owns the process group and the device mesh.

``torchrun`` (or SLURM through it) starts one process per device and sets RANK, WORLD_SIZE, LOCAL_RANK and
the rendezvous address; without them the run is one process and no process group exists. The layout's rules
(layout.py: the ``parallel`` section against the world size, the model and the kernels) are checked before the
process group is even created, so an impossible layout costs no model allocation anywhere. Every collective the train loop needs
(loss and token counts, stop requests, MoE loads, checkpoint agreement) is a method here; nothing else in
the project touches global process-group state.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridtron.configs import JobConfig
from hybridtron.train.parallel.layout import Layout, launch_world
from hybridtron.train.watchdog import waiting


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
    # checkpoint.async with several processes: a gloo group of all ranks of its own, which only the background
    # checkpoint writes use (torch.distributed.checkpoint's planning and commit), so they never share a group with
    # the training collectives that the main thread runs at the same time
    checkpoint_group: object | None = None

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
        """Check the layout (layout.py), then (more than one process) create the process group and the device mesh."""
        rank, local, world = launch_world()
        layout = Layout.from_config(cfg, world, device.type)  # every layout and kernel rule, before any group exists
        dp = layout.dp
        if world == 1:
            mesh = cls(dp=1, zero_stage=cfg.parallel.zero_stage)
            if layout.group_alone and not dist.is_initialized():
                # DeepSpeed wants a process group even alone: a one-rank gloo group on an in-memory store
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                mesh.owns_group = True
            return mesh
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        from torch.distributed.device_mesh import init_device_mesh

        tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
        # tp innermost: the ranks of a tp group are neighbours (one node, fast links); pp outermost: only activations
        # of stage boundaries cross it, so it can span nodes. cp sits between dp and tp, and gradients are averaged
        # over dp x cp ranks: the device mesh's "dp" dimension spans both.
        dims = [(name, n) for name, n in (("pp", pp), ("dp", dp * cp), ("tp", tp)) if n > 1 or name == "dp"]
        mesh = init_device_mesh(device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))
        if tp > 1 and dp * cp > 1:  # one group over dp x tp, for DTensor to reduce a value partial on both (the
            # gradient norm under FSDP2 x tp) in one all-reduce, not two in sequence (torch warns of those)
            mesh["dp", "tp"]._flatten("dp_tp")
        ep, expert_mesh = cfg.parallel.ep, None
        if ep > 1:  # the same rank order with dp x cp split in two: experts shard over ep, replicate over dp_replicate
            expert_mesh = init_device_mesh(device.type, (pp, dp * cp // ep, ep, tp),
                                           mesh_dim_names=("pp", "dp_replicate", "ep", "tp"))
            if tp > 1:  # the experts' gradient norm likewise, partial over ep and tp
                expert_mesh["ep", "tp"]._flatten("ep_tp")
        cp_group = None
        if cp > 1:  # groups of their own, even when one spans the world (a device mesh would reuse the default
            # group there, whose gradient all-reduces the backward interleaves with the cp exchanges differently
            # on different ranks)
            grid = torch.arange(world).view(pp, dp, cp, tp).movedim(2, -1).reshape(-1, cp)
            for ranks in grid.tolist():  # every rank creates every group, in the same order
                group = dist.new_group(ranks)
                if rank in ranks:
                    cp_group = group
        dp_shard, hsdp_mesh = layout.dp_shard, None
        if dp_shard < dp:  # dp_shard innermost: a shard group is neighbouring ranks (a node), the replicas span nodes.
            # The mesh's "dp" runs over dp x cp (cp inner): FSDP2 shards over dp_shard x cp, as torchtitan's dp_shard_cp
            hsdp_mesh = mesh["dp"]._unflatten(0, (dp // dp_shard, dp_shard * cp), ("dp_replicate", "dp_shard"))
        checkpoint_group = None
        if cfg.checkpoint.async_save:
            checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
        return cls(rank, local, world, dp, tp, cfg.parallel.zero_stage, mesh, pp, ep, expert_mesh, cp, cp_group,
                   dp_shard=dp_shard, hsdp_mesh=hsdp_mesh, checkpoint_group=checkpoint_group)

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
        return self.means([value])[0]

    def means(self, values: list[float]) -> list[float]:
        """``mean`` of each per-rank scalar, in one all-reduce."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        with waiting():  # a slower rank keeps this one here (train/watchdog.py: stragglers)
            dist.all_reduce(t, group=self._group())
        return [float(v) / self.data_ranks for v in t.tolist()]

    def total(self, count: int) -> int:
        """The sum of a per-rank integer over the data-parallel (x context-parallel) ranks (a token count)."""
        if not self.distributed:
            return count
        t = torch.tensor([count], dtype=torch.int64)
        with waiting():  # a slower rank keeps this one here (train/watchdog.py: stragglers)
            dist.all_reduce(t, group=self._group())
        return int(t.item())

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any (a stop request, a non-finite value)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        with waiting():  # a slower rank keeps this one here (train/watchdog.py: stragglers)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def pp_sum(self, value: float) -> float:
        """The sum of a per-rank scalar over the pipeline stages of this rank's (dp, tp) coordinate."""
        if self.pp == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        with waiting():  # a slower rank keeps this one here (train/watchdog.py: stragglers)
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
        with waiting():  # a slower rank keeps this one here (train/watchdog.py: stragglers)
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
