"""A planned rank's memory from reduced traces, extrapolated per layer kind: what makes ``hybridtron plan`` take
seconds where tracing every layer took minutes (``memory.step_peak``, still the reference: ``exact=True``).

Layers of one kind (``layer_kinds``: the same modules, parameter shapes and activation-checkpointing wrapper, so
the same mixer, feed-forward and recomputation) hold the same weights, gradients, optimizer state and saved
activations. Each pipeline stage of the rank (the whole model outside a pipeline) keeps its first ``HEAD`` and
last ``TAIL`` layers, and between them every layer of a kind that occurs there once; of a kind that occurs more
often its last layer is traced for all (``reduce``). The rank is traced once without those extra layers (the
base) and once with each of them, and every place of the step (forward, backward, clipping and optimizer, in
which layer: ``memory._PeakOnly``) is extrapolated on its own:

    M(place) = M_base(place) + sum over extra layers e of n(e) x (M_e(place) - M_base(place))

with n(e) the middle layers of e's kind in its stage; the rank's peak is the largest place, and its categories
those of that place. Communication's parameter and layer counts come from the whole rank (``rank_facts``).

Exact, and checked to the byte against the full trace by ``tests/train/test_plan_reduced.py`` (dense, hybrid,
MoE, one micro-batch or several, bf16, recomputation of every block or every other, tp 2, two pipeline stages,
ZeRO 0/2/3; within 64 bytes, a few scalars): the embedding, output layer, loss, receive buffers, the layers at
the ends of each stage and every place outside the middle layers, where each middle layer holds what the traced
one of its kind holds. Bounded: a place inside a middle layer (its own transients beside the others) counts every
other middle layer at the most it holds at any place outside them. Not modelled: what a middle layer's neighbour
leaves behind for it that differs by kind (FSDP2 prefetching the next block's weights, a reduce-scatter buffer
waiting for the next) at places of the layers next to the middle, which are not where a step peaks in the
tests' models or the presets.

The steps are ``ready_rank``'s ``quick`` ones (one tracked micro-batch on the gradients of an earlier one, a
pipeline's first step one micro-batch per stage; a 1F1B stage's later steps on two of its warm-up forwards and
two pairs, one trace for the stages alike in all else: ``memory.ReplayedSchedule.shorten``), on one build per
rank for the base and every extra layer (those a step leaves out still hold their weights, gradients and
optimizer state, taken back out of the base), and, for ZeRO-2 and 3, on one build for both (``plan_rank``). With
``jobs`` above 1 the traces of one build run side by side, each in a process forked from the built rank
(``workers.Workers``), and so do the distinct ranks (``plan_ranks``; which pipeline stages are alike is known
before any is built: ``pipeline_orders``)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools

import torch

from hybridtron.configs import JobConfig
from hybridtron.train.plan.memory import (
    PAIRS,
    WARM_UPS,
    categories,
    fake_modes,
    fake_world,
    held_by,
    pipeline_orders,
    planned_ranks,
    ready_rank,
    shortened,
    simulate,
    tracked_step,
    with_zero_stage,
)
from hybridtron.train.plan.workers import Workers

# Layers of each stage traced at its ends, with the neighbours whose leftovers they run beside (FSDP2's prefetch
# of the next block's weights in the backward, a reduce-scatter buffer waiting for the next block's): the last
# three (the top of the backward, where a step usually peaks, and the layer whose backward prefetches a middle
# layer's weights: with two, hybrid_moe's ZeRO-3 plan on 64 nodes was 30 MB low, the middle layer traced for its
# attention layers prefetching their weights where the whole model prefetches a Gated DeltaNet layer's) and the
# first two (the end of the backward, where a step peaks when the gradients are made there: one micro-batch, every
# block recomputed; with one, a 6-layer tiny_moe so planned under ZeRO-2 came out 9.8% high, 9.32 for 8.49 MB).
HEAD, TAIL = 2, 3


def _signature(block: torch.nn.Module) -> tuple:
    """What makes two layers hold the same memory: their modules (classes, names: the mixer, the feed-forward,
    an activation-checkpointing wrapper) and their parameters' and buffers' shapes and dtypes."""
    tensors = itertools.chain(block.named_parameters(), block.named_buffers())
    return (tuple((name, type(m).__qualname__) for name, m in block.named_modules()),
            tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def layer_kinds(cfg: JobConfig, vocab: int) -> list[int]:
    """One number per layer, equal for layers of one kind: the model built on the meta device (nothing allocated)
    and wrapped for recomputation as ``parallelize`` wraps it (every k-th block under
    ``train.activation_checkpointing_every``)."""
    from hybridtron.model import GatedLM
    from hybridtron.train.parallel.parallelize import apply_activation_checkpointing, checkpointing_mode

    with torch.device("meta"):
        model = GatedLM(cfg.model, vocab)
    t = cfg.train
    apply_activation_checkpointing(model, checkpointing_mode(t), t.activation_checkpointing_every)
    seen: dict[tuple, int] = {}
    return [seen.setdefault(_signature(block), len(seen)) for block in model.layers]


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The layers that stand for one rank: ``like`` maps every layer of the rank to the layer built for it (itself
    at the ends of a stage, else the stage's ``extra`` layer of its kind), ``count`` how many middle layers of each
    (stage, kind) the rank holds."""

    like: dict[int, int]
    extra: dict[tuple[int, int], int]
    count: dict[tuple[int, int], int]


