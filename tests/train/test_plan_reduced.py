"""`hybridtron plan` from reduced traces (train/plan/reduced.py): the extrapolation per layer kind against the trace
of every layer (the reference, ``exact=True``), how layers are grouped into kinds and reduced, pipeline stages
planned once each, the progress line, and the time the command takes on the GPU presets."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from hybridtron.configs import load_config
from hybridtron.train.plan import layer_kinds, plan_ranks
from hybridtron.train.plan.progress import Progress
from hybridtron.train.plan.reduced import HEAD, TAIL, pipeline_orders, rank_stages, reduce

# 9 layers: 2 + 3 at the ends, 4 between them, so every kind below occurs at least twice in the middle and is
# extrapolated (a kind that occurs once there is traced as it is)
SMALL = [("model.n_layers", "9"), ("model.d_model", "64"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
         ("data.seq_len", "64"), ("train.micro_batch_size", "4"), ("train.dtype", "fp32"),
         ("train.grad_accum_steps", "2")]
CASES = {  # name: (preset, overrides, world, ZeRO stages): every kind and every stage, 10 to 35 s a case
    "dense": ("tiny", [], 4, (0, 2, 3)),
    "moe_bf16": ("tiny_moe", [("train.dtype", "bf16")], 4, (0, 2)),  # MoE on every other layer: two kinds
    "hybrid": ("tiny", [("model.layer_pattern", "LALALALAL")], 4, (2,)),  # Gated DeltaNet and attention: two kinds
    # every other block recomputed (two kinds, and the traces peak at different places: reduced.py, plan_rank), one
    # micro-batch (the gradients appear during the backward, so the peak can sit at its end: the first layer)
    "recompute_every_2_one_micro_batch": ("tiny", [("train.activation_checkpointing", "full"),
                                                   ("train.activation_checkpointing_every", "2"),
                                                   ("train.grad_accum_steps", "1")], 4, (0, 3)),
    "tp2": ("tiny", [("parallel.tp", "2")], 4, (3,)),
    # two pipeline stages (the output layer weighs on the last), 2 micro-batches, both in flight on stage 0 under 1F1B
    "pp2_1f1b": ("tiny", [("parallel.pp", "2"), ("model.n_layers", "18"), ("train.grad_accum_steps", "2"),
                          ("parallel.pp_schedule", "1f1b")], 4, (3,)),
}
# Bytes by which a plan may differ from the full trace: 64, sixteen fp32 scalars. Measured 2026-11-28: every case
# equal to the byte but three, by a few scalars whose lifetime is not a layer's: 4 bytes (tiny_moe under ZeRO-2: the
# traces run one micro-batch on top of an earlier one's gradients, and a scalar of the earlier one's step outlives
# it in the full trace), 12 to 52 (tp2: DTensor scalars of the loss). Anything a layer holds is larger: the smallest
# tensor of these layers is a 64-byte norm gain (head_dim 16, fp32), and a whole layer's state is ~200 kB.
TOLERANCE = 64


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_reduced_plan_is_the_full_trace(case):
    """The case's ZeRO stages, every planned rank, every memory category and the step's peak, and the facts
    communication is computed from: the extrapolation from reduced traces against the trace of every layer."""
    preset, over, world, stages = CASES[case]
    cfg = load_config(preset, [*SMALL, *over])
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    for rank in range(0, world, world // cfg.parallel.pp):  # every stage extrapolates: the check can fail
        assert reduce(rank_stages(cfg, world, rank, vocab), layer_kinds(cfg, vocab)).extra, (case, rank)
    reduced = plan_ranks(cfg, world, stages)
    full = plan_ranks(cfg, world, stages, exact=True)
    for z in stages:
        assert set(reduced[z]) == set(full[z]), (z, reduced[z].keys(), full[z].keys())
        for rank, ref in full[z].items():
            got = reduced[z][rank]
            for k, v in ref["memory"].items():
                assert abs(got["memory"][k] - v) < TOLERANCE, (case, z, rank, k, got["memory"], ref["memory"])
            assert got["facts"] == ref["facts"], (case, z, rank)


def test_layers_of_one_kind_hold_the_same_modules():
    """Kinds follow the config's per-layer choices: the mixer, MoE or dense feed-forward, recomputed or not."""
    def kinds(*over):
        cfg = load_config("tiny", [*SMALL, ("model.n_layers", "8"), *over])
        return layer_kinds(cfg, cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size))

    assert len(set(kinds())) == 1
    hybrid = kinds(("model.layer_pattern", "LLLA"))
    assert [hybrid.index(k) for k in hybrid] == [0, 0, 0, 3, 0, 0, 0, 3]
    moe = kinds(("model.moe.n_experts", "4"), ("model.moe.expert_hidden", "32"), ("model.moe.every", "2"))
    assert [moe.index(k) for k in moe] == [0, 1, 0, 1, 0, 1, 0, 1]  # layer i is MoE when (i + 1) % 2 == 0
    every2 = kinds(("train.activation_checkpointing", "full"), ("train.activation_checkpointing_every", "2"))
    assert [every2.index(k) for k in every2] == [0, 1, 0, 1, 0, 1, 0, 1]  # blocks 0, 2, ... recompute
    assert len(set(kinds(("train.activation_checkpointing", "selective")))) == 1


