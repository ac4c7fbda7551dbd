"""Context parallel on the CPU for real: `torchrun` starts two or four gloo processes that split every sequence.

Attention layers run ring attention over the pieces; Gated DeltaNet layers take the convolution's halo from the
previous piece and compose the state their piece starts from out of every piece's all-gathered state map. A
4-layer model with packed documents (document masks, state resets at document starts, including starts that fall
on a piece boundary) trains 4 steps as cp2 (attention only), cp4 (a hybrid Gated DeltaNet / attention stack: the
state crosses three boundaries), dp2 x cp2 under FSDP2, cp2 x tp2, cp2 with MoE layers and cp2 with activation
checkpointing, and matches one process taking the same batches: losses, gradient norms, validation loss and
final weights. A context-parallel checkpoint resumes on one process.
"""

from __future__ import annotations

import pytest

from hybridtron.configs import ConfigError, load_config
from hybridtron.train.metrics import read_metrics
from hybridtron.train.parallel.layout import Layout

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


def test_context_layouts_that_cannot_work_are_refused():
    def layout(*over, world=2):
        return Layout.from_config(load_config("tiny", [("parallel.cp", "2"), *over]), world).dp

    assert layout() == 1
    assert layout(world=4) == 2  # dp = 2: gradients averaged over dp x cp = 4 ranks
    for seq in ("129", "130"):  # the zig-zag layout cuts sequences into 2 cp chunks
        with pytest.raises(ConfigError, match=rf"data.seq_len={seq} is not a multiple of 2 x parallel.cp = 4"):
            layout(("data.seq_len", seq))
    with pytest.raises(ConfigError, match=r"chunks of 2 positions, fewer than the Gated DeltaNet convolution reads"):
        layout(("data.seq_len", "8"), ("model.layer_pattern", "LA"), ("model.n_layers", "2"))
    for backend in ("flex", "flash-attn"):
        with pytest.raises(ConfigError, match=rf"attention={backend} with parallel.cp=2: ring attention runs its "):
            layout(("model.kernels.attention", backend))
    with pytest.raises(ConfigError, match=r"parallel.pp=2 with dp x cp = 1 x 2 needs parallel.zero_stage 2 or 3"):
        layout(("parallel.pp", "2"), ("train.grad_accum_steps", "2"), world=4)
    with pytest.raises(ConfigError, match=r"tp=2 with dp x cp = 1 x 2 needs parallel.zero_stage 2 or 3"):
        layout(("parallel.tp", "2"), world=4)
    assert layout(("parallel.tp", "2"), ("parallel.zero_stage", "3"), world=4) == 1
    with pytest.raises(ConfigError, match=r"pieces of 36 positions, .* multiple of cp x tp = 16"):
        layout(("parallel.tp", "8"), ("parallel.zero_stage", "3"), ("data.seq_len", "72"), world=16)
    with pytest.raises(ConfigError, match=r"parallel.cp > 1 works with parallel.engine=torch only"):
        layout(("parallel.engine", "deepspeed"))


BASE = [*STEPS, "--model.n_layers", "4", "--model.doc_mask", "true", "--train.grad_accum_steps", "2",
        "--train.eval_every", "4"]
HYBRID = ["--model.layer_pattern", "LLLA"]
LAYOUTS = {  # name: (processes, extra arguments, the one-process reference)
    "cp2": (2, ["--parallel.cp", "2"], "single"),
    "cp4_hybrid": (4, ["--parallel.cp", "4", *HYBRID], "single_hybrid"),
    "dp2_cp2_zero3_hybrid": (4, ["--parallel.cp", "2", "--parallel.zero_stage", "3", "--train.grad_accum_steps", "1",
                                 *HYBRID], "single_hybrid"),
    # each piece of each sequence split again over tp2 (sequence parallel), and its heads: ring attention and the
    # delta rule's state maps run per tp rank on its heads, within its cp ring
    "cp2_tp2_zero3_hybrid": (4, ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.zero_stage", "3", *HYBRID],
                             "single_hybrid"),
    # MoE on every layer: each piece routes its own tokens, the balance loss takes the whole sequences' loads
    "cp2_moe": (2, ["--parallel.cp", "2", *MOE], "single_moe"),
    # activation checkpointing: the backward recomputes each block, its ring, state-map gather and halo included
    "cp2_recompute_hybrid": (2, ["--parallel.cp", "2", "--train.activation_checkpointing", "true", *HYBRID],
                             "single_hybrid"),
}


# Dumped step-1 gradients per model (the run's name ends in it): Gated DeltaNet's fused qkv rows and convolution
# (reordered under tp), attention, MoE experts and router.
CP_GRADS = {"": ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.3.mlp.down_proj.weight"],
            "hybrid": ["embed_tokens.weight", "layers.0.linear_attn.in_proj_qkv.weight",
                       "layers.0.linear_attn.conv1d.weight", "layers.3.self_attn.q_proj.weight"],
            "moe": ["layers.0.self_attn.q_proj.weight", "layers.1.mlp.gate.weight", "layers.1.mlp.experts.down_proj"]}


def cp_argv(small_argv, data_dir, run, extra):
    names = CP_GRADS[next((k for k in CP_GRADS if k and run.name.endswith(k)), "")]
    return small_argv(data_dir, run, [*BASE, *extra, *dump_grads(names)])


