"""One training step's forward and backward: a runner per engine (torch, pipeline, DeepSpeed), and the loss weights
that make the step's gradient the global batch's.

The loss of a step is the sum of every labelled token's loss over all micro-batches and data- (and context-)
parallel ranks, divided by the global number of labelled tokens (as torchtitan normalises), plus the mean of the
auxiliary losses (MoE balance, router z-loss, HAX ranking) over the micro-batches. The model's loss is the mean over
its micro-batch's labelled tokens, and data parallelism averages gradients over the ranks; so micro-batch i of
rank r weighs its mean by

    c_ri = n_ri * accum * ranks / N          (n_ri its labelled tokens, N the sum of n over the step and the ranks)

and is then divided by ``accum`` as before. Where every micro-batch holds as many labelled tokens (packed text,
every position labelled) c = 1.0 exactly and nothing is multiplied: the step is bitwise what a mean of the
micro-batches' means gives. Where they differ (synthetic tasks label only answers; any masked label), a
mean of means would weigh a token of a sparse micro-batch more than one of a dense micro-batch.

Every runner returns this rank's loss in those units, (1 / accum) * sum_i (c_i * lm_i + aux_i): its mean over the
data ranks is the step's loss as defined above, and that is the number logged.
"""

from __future__ import annotations

import torch

from hybridtron.data_pipeline.synthetic import IGNORE as IGNORE_INDEX  # a position without a label
from hybridtron.train.device import autocast_context, step_weight_casts
from hybridtron.train.parallel.context_parallel import local_piece
from hybridtron.train.watchdog import phase


def micro_batches(loader, accum: int, mesh) -> list[dict]:
    """The step's ``accum`` micro-batches as this rank takes them (its piece of each sequence under context
    parallel), still on the host."""
    return [local_piece(next(loader), mesh) for _ in range(accum)]


def loss_weights(batches: list[dict], mesh) -> list[float | None]:
    """Each micro-batch's c (see the module's docstring), None where it is exactly 1. One all-reduce of the
    labelled-token count over the data ranks; a micro-batch without any labelled token gets weight 0 and one
    stand-in label, so that its loss (a mean over nothing, NaN) stays finite and its backward (every rank must
    run it: gradient reductions are collectives) adds exactly zero. A step without any labelled token anywhere
    keeps weight 1: its NaN loss skips the update as a non-finite one would."""
    counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
    total = mesh.total(sum(counts))
    if total == 0:
        return [None] * len(batches)
    scale = len(batches) * mesh.data_ranks
    weights = []
    for b, n in zip(batches, counts, strict=True):
        if n == 0:
            b["labels"] = b["labels"].clone()
            b["labels"].view(-1)[0] = 0  # any id: the loss it makes is multiplied by 0
        c = n * scale / total  # integers until this one division: 1.0 exactly where every count is equal
        weights.append(None if c == 1.0 else c)
    return weights


def batch_keys(doc_mask: bool) -> tuple[str, ...]:
    """What of a batch the model reads: its document ids only when it masks documents (``model.doc_mask``)."""
    return ("input_ids", "labels", "doc_ids") if doc_mask else ("input_ids", "labels")


def _to(batch: dict, device, doc_mask: bool) -> dict:
    return {k: batch[k].to(device, non_blocking=True) for k in batch_keys(doc_mask)}


def _weight(c: float | None, device) -> dict:
    """The model's ``loss_weight`` keyword, left out where the weight is 1 (the call then is today's exactly)."""
    return {} if c is None else {"loss_weight": torch.tensor(c, dtype=torch.float32, device=device)}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (a tensor-parallel loss, a sharded gradient or norm) as a plain tensor; others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# The modules whose ``aux_loss`` the model adds to the language-model loss, and the metric each kind is logged as.
AUX_NAMES = {"MoE": "moe_aux_loss", "HAX": "hax_ranking_loss"}


def aux_terms(model) -> dict[str, torch.Tensor]:
    """The auxiliary losses of the model's last forward by kind, summed over the layers, detached: the tensors
    GatedLM.aux_loss adds to the loss (MoE balance and router z-loss, already weighted; HAX's ranking loss)."""
    out: dict[str, torch.Tensor] = {}
    for m in model.modules():
        a = getattr(m, "aux_loss", None)
        if isinstance(a, torch.Tensor):  # GatedLM's own aux_loss is the method that sums these
            name = AUX_NAMES.get(type(m).__name__, f"{type(m).__name__.lower()}_aux_loss")
            out[name] = out.get(name, 0.0) + whole(a.detach()).float()
    return out


def _mean_aux(sums: dict[str, torch.Tensor], accum: int) -> dict[str, float]:
    return {k: (v / accum).item() for k, v in sums.items()}


def _add(sums: dict, terms: dict) -> None:
    for k, v in terms.items():
        sums[k] = sums.get(k, 0.0) + v