def test_reduction_keeps_the_ends_and_one_layer_per_repeated_kind():
    assert (HEAD, TAIL) == (2, 3)  # the examples below are worked out for these
    # one stage of 9 layers, kinds a a b a b b c a a: ends 0, 1 | 6, 7, 8; between them b a b b: a once (kept),
    # b three times (its last, 5, stands for all three)
    a, b, c = 0, 1, 2
    red = reduce([range(9)], [a, a, b, a, b, b, c, a, a])
    assert red.extra == {(0, b): 5} and red.count == {(0, b): 3}
    assert red.like == {0: 0, 1: 1, 2: 5, 3: 3, 4: 5, 5: 5, 6: 6, 7: 7, 8: 8}
    # two stages (pipeline), each reduced on its own: one of HEAD + TAIL layers is kept whole, the other (7 layers:
    # ends 5, 6 | 9, 10, 11) has two layers of one kind between its ends, the last of them stands for both
    red = reduce([range(0, 5), range(5, 12)], [a] * 12)
    assert red.extra == {(1, a): 8} and red.count == {(1, a): 2}
    assert {i for i, j in red.like.items() if i == j} == {0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11} and red.like[7] == 8


@pytest.fixture
def traced(monkeypatch):
    """The ranks ``plan_ranks`` traces (its calls of ``plan_rank``), in order."""
    import hybridtron.train.plan.reduced as reduced

    ranks = []
    plan_rank = reduced.plan_rank

    def counting(cfg, world, rank, *args, **kwargs):
        ranks.append(rank)
        return plan_rank(cfg, world, rank, *args, **kwargs)

    monkeypatch.setattr(reduced, "plan_rank", counting)
    return ranks


@pytest.fixture
def shortened(monkeypatch):
    """(pp rank, micro-batches traced, or None when not shortened) of every pipeline schedule the plan shortens."""
    from hybridtron.train.plan.memory import ReplayedSchedule

    seen = []
    shorten = ReplayedSchedule.shorten

    def spying(self):
        done = shorten(self)
        seen.append((self.pipeline.mesh.pp_rank, self.traced if done else None))
        return done

    monkeypatch.setattr(ReplayedSchedule, "shorten", spying)
    return seen


def _as_the_whole_step(reduced: dict, full: dict, ranks: set) -> None:
    """Every ZeRO stage's and rank's plan from shortened, reduced traces equals the trace of every micro-batch and
    layer (``full``), its facts too."""
    for z, exact in full.items():
        assert set(reduced[z]) == set(exact) == ranks
        for rank, ref in exact.items():
            got = reduced[z][rank]
            for k, v in ref["memory"].items():
                assert abs(got["memory"][k] - v) < TOLERANCE, (z, rank, k, got["memory"], ref["memory"])
            assert got["facts"] == ref["facts"], (z, rank)