@pytest.fixture(scope="module")
def runs(small_data_dir, small_argv, tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("cp"), lambda run, extra: cp_argv(small_argv, small_data_dir, run, extra),
                      {"single": [], "single_hybrid": HYBRID, "single_moe": MOE}, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_trains_like_one_process(layout, runs):
    ref = runs[LAYOUTS[layout][2]]
    assert_same_steps(steps(runs[layout]), steps(ref))
    # the validation loss is the mean over the pieces, which is the whole sequences' loss
    assert read_metrics(runs[layout])[-1]["val_loss"] == pytest.approx(read_metrics(ref)[-1]["val_loss"], rel=1e-5)
    assert_same_weights(runs[layout], ref)
    if layout == "cp2_tp2_zero3_hybrid":
        assert "4 processes, dp=1, tp=2, pp=1, ep=1, cp=2, zero_stage=3" in runs[layout + ".log"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_of_chosen_parameters_match(layout, runs):
    # the pieces' gradients averaged over dp x cp, tp shards gathered and put back in the model's row order
    assert_same_grads(runs[layout], runs[LAYOUTS[layout][2]])


@pytest.mark.slow
def test_context_parallel_checkpoint_resumes_on_one_process(runs, small_data_dir, small_argv, tmp_path):
    assert "4 processes, dp=1, tp=1, pp=1, ep=1, cp=4" in runs["cp4_hybrid.log"]
    run = rolled_back(runs["cp4_hybrid"], tmp_path / "run")
    resume_from_step_2(small_argv(small_data_dir, run, [*BASE, *HYBRID]), one_process=True)
    assert_same_steps(steps(run), steps(runs["single_hybrid"]))


@pytest.mark.slow
def test_memory_follows_the_tokens_per_rank_not_the_sequence(capfd):
    """plan --measure at a fixed 256 tokens per rank: cp 2 over 512-token sequences (two gloo processes) holds what
    one process holds over 256 (ring attention through SDPA's CPU flash kernel keeps q, k, v, the output and the
    log-sum-exp of its rank's tokens; no block's scores), and the plan predicts it."""
    import json

    from hybridtron.cli import main

    from .test_data_parallel import torchrun

    small = ["--model.n_layers", "2", "--model.d_model", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.kernels.attention", "sdpa", "--model.doc_mask", "false", "--model.max_seq_len", "512"]

    def measured(out):
        return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])

    assert main(["plan", "--config", "tiny", "--measure", "--json", *small, "--data.seq_len", "256"]) == 0
    one = measured(capfd.readouterr().out)
    res = torchrun(["plan", "--config", "tiny", "--measure", "--json", *small, "--data.seq_len", "512",
                    "--parallel.cp", "2"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    two = measured(res.stdout)
    assert two["cp"] == 2 and 0.98 <= two["predicted_over_measured"] <= 1.02, two
    # the ring's sends as planned: k, v forward and backward, their fp32 gradients cp times
    assert two["comm_predicted_gb_by_dim"]["cp"] == pytest.approx(two["comm_measured_gb_by_op"]["send"], rel=1e-9)
    ratio = two["measured_gib"]["total"] / one["measured_gib"]["total"]
    assert 0.99 <= ratio <= 1.01, (ratio, one["measured_gib"], two["measured_gib"])


def test_the_plan_runs_two_ring_steps_as_the_heaviest_cp_rank_runs_them_all(monkeypatch):
    """On fake tensors ring attention runs one step of each kind (``ring_steps``): the plan of cp rank 0 is then
    the peak of the heaviest cp rank running every step (rank 0's own steps are all of the lighter kind: it would
    plan less), at any cp. Checked against every cp rank of cp 4 with every step run; and a step's kernel outputs
    are not held into the next step (they were: the peak grew until the third step)."""
    from hybridtron.train.parallel import context_parallel as cpm
    from hybridtron.train.plan.memory import fake_world, step_peak

    cfg = load_config("tiny", [("model.n_layers", "2"), ("model.d_model", "256"), ("model.n_heads", "8"),
                               ("model.n_kv_heads", "2"), ("model.ffn_hidden", "256"), ("data.seq_len", "2048"),
                               ("model.max_seq_len", "2048"), ("train.micro_batch_size", "1"),
                               ("train.dtype", "bf16"), ("parallel.cp", "4"), ("parallel.zero_stage", "3")])
    every = cpm.ring_steps

    def peak(rank: int) -> tuple[int, float]:
        with fake_world(cfg, 4, rank) as mesh:
            return mesh.cp_rank, step_peak(cfg, mesh, fake=True)["memory"]["total"]

    assert cpm.ring_steps(4, 0, fake=True) == [(1, -1), (2, 4)] and len(cpm.ring_steps(4, 0, fake=False)) == 3
    _, planned = peak(0)
    monkeypatch.setattr(cpm, "ring_steps", lambda n, rank, fake: every(n, rank, False))
    real = dict(peak(rank) for rank in range(4))
    assert sorted(real) == [0, 1, 2, 3]
    assert planned == max(real.values()) > real[0], (planned, real)
    monkeypatch.setattr(cpm, "ring_steps", lambda n, rank, fake: [(i, n) for i in range(1, 4)])
    three = peak(0)[1]
    monkeypatch.setattr(cpm, "ring_steps", lambda n, rank, fake: [(i, n) for i in range(1, 3)])
    assert peak(0)[1] == three, "the third step of a kind holds more than the second"