def stage_ids(cfg: JobConfig, world: int, rank: int) -> list[int]:
    """The pipeline stages ``rank`` of ``world`` runs (Mesh.pp_rank: pp outermost); [0] without one."""
    from hybridtron.train.parallel.pipeline import stage_ids as of_pp_rank

    return of_pp_rank(cfg, rank // (world // cfg.parallel.pp))


def rank_stages(cfg: JobConfig, world: int, rank: int, vocab: int) -> list[range]:
    """The layer ranges of the pipeline stages ``rank`` holds (the whole model outside a pipeline)."""
    if cfg.parallel.pp == 1:
        return [range(cfg.model.n_layers)]
    from hybridtron.train.parallel.pipeline import stage_ranges

    ranges = stage_ranges(cfg, vocab)
    return [ranges[s] for s in stage_ids(cfg, world, rank)]


def reduce(stages: list[range], kinds: list[int]) -> Reduction:
    """Each stage's first ``HEAD`` and last ``TAIL`` layers, and between them every layer of a kind that occurs
    there once; of a kind that occurs more often, its last layer stands for all (the module docstring)."""
    like, extra, count = {}, {}, {}
    for s, layers in enumerate(stages):
        layers = list(layers)
        middle = layers[HEAD:-TAIL] if len(layers) > HEAD + TAIL else []
        by_kind: dict[int, list[int]] = {}
        for i in middle:
            by_kind.setdefault(kinds[i], []).append(i)
        like.update((i, i) for i in layers)
        for kind, group in by_kind.items():
            if len(group) > 1:
                extra[(s, kind)], count[(s, kind)] = group[-1], len(group)
                like.update((i, group[-1]) for i in group)
    return Reduction(like, extra, count)


def _combine(base: dict, held: dict, plus: dict, count: dict) -> dict:
    """The extrapolated memory (bytes by plan category) at one place of the step, from its base value, the tracked
    steps with one extra layer each (``plus``: layer -> value; ``held``: layer -> its weights, gradients and
    optimizer state, counted in every tracked step) and the middle layers' counts (``count``: layer -> n)."""
    return {k: v - sum(h.get(k, 0.0) for h in held.values())
            + sum(n * (plus[e][k] - v + held[e].get(k, 0.0)) for e, n in count.items()) for k, v in base.items()}


def _trace(ready, e: int | None, extras: list[int], warm_ups=(None,), zero_stage: int | None = None) -> tuple:
    """One tracked step of ``ready`` for ``_extrapolate``: with the extra layer ``e`` (None: the base, without any),
    the other extra layers left out. Returns its places' memory by category for each of ``warm_ups`` (None: the
    rank's own schedule, or a number of warm-up forwards to add to a shortened 1F1B trace,
    ``ReplayedSchedule.shorten``: the plan of a stage alike in all but those), and for the base what each extra layer
    holds throughout (weights, gradients, optimizer state), else None. ``zero_stage``: first switch the build to that
    FSDP stage (``plan_rank``)."""
    if zero_stage is not None:
        ready = _at_zero_stage(ready, zero_stage)
    cfg, mesh = ready.cfg, ready.mesh
    # Where the gradients stay from step to step (``ready_rank``'s ``quick``), a step with one more layer ends its
    # backward where the base does: every layer's weights, gradients and optimizer state (the left-out ones
    # counted), no activation; the clipping (of every layer's gradients, left out or not) and the optimizer step
    # (of every parameter) after it hold the same, so they run in the base step only: a third of a step's CPU.
    tracker = tracked_step(ready, left_out=[x for x in extras if x != e], places=True,
                           update=e is None or not _base_only(ready))
    places = {t: {place: categories(snap, cfg, mesh)
                  for place, snap in (tracker.segments if t is None else tracker.shifted(t)).items()} for t in warm_ups}
    held = None
    if e is None:
        held = {x: categories(held_by(tracker, ready.model.layers[x], ready.optimizer), cfg, mesh) for x in extras}
    return places, held


def _base_only(ready) -> bool:
    return not ready.zero_grad  # (``quick`` outside a pipeline: gradients kept from step to step)


def _at_zero_stage(ready, z: int):
    """``ready`` switched to ZeRO stage ``z`` (2 or 3) on the same build: FSDP2 frees each block's gathered weights
    after its forward or not (``set_reshard_after_forward``, what ``apply_data_parallel`` sets from the stage)."""
    from torch.distributed.fsdp import FSDPModule

    if ready.mesh.zero_stage == z:
        return ready
    for block in ready.model.layers:
        if isinstance(block, FSDPModule):
            block.set_reshard_after_forward(z == 3, recurse=False)
    return dataclasses.replace(ready, cfg=with_zero_stage(ready.cfg, z), mesh=dataclasses.replace(ready.mesh, zero_stage=z))


def _extrapolate(traces: list[tuple], extras: list[int], count: dict[int, int], base_only: bool,
                 warm_ups=(None,)) -> list[dict]:
    """The rank's memory by plan category (``plan_rank``'s docstring), one for each of ``warm_ups``, from its
    ``_trace`` results: the base's, then one per extra layer, in the order of ``extras``."""
    (base, held), *plus = traces
    places = {t: {None: base[t], **{e: p[t] for e, (p, _) in zip(extras, plus, strict=True)}} for t in warm_ups}
    return [_peak(places[t], held, extras, count, base_only) for t in warm_ups]


def _peak(places: dict, held: dict, extras: list[int], count: dict[int, int], base_only: bool) -> dict:
    """The largest extrapolated place (``_extrapolate``) from each tracked step's places (``places``: extra layer
    or None for the base -> place -> memory by category)."""
    base, plus = places[None], {e: dict(places[e]) for e in extras}
    for e in extras:  # the places after the backward, as in the base
        last = max(place[0] for place in plus[e])
        plus[e].update((place, v) for place, v in base.items() if place[0] > last and base_only)
    candidates = [_combine(v, held, {e: plus[e][place] for e in extras}, count) for place, v in base.items()]
    # a layer of each middle kind where it holds the most, outside the middle layers (the same for the others)
    most = {x: max(base, key=lambda p, x=x: plus[x][p]["total"] - base[p]["total"]) for x in extras}
    others = {x: {k: plus[x][most[x]][k] - base[most[x]][k] + held[x].get(k, 0.0) for k in base[most[x]]}
              for x in extras}
    for e in extras:  # places inside the middle layer e: the others at their most
        for place, v in plus[e].items():
            if place[2] == e:
                candidates.append({k: v[k] - sum(held[x].get(k, 0.0) for x in extras if x != e)
                                   + sum((n - (x == e)) * others[x][k] for x, n in count.items()) for k in v})
    return max(candidates, key=lambda m: m["total"])


def plan_rank(cfg: JobConfig, world: int, rank: int, zero_stages=(0,), kernels: str = "gpu",
              kinds: list[int] | None = None, note=None, alike: dict[int, int] | None = None,
              jobs: int = 1) -> dict[int, dict]:
    """``step_peak``'s result ({"memory", "facts"}) for ``rank`` of a ``world``-process job at each of
    ``zero_stages`` (those the layout accepts), from its reduced traces (module docstring): {zero stage: result}.
    ``kinds``: ``layer_kinds``'s, when known.
    ``note``: called with what is traced next (the ZeRO stage, the build or which step: progress). ``alike``:
    1F1B ranks whose stages differ from this one's in their warm-up forwards only (``_alike_in_1f1b``), each with
    the number to add to the shortened trace's: the result is then {zero stage: {rank: result}}, ``rank`` and
    each of them planned from the same traces (``ReplayedSchedule.shorten``). ``jobs``: processes tracing at once
    (``workers.Workers``: each trace forked from the built rank).

    The base and the one-layer-more traces share one build and first step: the rank is built with every extra
    layer, and each tracked step leaves out the extra layers it is not about (``memory.tracked_step``), whose
    weights, gradients and optimizer state the tracker still counts; those (``held_by``) are taken back out of
    the base, and each added layer's are its own. The ZeRO stages share one fake world (process groups, device
    mesh and DTensor's cache of sharding rules: 25 ms per op it has not seen), and ZeRO-2 and 3 one build too:
    they differ only in whether FSDP2 frees a block's gathered weights after its forward
    (``set_reshard_after_forward``, what ``apply_data_parallel`` sets from the stage).

    The peak is extrapolated place by place (``memory._PeakOnly``: the forward, backward or optimizer step, in
    which layer), then the largest taken: the traces can peak at different places (with every other block
    recomputed, the base at the loss's backward and the base with one more plain layer in the last layer's), and
    so can the whole rank. A place inside a middle layer is one layer running beside the others: it is bounded by
    counting every other middle layer at the most it holds at any place outside the middle."""
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    red = reduce(rank_stages(cfg, world, rank, vocab), kinds or layer_kinds(cfg, vocab))
    extras = sorted(set(red.extra.values()))
    count = {red.extra[key]: n for key, n in red.count.items()}  # each extra layer stands for its kind alone
    builds = [[z] for z in zero_stages if z == 0] + [[z for z in zero_stages if z != 0]]
    ranks = list(alike or ())
    warm_ups = [alike[r] for r in ranks] if alike else [None]
    out = {}
    workers = Workers(jobs, note)
    with fake_world(with_zero_stage(cfg, zero_stages[0]), world, rank) as mesh, fake_modes(cfg, kernels):
        for zs in (b for b in builds if b):
            cz = with_zero_stage(cfg, zs[0])
            workers.say(f"{' and '.join(f'ZeRO-{z}' for z in zs)}: building the rank and its first step")
            ready = shortened(ready_rank(cz, dataclasses.replace(mesh, zero_stage=zs[0]), True, torch.device("cpu"),
                                         quick=True, like=red.like))
            if alike and not getattr(ready.runs.schedule(), "warm_up", None):
                raise ValueError(f"rank {rank}'s trace cannot stand for other stages' warm-ups")
            steps = [(z, n, e) for z in zs for n, e in enumerate([None, *extras])]

            def trace(z, n, e, ready=ready, first=zs[0]):
                workers.say(f"ZeRO-{z}: tracing step {n + 1}/{len(extras) + 1}")
                return _trace(ready, e, extras, warm_ups, z if z != first else None)

            traces = workers.map([functools.partial(trace, *step) for step in steps])
            for z in zs:
                mine = [t for (zt, _, _), t in zip(steps, traces, strict=True) if zt == z]
                memory = _extrapolate(mine, extras, count, _base_only(ready), warm_ups)
                if not alike:
                    out[z] = {"memory": memory[0], "facts": ready.facts}
                    continue
                out[z] = {r: {"memory": m, "facts": {**copy.deepcopy(ready.facts), "stages": stage_ids(cfg, world, r)}}
                          for r, m in zip(ranks, memory, strict=True)}
    return out


def _alike_in_1f1b(cfg: JobConfig, world: int, ranks: list[int], vocab: int, kinds: list[int]) -> dict[int, dict]:
    """1F1B ranks (one stage each) whose shortened traces are the same (``ReplayedSchedule.shorten``): stages
    alike in place (first, last or between) and layer kinds, each with at least ``WARM_UPS`` warm-up forwards
    and ``PAIRS`` (forward, backward) pairs, so traced on the same actions. {the first of each such group: {rank: its
    warm-ups beyond ``WARM_UPS``}} (itself among them), for groups of more than one."""
    p = cfg.parallel
    if p.pp == 1 or p.pp_schedule != "1f1b" or p.pp_stages_per_rank != 1:
        return {}
    groups: dict[tuple, dict[int, int]] = {}
    for rank in ranks:
        (s,) = stage_ids(cfg, world, rank)
        w = p.pp - 1 - s
        if w >= WARM_UPS and cfg.train.grad_accum_steps - w >= PAIRS:
            (layers,) = rank_stages(cfg, world, rank, vocab)
            key = (s == 0, s == p.pp - 1, tuple(kinds[i] for i in layers))
            groups.setdefault(key, {})[rank] = w - WARM_UPS
    return {next(iter(g)): g for g in groups.values() if len(g) > 1}


def _signature_of_rank(cfg: JobConfig, world: int, rank: int, vocab: int, kinds: list[int], orders) -> tuple:
    """What a rank's plan depends on beyond its shard: each of its stages' place (first, last) and layer kinds,
    and its schedule's actions (``orders``: pp rank -> actions) with its stages numbered locally. Two pipeline
    stages alike in all of it hold the same memory (GPipe's middle stages of one layer count, say)."""
    from hybridtron.train.parallel.pipeline import n_stages as count_stages

    n_stages, ids = count_stages(cfg), stage_ids(cfg, world, rank)
    pp_rank = ids[0]
    stages = rank_stages(cfg, world, rank, vocab)
    actions = tuple((ids.index(a.stage_index), a.computation_type.value) for a in orders[pp_rank])
    return (tuple((s == 0, s == n_stages - 1, tuple(kinds[i] for i in r)) for s, r in zip(ids, stages, strict=True)),
            actions)


def plan_ranks(cfg: JobConfig, world: int, zero_stages=None, kernels: str = "gpu", exact: bool = False,
               note=None, jobs: int = 1) -> dict[int, dict[int, dict]]:
    """Every planned rank of ``cfg`` on ``world`` processes (the first of each pipeline stage: the others differ
    by their shard only) at each of ``zero_stages`` (default the config's; those the layout accepts):
    {zero stage: {rank: result}}. A pipeline stage alike in everything to another (``_signature_of_rank``, known
    from the schedule's actions, ``pipeline_orders``) takes its result. ``exact``: every layer traced
    (``memory.step_peak``, the reference the extrapolation is tested against). ``note``: called with what is
    planned next (progress). ``jobs``: processes planning at once (``workers.Workers``): the distinct ranks side
    by side, each rank's traces side by side too."""
    zero_stages = tuple(zero_stages or (cfg.parallel.zero_stage,))
    if exact:
        if note is not None:
            note("every rank, every layer traced")
        return {z: simulate(with_zero_stage(cfg, z), world, kernels) for z in zero_stages}
    ranks = planned_ranks(cfg, world)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    kinds = layer_kinds(cfg, vocab)
    alike = _alike_in_1f1b(cfg, world, ranks, vocab, kinds)
    workers = Workers(jobs, note)

    def which(rank: int) -> str:
        n = ranks.index(rank)
        text = f"pipeline stage {n + 1}/{len(ranks)} (rank {rank})" if len(ranks) > 1 else "rank 0"
        if rank in alike:
            text += " and " + ", ".join(f"{ranks.index(r) + 1}" for r in alike[rank] if r != rank) + " alike"
        return text

    def plan(rank: int) -> dict:
        said = which(rank)
        workers.say(said)
        return plan_rank(cfg, world, rank, zero_stages, kernels, kinds, lambda what: workers.say(f"{said}, {what}"),
                         alike.get(rank), jobs)

    out = {z: {} for z in zero_stages}

    def take(rank: int, results: dict) -> None:
        for z in zero_stages:
            if rank in alike:
                out[z].update(results[z])
            else:
                out[z][rank] = results[z]

    covered = {r for first in alike for r in alike[first]}
    orders = pipeline_orders(cfg)
    same: dict[int, int] = {}  # rank -> the planned rank alike in everything
    todo, seen = [], {}
    for rank in ranks:
        if rank in covered and rank not in alike:  # planned with the first stage alike to it
            continue
        key = _signature_of_rank(cfg, world, rank, vocab, kinds, orders) if orders is not None else None
        if key is not None and key in seen:
            same[rank] = seen[key]
            continue
        if key is not None:
            seen[key] = rank
        todo.append(rank)
    for rank, results in zip(todo, workers.map([functools.partial(plan, r) for r in todo]), strict=True):
        take(rank, results)
    for rank, like in same.items():  # the same plan: its own stage ids for the communication
        for z in zero_stages:
            out[z][rank] = copy.deepcopy(out[z][like])
            out[z][rank]["facts"]["stages"] = stage_ids(cfg, world, rank)
    return out
