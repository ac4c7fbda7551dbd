"""The engine of a run: what runs a step's micro-batches and applies the update, for each way a run can be laid
out, so that the trainer never asks which one it has (issue 42; torchtitan's split of parallelize from the loop).

``build_engine`` is the recipe's step 3: it applies the parallel layout to the model (``parallelize``), builds the
optimizer over the laid-out parameters, and returns one of

- ``TorchEngine``: one process, DDP, FSDP2 (ZeRO-2/3, HSDP), tensor, context and expert parallel: the micro-batches
  one after another through the model (train/step.py ``run_torch``), clipping over every rank's shards;
- ``PipelineEngine`` (``parallel.pp > 1``): the micro-batches through the stages' schedule (``run_pipeline``), the
  norm over every stage, metrics and evaluation through the stages;
- ``DeepSpeedEngine`` (``parallel.engine: deepspeed``): DeepSpeed's engine over the model and our AdamW, which
  clips and steps itself and writes its own checkpoint layout.

Each owns: running a step's micro-batches with their loss weights (``run``), the update with its gradient norm
(``update``), loading and saving its state (``load``, ``save``), the whole gradients of named parameters
(``full_grads``, for ``train.dump_grads``), and the facts the rest of the run needs (``label``). The layout rules
that decide which engine a config gets are train/parallel/layout.py's; the step's loss is train/step.py's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from hybridtron.configs import JobConfig
from hybridtron.train import step as step_mod
from hybridtron.train.checkpoint import DEEPSPEED_TAG, CheckpointManager, TrainerState
from hybridtron.train.model_hooks import after_step, before_step
from hybridtron.train.model_order import canonical_name, from_row_order
from hybridtron.train.optim import build_optimizer
from hybridtron.train.parallel.expert_parallel import sync_expert_grads
from hybridtron.train.parallel.grad_norm import clip_grad_norm
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.parallel.parallelize import Parallelized, parallelize


def check_engine(cfg: JobConfig, mesh: Mesh, device: torch.device) -> None:
    """Refuse what the configured engine cannot honour, before data or model (a DeepSpeed JSON it cannot take)."""
    from hybridtron.train.parallel.deepspeed_engine import check_config

    check_config(cfg, mesh.dp, device.type)


def build_engine(model: nn.Module, cfg: JobConfig, mesh: Mesh, device: torch.device, amp_dtype,
                 run_dir: Path | None = None, log=None) -> Engine:
    """``model`` laid out as ``cfg.parallel`` says (``parallelize``: pipeline stages, FP8, tensor, expert and
    context parallel, recomputation, compile, data parallel), its optimizer, and the engine that runs them."""
    applied = parallelize(model, cfg, mesh, device, amp_dtype, log)
    optimizer = build_optimizer(model, cfg.train)
    if cfg.parallel.engine == "deepspeed":  # its own data parallel: ZeRO partitions, bf16, offload
        from hybridtron.train.parallel.deepspeed_engine import initialize

        return DeepSpeedEngine(cfg, model, initialize(model, optimizer, cfg, mesh, device, run_dir), mesh, device,
                               amp_dtype)
    return engine_over(cfg, model, optimizer, mesh, device, amp_dtype, applied)


def engine_over(cfg: JobConfig, model: nn.Module, optimizer, mesh: Mesh, device: torch.device, amp_dtype,
                applied: Parallelized) -> TorchEngine:
    """The torch engine of a model ``parallelize`` laid out (``applied``: what it applied): the pipeline's when it
    cut stages, else the plain one. The planner (train/plan/memory.py) runs its steps through it too."""
    if applied.pipeline is not None:
        return PipelineEngine(cfg, model, optimizer, mesh, device, amp_dtype, applied)
    return TorchEngine(cfg, model, optimizer, mesh, device, amp_dtype, applied)


class TorchEngine:
    """One process, DDP, FSDP2 (ZeRO-2/3, HSDP), tensor, context and expert parallel (module docstring)."""

    label = ""  # what the run's first log line adds after the layout

    def __init__(self, cfg: JobConfig, model: nn.Module, optimizer, mesh: Mesh, device: torch.device, amp_dtype,
                 applied: Parallelized | None = None):
        self.cfg, self.model, self.optimizer, self.mesh = cfg, model, optimizer, mesh
        self.device, self.amp_dtype = device, amp_dtype
        self.applied = applied or Parallelized()  # (None: a one-process model, nothing applied)

    @property
    def roots(self) -> list[nn.Module]:
        """The modules a step calls forward on: the model (a pipeline's: its stages)."""
        return self.applied.roots or [self.model]

    # ---- a step ----------------------------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Before step ``step``'s forward (0-based): the model's hooks (self-guided weights leaving the model)."""
        before_step(self.model, self.optimizer, self.cfg, step)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def run(self, batches: list[dict], weights: list[float | None]) -> tuple[float, dict[str, float] | None]:
        """Forward and backward of the step's micro-batches with their loss weights (train/step.py): this rank's
        loss, not yet averaged over the data ranks, and its auxiliary losses by kind (None: not split)."""
        a = self.applied
        return step_mod.run_torch(self.model, batches, weights, device=self.device, amp_dtype=self.amp_dtype,
                                  doc_mask=self.cfg.model.doc_mask, replicated=a.replicated, sharded=a.sharded,
                                  hsdp_modules=a.hsdp_modules)

    def reduce_gradients(self) -> None:
        """After the backward, before anything reads the gradients: the experts' copies summed (expert parallel)."""
        sync_expert_grads(self.model, self.mesh)

    def grad_norm(self, also=()) -> float:
        """Clip the gradients to ``train.grad_clip`` by their global norm; returns the norm before clipping.
        ``also``: parameters outside the model clipped with its own (the planner's layers left out of a step)."""
        return clip_grad_norm([*self.model.parameters(), *also], self.cfg.train.grad_clip)  # every rank's shards

    def update(self, loss: float, allows, *, keep_grads: bool = False, also=()) -> tuple[float, bool]:
        """Clip and, if the loss and the norm are finite and ``allows(loss, norm)`` (the spike guard), step the
        optimizer; the gradients are cleared either way (``keep_grads``: not, for the planner's steps that
        accumulate into them; ``also``: ``grad_norm``'s). Returns (norm, finite)."""
        norm = self.grad_norm(also)
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite and allows(loss, norm):
            self.optimizer.step()
        if not keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        return norm, finite

    def model_metrics(self) -> dict[str, float]:
        """After the update: the model's metrics of this step (MoE loads, router biases moved; FP8 scales)."""
        return after_step(self.model, reduce=self.mesh.sum_)

    # ---- evaluation --------------------------------------------------------------------------------------------
    def eval_loss(self, batch: dict) -> float:
        """The mean loss of one validation micro-batch (on the device, this rank's piece), no gradients."""
        return step_mod.eval_loss(self.model, batch)

    # ---- state -------------------------------------------------------------------------------------------------
    def load(self, path: Path) -> TrainerState:
        """Restore the model, optimizer and RNG from checkpoint ``path`` (its files already verified)."""
        return CheckpointManager.load(path, self.model, self.optimizer, verify=False)

    def save(self, ckpt: CheckpointManager, state: TrainerState, config_yaml: str, tokenizer_dir: Path,
             background: bool) -> Path:
        return ckpt.save(state, self.model, self.optimizer, config_yaml, tokenizer_dir, mesh=self.mesh,
                         background=background)

    def full_grads(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The whole fp32 gradient (on the host) of each parameter named in ``names``, in the model's names and
        row order, on rank 0 (others: what they hold). Every rank must call it: every rank holding a parameter
        walks the same names in the same order, so the gathers (collectives over its mesh) pair up."""
        out = {}
        for name, p in self.model.named_parameters():
            name = canonical_name(name)  # without activation checkpointing's and torch.compile's wrappers
            if name in names and p.grad is not None:
                g = step_mod.whole(p.grad.detach())  # FSDP / TP / EP shards gathered
                # clone: DDP's gradient is a view of its bucket, which torch.save would write whole
                out[name] = from_row_order(self.model, name, g).float().cpu().clone()
        return out


class PipelineEngine(TorchEngine):
    """``parallel.pp > 1``: this rank's stages of the model and their schedule (train/parallel/pipeline.py)."""

    def __init__(self, cfg: JobConfig, model: nn.Module, optimizer, mesh: Mesh, device: torch.device, amp_dtype,
                 applied: Parallelized):
        super().__init__(cfg, model, optimizer, mesh, device, amp_dtype, applied)
        self.pipeline = applied.pipeline

    def run(self, batches: list[dict], weights: list[float | None]) -> tuple[float, None]:
        """The micro-batches through the schedule (the stages hold the auxiliary losses apart: not split)."""
        return step_mod.run_pipeline(self.pipeline, batches, weights, device=self.device, amp_dtype=self.amp_dtype,
                                     doc_mask=self.cfg.model.doc_mask), None

    def grad_norm(self, also=()) -> float:
        return self.pipeline.clip_grad_norm(self.cfg.train.grad_clip)  # every stage, tied copies counted once

    def model_metrics(self) -> dict[str, float]:
        return self.pipeline.metrics_from_all_stages(super().model_metrics())

    def eval_loss(self, batch: dict) -> float:
        return self.pipeline.eval_loss(batch)

    def full_grads(self, names: set[str]) -> dict[str, torch.Tensor]:
        """As the torch engine's, then sent to rank 0 by the first rank of each stage (a stage's parameters live
        on its ranks only)."""
        import torch.distributed as dist

        mine, mesh = super().full_grads(names), self.mesh
        first_of_stage = mesh.rank % (mesh.world_size // mesh.pp) == 0
        parts = [None] * mesh.world_size if mesh.is_main else None
        dist.gather_object(mine if first_of_stage else {}, parts, dst=0)
        if not mesh.is_main:
            return mine
        return {k: v for part in reversed(parts) for k, v in part.items()}  # tied copies are equal


class DeepSpeedEngine(TorchEngine):
    """``parallel.engine: deepspeed``: DeepSpeed's engine (``deepspeed.initialize``) over the model and our AdamW;
    it accumulates, clips and steps itself, and writes its own checkpoint layout."""

    label = " (DeepSpeed)"

    def __init__(self, cfg: JobConfig, model: nn.Module, ds_engine, mesh: Mesh, device: torch.device, amp_dtype):
        super().__init__(cfg, model, ds_engine.optimizer, mesh, device, amp_dtype)
        self.ds = ds_engine

    def run(self, batches: list[dict], weights: list[float | None]) -> tuple[float, dict[str, float]]:
        return step_mod.run_deepspeed(self.ds, batches, weights, device=self.device, doc_mask=self.cfg.model.doc_mask)

    def reduce_gradients(self) -> None:
        pass  # DeepSpeed has reduced them in its backward

    def update(self, loss: float, allows, *, keep_grads: bool = False, also=()) -> tuple[float, bool]:
        """DeepSpeed clips and steps inside (``engine.step()`` at the accumulation boundary); a non-finite loss never
        reaches it. The spike guard can then only warn or stop: the step is applied."""
        if not math.isfinite(loss):
            return float("nan"), False
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if math.isfinite(norm):
            allows(loss, norm)
        return norm, True

    def load(self, path: Path) -> TrainerState:
        return CheckpointManager.load_deepspeed(path, self.ds, verify=False)

    def save(self, ckpt: CheckpointManager, state: TrainerState, config_yaml: str, tokenizer_dir: Path,
             background: bool) -> Path:
        return ckpt.save(state, self.model, self.optimizer, config_yaml, tokenizer_dir, mesh=self.mesh,
                         own_format=self._write_partitions, background=background)

    def _write_partitions(self, directory: Path) -> None:
        """DeepSpeed's own checkpoint layout: every rank writes its ZeRO partitions into ``directory``."""
        self.ds.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, save_latest=False)

    def full_grads(self, names: set[str]) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.ds.module.named_parameters():
            if name in names:
                g = safe_get_full_grad(p)  # ZeRO partitions gathered: a collective over the dp ranks
                if g is not None:
                    out[name] = g.detach().float().cpu().clone()
        return out


Engine = TorchEngine  # the interface: every engine is one (the others override what differs)
