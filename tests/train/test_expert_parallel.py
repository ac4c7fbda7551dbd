"""Expert parallel on the CPU for real: `torchrun` starts two or four gloo processes.

MoE layers of 4 experts split over ep=2 ranks (all-to-all dispatch) under DDP, under FSDP2 (ZeRO-3), with
the experts replicated over two pairs of ranks (dp=4, ep=2), and inside a 2-stage pipeline. Each trains 4 steps
and is compared with one process taking the same global batch in the same micro-batches: the same losses
(auxiliary losses included), gradient norms, router biases and final weights, experts included. Checkpoints
move between expert-parallel and one-process runs.
"""

from __future__ import annotations

import pytest

from hybridtron.configs import ConfigError, load_config
from hybridtron.train.checkpoint import CheckpointManager
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


def test_expert_layouts_that_cannot_work_are_refused():
    def layout(*over, world=2):
        return Layout.from_config(load_config("tiny", [("parallel.ep", "2"), *over]), world).dp

    moe = [("model.moe.n_experts", "4")]
    assert layout(*moe) == 2
    with pytest.raises(ConfigError, match=r"this model has none \(model.moe.n_experts=0\); set parallel.ep=1"):
        layout()
    with pytest.raises(ConfigError, match=r"model.moe.n_experts=6 is not divisible by parallel.ep=4"):
        layout(("model.moe.n_experts", "6"), ("parallel.ep", "4"), world=4)
    with pytest.raises(ConfigError, match=r"dp=3 is not a multiple of it"):
        layout(*moe, world=3)
    with pytest.raises(ConfigError, match=r"parallel.ep > 1 works with parallel.engine=torch only"):
        layout(*moe, ("parallel.engine", "deepspeed"))


SMALL_MB = ["--train.micro_batch_size", "2"]
LAYOUTS = {  # name: (processes, extra arguments, the one-process reference)
    "ep2_ddp": (2, ["--parallel.ep", "2"], "single"),
    "ep2_zero3": (2, ["--parallel.ep", "2", "--parallel.zero_stage", "3"], "single"),
    # experts on 2 ranks, each pair of them replicated twice: expert gradients summed over the copies
    "dp4_ep2_zero2": (4, ["--parallel.ep", "2", "--parallel.zero_stage", "2", *SMALL_MB], "single_mb2"),
    "pp2_dp2_ep2_zero3": (4, ["--parallel.ep", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3", *SMALL_MB,
                              "--train.grad_accum_steps", "2"], "single_mb2"),
}


@pytest.fixture(scope="module")
def runs(small_data_dir, small_argv, tmp_path_factory):
    # The auxiliary loss and router statistics are per micro-batch: references take the same micro-batches.
    singles = {"single": ["--train.grad_accum_steps", "2"], "single_mb2": [*SMALL_MB, "--train.grad_accum_steps", "4"]}
    return train_runs(tmp_path_factory.mktemp("ep"),
                      lambda run, extra: small_argv(small_data_dir, run, [*STEPS, *MOE, *extra, *dump_grads("moe")]),
                      singles, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_trains_like_one_process(layout, runs):
    ref = runs[LAYOUTS[layout][2]]
    assert_same_steps(steps(runs[layout]), steps(ref))
    # every expert's slice came back from its rank, trained as on one process. At step 2: the experts' grouped
    # matmuls run over other row sets than on one process (~1e-7 apart), the router's inputs carry that, and
    # later a token whose second and third expert are that close may pick the other (seen at step 3: one
    # expert's weights then differ in ~1% of their elements, by up to 1.6e-3 at step 4)
    assert any(".experts." in k for k in assert_same_weights(runs[layout], ref, step=2))
    # global expert loads move the router biases identically
    got_m, want_m = read_metrics(runs[layout])[-1], read_metrics(ref)[-1]
    bias = [k for k in want_m if "/bias/e" in k]
    assert bias and any(want_m[k] != 0 for k in bias)
    for k in bias:
        assert got_m[k] == pytest.approx(want_m[k], abs=1e-9), k


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_of_chosen_parameters_match(layout, runs):
    # the experts' whole gradients (each rank's experts, summed over their replicas), router and embedding at step 1
    assert_same_grads(runs[layout], runs[LAYOUTS[layout][2]])


@pytest.mark.slow
def test_expert_shards_are_whole_in_the_checkpoint(runs):
    ckpt = runs["ep2_zero3"] / "checkpoints" / "step_00000004"
    cfg = load_config(str(ckpt / "config.yaml"))
    from hybridtron.model import GatedLM

    model = GatedLM(cfg.model, cfg.model.vocab_size)
    CheckpointManager.load(ckpt, model, restore_rng_state=False)
    assert model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # all experts, from both ranks' halves
    assert "ep=2" in runs["ep2_zero3.log"]


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [("ep2_zero3", "single"), ("single", "ep2_ddp")])
def test_expert_parallel_checkpoint_resumes_at_another_layout(src, dst, runs, small_data_dir, small_argv, tmp_path):
    run = rolled_back(runs[src], tmp_path / "run")
    extra = ["--train.grad_accum_steps", "2"] if dst == "single" else LAYOUTS[dst][1]
    resume_from_step_2(small_argv(small_data_dir, run, [*STEPS, *MOE, *extra]), one_process=dst == "single")
    assert_same_steps(steps(run), steps(runs["single"]))


def test_dispatch_reads_split_sizes_to_the_host_once(tmp_path, monkeypatch):
    """The all-to-all dispatch's only host read in a layer's forward is its split sizes (one copy), none in the
    backward; one process, ep=1 over gloo: the exchange runs for real and gives the layer's own result."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybridtron.train.parallel.expert_parallel import AllToAllDispatch

    from ..model.test_moe import ALL_ON, layer

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        plain = layer(torch.float32, **ALL_ON)
        ep = layer(torch.float32, **ALL_ON)  # the same seeded weights
        ep.expert_dispatch = AllToAllDispatch(init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))["ep"])
        x = torch.randn(23, 32, generator=torch.Generator().manual_seed(11))
        reads, tolist, item = [], torch.Tensor.tolist, torch.Tensor.item
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
        outs, grads = [], []
        for m in (plain, ep):
            xi = x.clone().requires_grad_()
            y = m(xi)
            if m is ep:
                assert reads == ["tolist"], reads
            (y.pow(2).sum() + m.aux_loss).backward()
            outs.append(y.detach())
            grads.append([xi.grad, m.experts.gate_up_proj.grad, m.gate.weight.grad])
        assert reads == ["tolist"], reads  # nothing more in the backward, nothing at all without the dispatch
        torch.testing.assert_close(outs[1], outs[0])
        for a, b in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()
