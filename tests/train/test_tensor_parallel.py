"""Tensor parallel for Gated DeltaNet and MoE layers (train/parallel/tensor_parallel.py): real torchrun runs (gloo).

A hybrid stack with every kind of reordered weight -- DeltaProduct (two Householder steps, so in_proj_qkv holds
[q | k_1 k_2 | v_1 v_2] and in_proj_b two segments), grouped value heads, MoE with a shared expert, auxiliary and
z losses and router biases on every layer, document masks, the LM's z-loss on the vocabulary-split head -- trains
4 steps at tp2, at dp2 x tp2 (FSDP2) and at dp2 x tp2 with the experts also split over ep2, and is compared with
one process: the same losses and gradient norms, and the checkpoint holds the same tensors in the model's own
order. Checkpoints cross between these layouts and one process, sharded and whole. The row orders themselves
are checked against a brute-force definition.
"""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import ConfigError, load_config
from hybridtron.train.parallel.layout import Layout
from hybridtron.train.parallel.tensor_parallel import segment_row_order

from .test_data_parallel import (
    STEPS,
    assert_same_steps,
    assert_same_weights,
    resume_from_step_2,
    rolled_back,
    steps,
    train_runs,
)

HYBRID = ["--model.layer_pattern", "LLLA", "--model.n_layers", "4", "--model.doc_mask", "true",
          "--model.deltanet.n_householder", "2", "--model.deltanet.n_k_heads", "2", "--model.deltanet.n_v_heads", "4",
          "--model.deltanet.neg_eigval", "true",
          "--model.moe.n_experts", "4", "--model.moe.top_k", "2", "--model.moe.expert_hidden", "32",
          "--model.moe.shared_expert_hidden", "32", "--model.moe.aux_loss_coef", "0.01",
          "--model.moe.z_loss_coef", "0.001", "--model.moe.bias_update_rate", "0.01",
          "--model.lm_z_loss", "0.001"]  # the vocabulary-parallel loss with its z-loss
BASE = [*STEPS, *HYBRID]
LAYOUTS = {  # name: (processes, extra arguments)
    "tp2": (2, ["--parallel.tp", "2", "--train.grad_accum_steps", "2"]),
    # each dp rank one micro-batch of 4: the reference's two accumulated micro-batches, so the per-micro-batch
    # MoE auxiliary losses see the same tokens
    "tp2_dp2_zero3": (4, ["--parallel.tp", "2", "--parallel.zero_stage", "3"]),
    # experts split both ways: each rank holds 2 of the 4 experts (ep2) and half of their hidden units (tp2)
    "tp2_dp2_ep2": (4, ["--parallel.tp", "2", "--parallel.zero_stage", "3", "--parallel.ep", "2"]),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(small_data_dir, small_argv, tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("tp"), lambda run, extra: small_argv(small_data_dir, run, [*BASE, *extra]),
                      {"single": ["--train.grad_accum_steps", "2"]}, LAYOUTS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_parallel_hybrid_moe_trains_like_one_process(layout, runs):
    assert_same_steps(steps(runs[layout]), steps(runs["single"]))
    # Every weight, reordered ones included, is back in the model's order in the checkpoint and equals the
    # one-process run's (router biases too: the buffers are in the state dict). Step 2, not 4: the router's input
    # carries the same summation noise, and over more steps a token whose second and third expert are tied to
    # 1e-7 may pick the other (seen once at step 4: one expert's weights then differ in 3% of their elements).
    want = assert_same_weights(runs[layout], runs["single"], step=2)
    assert any("in_proj_qkv" in k for k in want) and any("gate_up_proj" in k for k in want)
    assert f"dp={1 if layout == 'tp2' else 2}, tp=2, pp=1, ep={2 if 'ep2' in layout else 1}" in runs[layout + ".log"]
    # the gradient norm, partial over dp and tp, is reduced over one flattened dp x tp group (torch warned of the
    # two all-reduces in sequence it ran without one)
    assert "sequential all_reduce" not in runs[layout + ".log"]


@pytest.mark.parametrize("src, dst", [("tp2", "single"), ("single", "tp2"), ("tp2_dp2_zero3", "tp2"),
                                      ("tp2_dp2_ep2", "single")])
def test_tensor_parallel_checkpoint_resumes_at_another_layout(src, dst, runs, small_data_dir, small_argv, tmp_path):
    # single -> tp2 reads whole files into reordered shards; tp2 -> single and -> dp2 x tp2 read the sharded
    # checkpoint in the model's order
    run = rolled_back(runs[src], tmp_path / "run")
    extra = ["--train.grad_accum_steps", "2"] if dst == "single" else LAYOUTS[dst][1]
    resume_from_step_2(small_argv(small_data_dir, run, [*BASE, *extra]), one_process=dst == "single")
    assert_same_steps(steps(run), steps(runs["single"]))


def test_segment_row_order_gives_each_rank_its_share_of_every_segment():
    widths, tp = [4, 4, 8, 8], 2
    order = segment_row_order(widths, tp).tolist()
    assert sorted(order) == list(range(24))  # a permutation
    # rank 0's rows: the first half of each segment, in segment order
    assert order[:12] == [0, 1, 4, 5, 8, 9, 10, 11, 16, 17, 18, 19]
    assert order[12:] == [2, 3, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_tensor_parallel_layouts_that_cannot_work_are_refused():
    def layout(*over, world=2):
        return Layout.from_config(load_config("tiny", [("parallel.tp", "2"), ("model.layer_pattern", "LA"), *over]), world).dp

    assert layout() == 1
    with pytest.raises(ConfigError, match=r"model.deltanet.n_k_heads \(Gated DeltaNet key heads\)=3 is not divisible"):
        layout(("model.deltanet.n_k_heads", "3"), ("model.deltanet.n_v_heads", "3"), ("model.n_heads", "2"),
               ("model.n_kv_heads", "2"))
    with pytest.raises(ConfigError, match=r"model.moe.expert_hidden .*=33 is not divisible by parallel.tp=2"):
        layout(("model.moe.n_experts", "4"), ("model.moe.expert_hidden", "33"))
    assert layout(("model.moe.n_experts", "4"), ("parallel.ep", "2"), ("parallel.zero_stage", "3"), world=4) == 2
    with pytest.raises(ConfigError, match=r"not structured feed-forwards"):
        layout(("model.ffn.kind", "lowrank"), ("model.ffn.rank", "16"))


def test_row_order_round_trip_of_a_state_tensor():
    from types import SimpleNamespace

    from hybridtron.train.model_order import ROW_ORDERS, to_row_order

    order = segment_row_order([2, 2, 4], 2)
    model = SimpleNamespace(**{ROW_ORDERS: {"layers.0.linear_attn.in_proj_qkv.weight": (0, order)}})
    w = torch.arange(24.0).view(8, 3)
    live = to_row_order(model, "layers.0._checkpoint_wrapped_module.linear_attn.in_proj_qkv.weight", w)
    assert torch.equal(live, w[order])
    assert torch.equal(to_row_order(model, "layers.0.linear_attn.out_proj.weight", w), w)  # not reordered
