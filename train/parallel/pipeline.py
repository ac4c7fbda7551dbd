"""Pipeline parallelism: the layers cut into stages, run by a torch.distributed.pipelining schedule.

Each rank builds only its stages' parts of the model: the cut is made on the meta device, before any weight
is allocated, and every part draws its initial weights from its own seeded stream, so they are those of the
whole model at any layout. The ``pp`` ranks of one (dp, tp) coordinate hold one stage each, or ``pp_stages_per_rank`` stages
each (stage s on pp rank s mod pp: interleaved schedules); the cuts are contiguous layer ranges whose summed
FLOPs estimates (``model/flops.py``: attention, delta-rule and MoE layers each cost what their matmuls and
mixer cost) are as equal as the layers allow, with the output layer counted on the last stage.

What each rank keeps is one ``GatedLM`` whose absent layers are ``None``: parameter names stay those of the
whole model, so the optimizer, the checkpoints (DCP: every stage writes its own tensors) and the export see
the usual names, and a checkpoint saved at one layout loads at any other. The stages are thin modules over
that model's blocks (``StageModule``); the schedule sends the hidden states between them, and the last one ends
with the LM's own output layer and loss (``GatedLM.output``: fused or vocabulary-parallel cross-entropy, z-loss),
the labels reaching it as a keyword argument.

- Document ids go to every stage with each micro-batch (keyword arguments reach all stages).
- MoE auxiliary losses are added to the backward of the stage that computed them: their gradient rides on the
  stage's output (``_with_aux``), so no stage needs another's loss.
- Tied embeddings: the first stage looks tokens up in ``embed_tokens``, the last stage holds a copy of it as
  its output layer; the two gradients are summed after each backward, so both copies take the same steps.
- The gradient norm is the norm over every stage (the tied copy counted once), and clipping uses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridtron.configs import JobConfig
from hybridtron.model.flops import layer_flops


def balance(costs: list[float], n_stages: int, last_extra: float = 0.0) -> list[range]:
    """Contiguous, non-empty ranges of layer indices, one per stage, minimising the largest stage's summed cost;
    ``last_extra`` is added to the last stage (the output layer). Exact dynamic programme, O(stages x layers^2)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n} layers cannot fill {n_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest bottleneck of the first i layers in k stages; back[k][i]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    back = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            extra = last_extra if k == n_stages else 0.0
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    bounds, i = [n], n
    for k in range(n_stages, 0, -1):
        i = back[k][i]
        bounds.append(i)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def stage_ranges(cfg: JobConfig, vocab_size: int) -> list[range]:
    """The layer range of every pipeline stage of ``cfg``, the output layer's cost counted on the last stage."""
    per_layer, head = layer_flops(cfg.model, vocab_size, cfg.data.seq_len)
    return balance(per_layer, cfg.parallel.pp * cfg.parallel.pp_stages_per_rank, last_extra=head)


class _WithAux(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux`` the gradient 1: the stage's auxiliary loss joins
    the training loss without leaving the stage."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_meta = (aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux_meta
        return grad, torch.ones((), dtype=dtype, device=device)


class StageModule(nn.Module):
    """One pipeline stage over the blocks of the rank's cut ``GatedLM``: token ids (first stage) or hidden states
    in; hidden states, or logits (last stage), out. Submodules keep the whole model's names."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool, seq_split: int = 1):
        super().__init__()
        self.first, self.last = first, last
        self.seq_split = seq_split  # tensor parallel: hidden states between stages hold T / tp positions
        self.embed_tokens = model.embed_tokens if first else None
        self.rotary = model.rotary
        self.layers = nn.ModuleList()
        for i in range(len(model.layers)):  # absent layers as None: the names stay layers.<i>
            self.layers._modules[str(i)] = model.layers[i] if i in layers else None
        # The output layer's modules, registered here so that data parallelism over the stage manages them;
        # ``_output`` (the LM's own loss: fused kernel, z-loss, vocabulary-parallel) runs them. Tied embeddings: the
        # last stage's output layer is its own copy of the embedding (see ``cut``).
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.tied_head = model.embed_tokens if last and model.lm_head is None else None
        self._output = model.output
        self.aux_seen = []  # detached auxiliary losses of this step's forwards, for the logged loss

    @property
    def context_parallel(self):
        """The LM's context-parallel hooks (train/parallel/context_parallel.py), or None."""
        return self._output.__self__.context_parallel

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states out, or on the last stage the micro-batch's language-model loss (``labels`` reach every
        stage as a keyword argument; the schedule's loss function passes it on), times the micro-batch's weight
        (``loss_weight``: one per row, all equal; train/step.py)."""
        h = self.embed_tokens(x) if self.first else x
        T = x.shape[1] if self.first else x.shape[1] * self.seq_split
        cp = self.context_parallel
        if cp is not None:  # context parallel: x is this rank's piece of each sequence, at global positions
            cp.begin(doc_ids)
            cos, sin = (t[cp.positions(T, t.device)] for t in self.rotary(cp.n * T))
        else:
            cos, sin = self.rotary(T)
        for layer in self.layers:
            if layer is not None:
                h = layer(h, cos, sin, None, doc_ids, None)  # documents as ids, as in the whole model
        if self.last:
            # (1,): the schedule concatenates the micro-batches' outputs. A new tensor, not a view of the loss: FSDP2
            # warns of a stage returning a view (an in-place op on it would skip the pre-backward hook)
            h = self._output(h, labels).reshape(1)
            h = h * loss_weight[:1] if loss_weight is not None else h.clone()
        auxes = [m.aux_loss for m in self.layers.modules() if getattr(m, "aux_loss", None) is not None]
        if auxes and torch.is_grad_enabled():
            aux = torch.stack([a.float() for a in auxes]).sum()
            self.aux_seen.append(aux.detach().float())
            h = _WithAux.apply(h, aux)
        return h


def stage_loss(loss: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: the last stage already computed the loss, with the LM's own code."""
    return loss.sum()


def stage_ids(cfg: JobConfig, pp_rank: int) -> list[int]:
    """The pipeline stages pp rank ``pp_rank`` runs (several when interleaved: every pp-th stage); [0] outside a
    pipeline."""
    p = cfg.parallel
    return [pp_rank + k * p.pp for k in range(p.pp_stages_per_rank)] if p.pp > 1 else [0]


def n_stages(cfg: JobConfig) -> int:
    """How many pipeline stages the model is cut into (1 outside a pipeline)."""
    p = cfg.parallel
    return p.pp * p.pp_stages_per_rank if p.pp > 1 else 1


def rank_cut(cfg: JobConfig, mesh, vocab_size: int):
    """``cut`` to the parts this rank's stages hold: applied to the model on the meta device, before its weights
    exist, so a rank materialises and initialises its stages only (``GatedLM.init_weights`` gives each part the
    weights it has in the whole model)."""
    ranges, ids = stage_ranges(cfg, vocab_size), stage_ids(cfg, mesh.pp_rank)
    keep = {i for s in ids for i in ranges[s]}
    return lambda model: cut(model, keep, 0 in ids, len(ranges) - 1 in ids)


def cut(model: nn.Module, keep: set[int], first: bool, last: bool) -> nn.Module:
    """Drop, in place, every part of ``model`` this rank's stages do not hold; absent layers become None.
    Cutting a cut model again changes nothing."""
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers._modules[str(i)] = None
    if not last:
        model.norm = None
        if model.lm_head is not None:
            model.lm_head = None
    if not first and not (last and model.lm_head is None):  # tied: the last stage keeps a copy as its head
        model.embed_tokens = None
    return model


def training_schedule(name: str, stages: list, n_micro: int):
    """torch's schedule ``name`` (``parallel.pp_schedule``) over this rank's ``stages`` (PipelineStage objects)
    for a step of ``n_micro`` micro-batches: what ``Pipeline`` trains with, and what the planner reads each pp
    rank's actions from (``plan.reduced.pipeline_orders``)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
            "zero_bubble": ScheduleInterleavedZeroBubble}[name]
    return kind(stages[0] if len(stages) == 1 else stages, n_microbatches=n_micro, loss_fn=stage_loss,
                scale_grads=True)


class Pipeline:
    """This rank's stages and the schedule that runs them; ``model`` is the cut GatedLM they share."""

    def __init__(self, cfg: JobConfig, model: nn.Module, mesh, device: torch.device, vocab_size: int):
        from torch.distributed.pipelining import PipelineStage

        p = cfg.parallel
        self.mesh, self.device = mesh, device
        self.n_micro = cfg.train.grad_accum_steps
        self.ranges = stage_ranges(cfg, vocab_size)
        n_stages = len(self.ranges)
        self.stage_ids = stage_ids(cfg, mesh.pp_rank)
        self.has_first, self.has_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.tied = cfg.model.tie_embeddings
        self.model = cut(model, {i for s in self.stage_ids for i in self.ranges[s]}, self.has_first, self.has_last)
        self.stages = [StageModule(model, self.ranges[s], s == 0, s == n_stages - 1, mesh.tp) for s in self.stage_ids]
        self._pp_group = mesh.device_mesh.get_group("pp")
        self._tied_group = self.mesh.pipeline_ends_group() if self.tied else None
        self._pipeline_stage = lambda module, s: PipelineStage(module, s, n_stages, device, group=self._pp_group)
        self._schedule_name = p.pp_schedule
        self.schedule = self._eval_schedule = None  # built by ``finish`` once data parallel wraps the stages
        self._warm = False

    def relink_layers(self) -> None:
        """Point the stages at the model's blocks again, after activation checkpointing replaced them by wrappers
        (``parallelize``): a stage holds the very modules of the model it was cut from."""
        for stage in self.stages:
            for i, layer in stage.layers._modules.items():
                if layer is not None:
                    stage.layers._modules[i] = self.model.layers[int(i)]

    def finish(self) -> None:
        """Build the schedules over the (now tensor/data parallel) stage modules."""
        from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS

        train_stages = [self._pipeline_stage(m, s) for m, s in zip(self.stages, self.stage_ids, strict=True)]
        eval_stages = [self._pipeline_stage(m, s) for m, s in zip(self.stages, self.stage_ids, strict=True)]
        single = len(train_stages) == 1
        self.schedule = training_schedule(self._schedule_name, train_stages, self.n_micro)
        # Evaluation: one micro-batch at a time, forward only, on stage objects of its own (shapes inferred apart).
        self._eval_schedule = (ScheduleGPipe(eval_stages[0], n_microbatches=1, loss_fn=stage_loss) if single else
                               ScheduleLoopedBFS(eval_stages, n_microbatches=1, loss_fn=stage_loss))

    def _run(self, schedule, batch: dict, train: bool) -> list[torch.Tensor]:
        kwargs = {k: batch[k] for k in ("doc_ids", "labels", "loss_weight") if k in batch}
        args = (batch["input_ids"],) if self.has_first else ()
        losses: list[torch.Tensor] = []
        target = batch["labels"] if self.has_last else None
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, target=target, losses=losses, **kwargs)
        return losses

    def _warm_up(self, batch: dict) -> None:
        """One step on a batch of zeros, its gradients and statistics then dropped. torch's stages learn the
        shapes they exchange from a first forward (real or on uninitialised memory), which would otherwise land in
        the first step's MoE expert loads and logged auxiliary loss."""
        self._run(self.schedule, {k: torch.zeros_like(v) for k, v in batch.items()}, train=True)
        for p in self.model.parameters():
            p.grad = None
        for m in self.model.modules():
            if hasattr(m, "reset_stats"):
                m.reset_stats()
        self._warm = True

    def step(self, batch: dict) -> float:
        """Forward and backward of one step's micro-batches (``batch``: all of them, concatenated in order, with
        ``loss_weight`` per row where the micro-batches' tokens weigh differently). Returns this rank's loss
        (train/step.py: the micro-batches' weighted cross-entropy plus every stage's auxiliary losses, over
        the micro-batches)."""
        if not self._warm:
            self._warm_up(batch)
        for stage in self.stages:
            stage.aux_seen.clear()
        losses = self._run(self.schedule, batch, train=True)
        local = sum(float(x.detach().float()) for x in losses) / self.n_micro if losses else 0.0
        local += sum(float(a) for stage in self.stages for a in stage.aux_seen) / self.n_micro
        if self._tied_group is not None:
            self._sum_tied_grads()
        return self.mesh.pp_sum(local)

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        """The validation loss of one micro-batch (cross-entropy plus auxiliary losses), on every rank."""
        losses = self._run(self._eval_schedule, batch, train=False)
        local = (float(losses[0].float()) if losses else 0.0) + float(self.model.aux_loss())  # this rank's layers
        return self.mesh.pp_sum(local)

    def _sum_tied_grads(self) -> None:
        weight = self.model.embed_tokens.weight
        if weight.grad is not None:
            grad = weight.grad
            if hasattr(grad, "to_local"):  # a DTensor: the two copies' gradients must be laid out alike
                if grad.placements != weight.placements:  # the tp embedding's gradient arrives replicated
                    weight.grad = grad = grad.redistribute(weight.device_mesh, weight.placements)
                grad = grad.to_local()
            dist.all_reduce(grad, group=self._tied_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip every stage's gradients by their global norm (over all stages and shards); returns that norm."""
        from hybridtron.train.parallel.grad_norm import clip_grad_norm

        params = list(self.model.parameters())
        counted = [p for p in params if not (self.tied and self.has_last and not self.has_first
                                             and p is self.model.embed_tokens.weight)]
        return clip_grad_norm(params, max_norm, counted=counted, sum_other_ranks=self.mesh.pp_sum)

    def metrics_from_all_stages(self, metrics: dict) -> dict:
        """Per-layer metrics (MoE loads) of every stage, merged on every rank of the pipeline."""
        if self.mesh.pp == 1:
            return metrics
        gathered = [None] * self.mesh.pp
        dist.all_gather_object(gathered, metrics, group=self._pp_group)
        return {k: v for part in gathered for k, v in part.items()}