@pytest.mark.parametrize("schedule,per_rank", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                                               ("zero_bubble", 2)])
def test_pipeline_orders_are_the_built_ranks_schedule(schedule, per_rank):
    """Which stages plan alike is decided from every pp rank's actions before any rank is built (so all start at
    once): ``pipeline_orders`` gives what the schedule of a built rank (the training ``Pipeline``'s) runs."""
    import torch

    from hybridtron.train.plan.memory import fake_modes, fake_world, ready_rank

    cfg = load_config("tiny", [*SMALL, ("model.n_layers", "8"), ("parallel.pp", "2"), ("train.grad_accum_steps", "4"),
                               ("parallel.pp_schedule", schedule), ("parallel.pp_stages_per_rank", str(per_rank))])
    orders = pipeline_orders(cfg)
    assert sorted(orders) == [0, 1] and all(orders.values())
    for rank in (0, 1):
        with fake_world(cfg, 2, rank) as mesh, fake_modes(cfg):
            pipeline = ready_rank(cfg, mesh, True, torch.device("cpu"), quick=True).pipeline
            built = pipeline.schedule.torch_schedule.pipeline_order
            assert orders == {r: [a for a in o if a is not None] for r, o in built.items()}, rank
            assert {a.stage_index for a in orders[rank]} == set(pipeline.stage_ids), rank


@pytest.mark.slow
def test_alike_pipeline_stages_are_traced_once(traced):
    """GPipe holds every micro-batch on every stage, so its two middle stages of 3 layers each (10 layers in 4
    stages: 3, 3, 3, 1) plan alike: traced once, the second takes the first's plan (with its own stage id). Under
    1F1B stage s holds pp - s micro-batches: every stage is traced. (About 40 s on a 2-core VM.)"""
    from hybridtron.train.plan.reduced import plan_rank

    over = [*SMALL, ("model.n_layers", "10"), ("parallel.pp", "4"), ("parallel.zero_stage", "3"),
            ("train.grad_accum_steps", "4")]
    gpipe = load_config("tiny", [*over, ("parallel.pp_schedule", "gpipe")])
    planned = plan_ranks(gpipe, 4)[3]
    assert traced == [0, 1, 3] and set(planned) == {0, 1, 2, 3}
    assert planned[2]["memory"] == planned[1]["memory"] and planned[2]["facts"]["stages"] == [2]
    alone = plan_rank(gpipe, 4, 2, (3,))  # the reused plan is the one tracing that stage gives
    assert alone[3]["memory"] == planned[2]["memory"] and alone[3]["facts"] == planned[2]["facts"]
    traced.clear()
    plan_ranks(load_config("tiny", [*over, ("parallel.pp_schedule", "1f1b")]), 4)
    assert traced == [0, 1, 2, 3]


def test_progress_says_nothing_for_a_quick_plan_and_what_runs_for_a_slow_one():
    quick = io.StringIO()
    with Progress(after=5.0, stream=quick) as progress:
        progress.note("planning zero_stage 0")
    assert quick.getvalue() == ""
    slow = io.StringIO()
    with Progress(after=0.1, stream=slow) as progress:
        progress.note("planning zero_stage 3, pipeline stage 2/4 (rank 8)")
        time.sleep(0.6)
        progress.note("planning zero_stage 3, pipeline stage 3/4 (rank 16)")
        time.sleep(0.6)
    lines = slow.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["hybridtron plan: planning zero_stage 3, pipeline stage 2/4",
                                                  "hybridtron plan: planning zero_stage 3, pipeline stage 3/4"], lines


# Bound on each `hybridtron plan` below, in seconds of wall time: the commands took 14 to 33 s of CPU each on this
# 2-core VM (2026-11-28, docs/parallelism.md), and CI runs two test workers at once on such a machine; before the
# reduced traces they took 70 to 270 s.
PLAN_SECONDS = 120