def run_torch(model, batches: list[dict], weights: list[float | None], *, device, amp_dtype, doc_mask: bool,
              replicated: bool, sharded: bool, hsdp_modules) -> tuple[float, dict[str, float]]:
    """Forward and backward of every micro-batch on a plain, DDP, FSDP2, tensor-, expert- or context-parallel
    model; returns this rank's loss (module docstring), not yet averaged over the data ranks, and the auxiliary
    losses in it by kind (``aux_terms``, in the same units: the loss less their sum is the language-model loss).
    ``replicated``, ``sharded``, ``hsdp_modules``: what data parallel applied (train/parallel/parallelize.py's
    ``Parallelized``)."""
    accum = len(batches)
    loss_sum = torch.zeros((), device=device)
    aux_sums: dict[str, torch.Tensor] = {}
    # Replicated (DDP) gradients are all-reduced once per step, after the last micro-batch. Sharded ones are
    # reduce-scattered after every micro-batch: holding them unsharded until the last would cost the memory
    # ZeRO-2/3 exists to save. Under hybrid sharding the shards are all-reduced across the replica groups (across
    # nodes) once, after the last micro-batch: until then each group accumulates its reduce-scattered shards.
    sync_last_only = replicated and accum > 1
    hsdp = hsdp_modules if accum > 1 else []
    # bf16 copies of the weights made once per step (not per micro-batch) and reused by every micro-batch
    with step_weight_casts(device, amp_dtype, enabled=not sharded):
        # (by index: zip's reused result tuple would keep the first micro-batch alive through the loop, on the
        # device where the planner makes them, train/plan/memory.py)
        for i, c in enumerate(weights):
            if sync_last_only:
                model.set_requires_gradient_sync(i == accum - 1)
            for m in hsdp:
                m.set_requires_all_reduce(i == accum - 1, recurse=False)
            b = _to(batches[i], device, doc_mask)
            phase("forward")
            with autocast_context(device, amp_dtype):
                loss = model(b["input_ids"], b.get("doc_ids"), labels=b["labels"], **_weight(c, device))
            phase("backward")
            (loss / accum).backward()
            loss_sum += whole(loss.detach()).float()
            _add(aux_sums, aux_terms(model))
    return (loss_sum / accum).item(), _mean_aux(aux_sums, accum)


def run_pipeline(pipeline, batches: list[dict], weights: list[float | None], *, device, amp_dtype,
                 doc_mask: bool) -> float:
    """The micro-batches through the pipeline schedule (forwards and backwards interleaved over the stages); the
    last stage weighs each micro-batch's loss. Returns this rank's loss (module docstring), summed over the
    stages, not yet averaged over the data ranks."""
    b = {k: torch.cat([p[k] for p in batches]) for k in batch_keys(doc_mask)}
    if any(c is not None for c in weights):  # one weight per row: the schedule cuts kwargs into micro-batches
        rows = [torch.full((len(p["input_ids"]),), 1.0 if c is None else c, dtype=torch.float32)
                for p, c in zip(batches, weights, strict=True)]
        b["loss_weight"] = torch.cat(rows)
    b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
    phase("forward/backward")  # the schedule interleaves both over the stages
    with autocast_context(device, amp_dtype):
        return pipeline.step(b)


def run_deepspeed(engine, batches: list[dict], weights: list[float | None], *, device, doc_mask: bool
                  ) -> tuple[float, dict[str, float]]:
    """DeepSpeed's forward/backward/step per micro-batch: it steps the optimizer (clipping first) only at the
    accumulation boundary, which is left to the caller (``engine.step()`` after the last backward) so that a
    non-finite loss is never applied. Returns this rank's loss (module docstring) and its auxiliary losses, as
    ``run_torch``."""
    accum = len(batches)
    loss_sum = torch.zeros((), device=device)
    aux_sums: dict[str, torch.Tensor] = {}
    for i, (cpu_batch, c) in enumerate(zip(batches, weights, strict=True)):
        b = _to(cpu_batch, device, doc_mask)
        phase("forward")
        loss = engine(b["input_ids"], b.get("doc_ids"), labels=b["labels"], **_weight(c, device))
        phase("backward")
        engine.backward(loss)  # scaled by 1/accum inside
        loss_sum += loss.detach().float()
        _add(aux_sums, aux_terms(engine.module))
        if i < accum - 1:
            engine.step()
    return (loss_sum / accum).item(), _mean_aux(aux_sums, accum)


def eval_loss(model, batch: dict) -> float:
    """A validation micro-batch's mean loss (on the device, this rank's piece), as the model computes it."""
    return whole(model(batch["input_ids"], batch.get("doc_ids"), labels=batch["labels"])).float().item()


def tokens_of(batches: list[dict]) -> int:
    """The positions this rank processed (labelled or not): what tokens/s counts."""
    return sum(b["input_ids"].numel() for b in batches)
