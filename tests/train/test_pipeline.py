"""Pipeline parallel: stage cuts balanced by cost, the layouts refused before any model exists, and real runs.

The runs start two or four processes with `torchrun` (gloo) and train 4 steps of a 4-layer model with every
schedule (1F1B, GPipe, interleaved 1F1B and interleaved zero-bubble over 2 stages per rank), with tied and untied
embeddings, document masks, a hybrid Gated DeltaNet + MoE stack, activation checkpointing, and pp composed with
tensor parallel and with FSDP2. Each is compared with one process taking the same global batch as 2 accumulated
micro-batches: the same losses (with MoE auxiliary losses), gradient norms, router biases and final weights.
Checkpoints saved at one layout resume at another with the same next steps.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from hybridtron.configs import ConfigError, load_config
from hybridtron.model.flops import layer_flops
from hybridtron.train.build import build_model
from hybridtron.train.checkpoint import SHARDED
from hybridtron.train.metrics import read_metrics
from hybridtron.train.parallel.layout import Layout
from hybridtron.train.parallel.pipeline import balance, rank_cut, stage_ranges

from .test_data_parallel import (
    MOE,
    STEPS,
    assert_same_grads,
    assert_same_steps,
    assert_same_weights,
    dump_grads,
    resume_from_step_2,
    rolled_back,
    steps,
    train_runs,
)


# ---- cuts --------------------------------------------------------------------------------------------------------
def brute_force(costs, n_stages, last_extra):
    best = None
    for cut in itertools.combinations(range(1, len(costs)), n_stages - 1):
        b = [0, *cut, len(costs)]
        worst = max(sum(costs[b[k]:b[k + 1]]) + (last_extra if k == n_stages - 1 else 0) for k in range(n_stages))
        best = worst if best is None else min(best, worst)
    return best


def test_balance_finds_the_smallest_bottleneck():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [rng.choice([1.0, 2.0, 5.0, rng.random() * 10]) for _ in range(n)]
        k, extra = rng.randint(1, n), rng.choice([0.0, 3.0, rng.random() * 20])
        ranges = balance(costs, k, extra)
        assert len(ranges) == k and all(len(r) > 0 for r in ranges)
        assert [i for r in ranges for i in r] == list(range(n))  # contiguous, in order, every layer once
        got = max(sum(costs[i] for i in r) + (extra if j == k - 1 else 0) for j, r in enumerate(ranges))
        assert got == pytest.approx(brute_force(costs, k, extra)), (costs, k, extra, ranges)
    with pytest.raises(ValueError):
        balance([1.0, 1.0], 3)


def test_cuts_count_layer_kinds_and_the_output_layer():
    # A hybrid MoE stack: Gated DeltaNet, attention and MoE layers cost different amounts, and the vocabulary
    # projection weighs on the last stage; the cut follows the estimate, not the layer count.
    cfg = load_config("hybrid_moe", [("parallel.pp", "4")])
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    per_layer, head = layer_flops(cfg.model, vocab, cfg.data.seq_len)
    assert len(set(per_layer)) > 1  # the kinds differ
    ranges = stage_ranges(cfg, vocab)
    cost = [sum(per_layer[i] for i in r) + (head if k == 3 else 0) for k, r in enumerate(ranges)]
    n = cfg.model.n_layers
    even = [range(k * n // 4, (k + 1) * n // 4) for k in range(4)]
    even_cost = [sum(per_layer[i] for i in r) + (head if k == 3 else 0) for k, r in enumerate(even)]
    assert max(cost) <= max(even_cost)
    assert len(ranges[-1]) < len(ranges[0])  # the head's FLOPs take layers off the last stage


def test_a_pipeline_rank_builds_and_initialises_only_its_stages():
    # The model is cut on the meta device, so a rank allocates its stages' weights only; each part of the model
    # draws its initial weights from its own stream, so they equal the whole model's (the tied head's copy on the
    # last stage equals the first stage's embedding).
    cfg = load_config("tiny", [("parallel.pp", "2"), ("train.grad_accum_steps", "2"), ("model.n_layers", "4")])
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    whole = build_model(cfg, vocab, torch.device("cpu")).state_dict()
    held = set()
    for pp_rank in (0, 1):
        part = build_model(cfg, vocab, torch.device("cpu"), cut=rank_cut(cfg, SimpleNamespace(pp_rank=pp_rank), vocab))
        own = part.state_dict()
        layers = {k for k in whole if k.startswith("layers.")}
        assert {k for k in own if k.startswith("layers.")} < layers  # some of the layers only
        for k, v in own.items():
            assert torch.equal(v, whole[k]), k
        held |= set(own)
    assert held == set(whole)


def test_pipeline_layouts_that_cannot_work_are_refused():
    def layout(*over, world=2):
        return Layout.from_config(load_config("tiny", [("parallel.pp", "2"), *over]), world).dp

    assert layout(("train.grad_accum_steps", "2")) == 1
    with pytest.raises(ConfigError, match=r"parallel.pp_schedule=1f1b needs at least parallel.pp=2 micro-batches"):
        layout()
    assert layout(("parallel.pp_schedule", "gpipe")) == 1  # GPipe runs any number
    with pytest.raises(ConfigError, match=r"model.n_layers=4 cannot fill .* 6 pipeline stages"):
        layout(("parallel.pp", "3"), ("parallel.pp_schedule", "interleaved_1f1b"), ("parallel.pp_stages_per_rank", "2"),
               ("train.grad_accum_steps", "6"), world=3)
    with pytest.raises(ConfigError, match=r"rounds of parallel.pp=2; set train.grad_accum_steps to a multiple of 2"):
        layout(("parallel.pp_schedule", "zero_bubble"), ("parallel.pp_stages_per_rank", "2"),
               ("train.grad_accum_steps", "3"))
    with pytest.raises(ConfigError, match=r"pp=2 with dp=2 needs parallel.zero_stage 2 or 3"):
        layout(("train.grad_accum_steps", "2"), world=4)
    assert layout(("train.grad_accum_steps", "2"), ("parallel.zero_stage", "3"), world=4) == 2
    with pytest.raises(ConfigError, match=r"needs 4 processes, but the launcher started 3"):
        layout(("parallel.dp", "2"), ("train.grad_accum_steps", "2"), world=3)
    with pytest.raises(ConfigError, match=r"train.compile=true is not yet tested with parallel.pp=2"):
        layout(("train.grad_accum_steps", "2"), ("train.compile", "true"))
    with pytest.raises(ConfigError, match="self_guided .* parallel.pp=1"):
        layout(("train.grad_accum_steps", "2"), ("model.ffn.kind", "lowrank"), ("model.ffn.rank", "16"),
               ("model.ffn.self_guided", "true"))
    # schedule and stages per rank, and the engine, are checked before the world size
    with pytest.raises(ConfigError, match=r"interleaved_1f1b and zero_bubble two or more"):
        layout(("parallel.pp_schedule", "interleaved_1f1b"))
    with pytest.raises(ConfigError, match=r"gpipe and 1f1b run one stage per rank"):
        layout(("parallel.pp_stages_per_rank", "2"))
    with pytest.raises(ConfigError, match=r"parallel.pp > 1 works with parallel.engine=torch"):
        layout(("parallel.engine", "deepspeed"))


# ---- real runs ---------------------------------------------------------------------------------------------------
BASE = [*STEPS, "--model.n_layers", "4", "--model.doc_mask", "true", "--train.grad_accum_steps", "2"]
HYBRID_MOE = ["--model.layer_pattern", "LLLA", *MOE, "--model.lm_z_loss", "0.001"]  # the z-loss on the last stage
INTERLEAVED = ["--parallel.pp_schedule", "interleaved_1f1b", "--parallel.pp_stages_per_rank", "2"]
LAYOUTS = {  # name: (processes, extra arguments, the single-process reference)
    "pp2_1f1b": (2, ["--parallel.pp", "2"], "single"),
    "pp2_interleaved_hybrid_moe": (2, ["--parallel.pp", "2", *INTERLEAVED, *HYBRID_MOE], "single_hybrid_moe"),
    "pp2_zero_bubble_recompute": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "zero_bubble",
                                      "--parallel.pp_stages_per_rank", "2", "--train.activation_checkpointing",
                                      "true"], "single"),
    "pp2_tp2_gpipe": (4, ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_schedule", "gpipe"], "single"),
    "pp2_dp2_zero3": (4, ["--parallel.pp", "2", "--parallel.zero_stage", "3", "--train.micro_batch_size", "2"],
                      "single"),
}

# Dumped step-1 gradients: parameters of the first and the last stage, and the tied embedding both ends hold.
PP_GRADS = {"": ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.3.mlp.down_proj.weight",
                 "norm.weight"],
            "hybrid_moe": ["embed_tokens.weight", "layers.0.linear_attn.in_proj_qkv.weight", "layers.2.mlp.gate.weight",
                           "layers.3.mlp.experts.gate_up_proj"]}
slow = pytest.mark.slow


def pp_argv(small_argv, data_dir, run, extra):
    names = PP_GRADS["hybrid_moe" if run.name.endswith("hybrid_moe") else ""]
    return small_argv(data_dir, run, [*BASE, *extra, *dump_grads(names)])


@pytest.fixture(scope="module")
def runs(small_data_dir, small_argv, tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("pp"), lambda run, extra: pp_argv(small_argv, small_data_dir, run, extra),
                      {"single": [], "single_hybrid_moe": HYBRID_MOE}, LAYOUTS)


@slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_trains_like_one_process(layout, runs):
    ref = runs[LAYOUTS[layout][2]]
    assert_same_steps(steps(runs[layout]), steps(ref))
    # Every stage's tensors reach the checkpoint (the tied embedding once, from either end), and after 4 steps
    # they are the one-process run's: every stage's gradients were right, the tied copies stayed one.
    assert_same_weights(runs[layout], ref)


@slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_of_chosen_parameters_match(layout, runs):
    # each stage's whole gradients, gathered from the ranks that hold them (tp shards too) before clipping
    assert_same_grads(runs[layout], runs[LAYOUTS[layout][2]])


@slow
def test_moe_statistics_of_every_stage_reach_the_log(runs):
    # Router biases move with each layer's expert loads; the log (rank 0, first stage) shows every stage's layers.
    got, want = read_metrics(runs["pp2_interleaved_hybrid_moe"]), read_metrics(runs["single_hybrid_moe"])
    keys = [k for k in want[-1] if k.startswith("moe/")]
    assert {k.split("/")[1] for k in keys} == {"layer0", "layer1", "layer2", "layer3"}
    for k in keys:
        assert got[-1][k] == pytest.approx(want[-1][k], abs=1e-6), k
    assert any(want[-1][k] != 0 for k in keys if "/bias/" in k)


@slow
def test_pipeline_log_and_checkpoint_layout(runs):
    log = runs["pp2_interleaved_hybrid_moe.log"]
    assert "pipeline: 4 stages of layers 0-0, 1-1, 2-2, 3-3, schedule interleaved_1f1b" in log
    assert "2 processes, dp=1, tp=1, pp=2, ep=1, cp=1" in log and "rank 1/2" not in log
    ckpt = runs["pp2_tp2_gpipe"] / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in (ckpt / SHARDED).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


@slow
@pytest.mark.parametrize("src, dst", [("pp2_tp2_gpipe", "single"), ("single", "pp2_interleaved"),
                                      ("pp2_tp2_gpipe", "dp2_zero3"), ("pp2_tp2_gpipe", "dp4_zero3")])
def test_pipeline_checkpoint_resumes_at_another_layout(src, dst, runs, small_data_dir, small_argv, tmp_path):
    run = rolled_back(runs[src], tmp_path / "run")
    extra = {"single": [], "pp2_interleaved": ["--parallel.pp", "2", *INTERLEAVED],
             "dp2_zero3": ["--parallel.zero_stage", "3", "--train.grad_accum_steps", "1"],
             # 4 data-parallel ranks of micro-batch 2: the same global batch of 8
             "dp4_zero3": ["--parallel.zero_stage", "3", "--train.grad_accum_steps", "1",
                           "--train.micro_batch_size", "2"]}[dst]
    resume_from_step_2(small_argv(small_data_dir, run, [*BASE, *extra]), one_process=dst == "single",
                       nproc=4 if dst.startswith("dp4") else 2)
    assert_same_steps(steps(run), steps(runs["single"]))


@slow
@pytest.mark.parametrize("layout", ["pp2_1f1b", "pp2_dp2_zero3"])
def test_a_pipeline_run_resumes_at_its_own_layout_bitwise(layout, runs, small_data_dir, small_argv, tmp_path):
    """Rolled back to step 2 and run again at the same layout: steps 3 and 4 as the uninterrupted run's, to the bit.
    Every stage has its own optimizer param groups; saved in torch's nested form (numbered groups) DCP kept one
    stage's, and the others' first step after the resume failed (KeyError 'betas')."""
    nproc, extra, _ = LAYOUTS[layout]
    run = rolled_back(runs[layout], tmp_path / "run")
    resume_from_step_2(pp_argv(small_argv, small_data_dir, run, extra), one_process=False, nproc=nproc)
    assert steps(run) == steps(runs[layout])