@pytest.mark.slow
# the smallest and the largest of the four measured in bench/RESULTS.md (dense_1b and hybrid_moe at 4 and 64 nodes)
@pytest.mark.parametrize("preset,nodes", [("dense_1b", 4), ("hybrid_moe", 64)])
def test_plan_of_a_gpu_preset_takes_seconds(preset, nodes):
    """The command users run, as a process: its tables on stdout, in bounded time, whatever the node count, and a
    progress line on stderr while it runs."""
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "hybridtron.cli", "plan", "--config", preset, "--nodes", str(nodes),
                          "--gpus-per-node", "8"], capture_output=True, text=True, timeout=3 * PLAN_SECONDS)
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{nodes * 8} GPUs" in run.stdout and "| 3 |" in run.stdout, run.stdout
    assert took < PLAN_SECONDS, (preset, nodes, took)
    # past 3 s, what it traces, on stderr and nothing else there: the ZeRO stages, each step
    said = run.stderr.splitlines()
    assert said and all(line.startswith("hybridtron plan: planning rank 0, ZeRO-") for line in said), said
    assert any("ZeRO-3: tracing step 1/" in line for line in said), said


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_stages_traced_on_fewer_micro_batches_plan_the_whole_step(schedule, shortened):
    """pp 4 over 8 micro-batches, dp 2 under ZeRO-2 and 3 in bf16: 1F1B stage s is traced with min(pp - 1 - s, 2)
    of its warm-up forwards and two (forward, backward) pairs (``ReplayedSchedule.shorten``; the last stage three),
    what the pairs it leaves out leave behind (received gradients, logged losses) added to the places after them
    (and stage 0's third warm-up's activations to those from the first pair to the last backward), and plans every
    stage as the trace of all 8 micro-batches does; GPipe (every micro-batch in flight) is traced whole, which 4
    micro-batches show as well as 8. (1 min for each schedule on a 2-core VM running other tests beside.)"""
    accum = "8" if schedule == "1f1b" else "4"
    cfg = load_config("tiny", [*SMALL, ("model.n_layers", "8"), ("parallel.pp", "4"), ("train.dtype", "bf16"),
                               ("train.grad_accum_steps", accum), ("parallel.pp_schedule", schedule)])
    stages = (2, 3)
    reduced = plan_ranks(cfg, 8, stages)
    if schedule == "1f1b":  # each stage (of both builds) on min(w, 2) + 2 of the 8 micro-batches, w = 3 - s
        assert sorted(set(shortened)) == [(0, 4), (1, 4), (2, 3), (3, 3)], shortened
    else:
        assert shortened and all(n is None for _, n in shortened), shortened
    _as_the_whole_step(reduced, plan_ranks(cfg, 8, stages, exact=True), {0, 2, 4, 6})


@pytest.mark.slow
def test_1f1b_stages_alike_but_in_warm_ups_share_one_trace(traced, shortened):
    """pp 5 over 5 micro-batches (dp 2, ZeRO-3, bf16; ZeRO-2's shortened traces: the test above): the middle stages 1 and 2 (3 and 2 warm-up forwards,
    2 and 3 (forward, backward) pairs) are traced as one, on 2 warm-ups and 2 pairs, stage 1 adding one more
    warm-up's activations to its places from the first pair to the last backward, stage 2 one more pair's
    leftovers; stage 0 (4 warm-ups, 1 pair) is traced on 2 warm-ups and its pair. Every stage's plan equals the
    trace of the whole step (every micro-batch, every layer). (About 1 min on a 2-core VM.)"""
    cfg = load_config("tiny", [*SMALL, ("model.n_layers", "10"), ("parallel.pp", "5"), ("train.dtype", "bf16"),
                               ("train.grad_accum_steps", "5"), ("parallel.zero_stage", "3")])
    reduced = plan_ranks(cfg, 10, (3,))
    assert traced == [0, 2, 6, 8], traced
    assert sorted(set(shortened)) == [(0, 3), (1, 4), (3, 3), (4, 3)], shortened
    full = plan_ranks(cfg, 10, (3,), exact=True)
    assert full[3][2]["memory"]["total"] > full[3][4]["memory"]["total"]  # one more micro-batch in flight
    _as_the_whole_step(reduced, full, {0, 2, 4, 6, 8})
