"""The parallelisms composed: hybrid sharding (HSDP) with tensor, context and expert parallel, context parallel with
pipeline and expert parallel, FSDP2's CPU offload, and blocks compiled under tensor parallel. Gloo processes on the CPU train 4 steps of a layout and match
one process taking the same global batch: per-step loss and gradient norm, the step-1 gradients of chosen parameters
(gathered whole, in the model's row order) and the final weights; checkpoints written at one layout resume at
another. Two 8-process layouts (dp_replicate 2 x dp_shard 2 x tp 2; pp 2 x cp 2 x tp 2) are the 4-D/5-D meshes of
large jobs at their smallest. Each run is trained when a test first needs it, so one test can be run alone."""

from __future__ import annotations

import pytest

from hybridtron.cli import main
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
    ranks,
    resume_from_step_2,
    rolled_back,
    steps,
)

# Two layers of the hybrid model (a Gated DeltaNet layer, then attention) over packed documents: under context
# parallel the delta rule's state, the convolution's halo and ring attention cross the pieces.
HYBRID = ["--model.layer_pattern", "LA", "--model.doc_mask", "true"]
GRADS = {"hybrid": ["embed_tokens.weight", "layers.0.linear_attn.in_proj_qkv.weight",
                    "layers.0.linear_attn.conv1d.weight", "layers.1.self_attn.q_proj.weight",
                    "layers.1.mlp.down_proj.weight"],
         "moe": ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.gate.weight",
                 "layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"],
         "dense": ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"]}
Z3 = ["--parallel.zero_stage", "3"]
# One process takes each layout's global batch (micro-batch 4) as accumulated micro-batches.
SINGLES = {"hybrid": [*HYBRID, "--train.grad_accum_steps", "2"], "moe": [*MOE, "--train.grad_accum_steps", "2"],
           "dense": ["--train.grad_accum_steps", "4"], "dense2": ["--train.grad_accum_steps", "2"]}
LAYOUTS = {  # name: (processes, extra arguments, the model, the one-process reference)
    # context x expert parallel: the ep group is the two cp ranks, each routing its piece's tokens
    "cp2_ep2": (2, ["--parallel.cp", "2", "--parallel.ep", "2", "--train.grad_accum_steps", "2", *MOE], "moe", "moe"),
    # HSDP x CP x EP: FSDP2 shards over dp_shard x cp = 1 x 2 and replicates over dp_replicate 2; the experts split
    # over ep 2 of the dp x cp ranks, their copies summed over the other two
    "hsdp_cp2_ep2": (4, [*Z3, "--parallel.dp_shard", "1", "--parallel.cp", "2", "--parallel.ep", "2", *MOE], "moe",
                     "moe"),
    # pipeline x context parallel: each stage runs its piece of every micro-batch, under FSDP2 over the cp ranks
    "pp2_cp2": (4, [*Z3, "--parallel.pp", "2", "--parallel.cp", "2", "--train.grad_accum_steps", "2", *HYBRID],
                "hybrid", "hybrid"),
    # HSDP x TP: dp_replicate 2 x dp_shard 2 x tp 2
    "hsdp_tp2": (8, [*Z3, "--parallel.dp_shard", "2", "--parallel.tp", "2"], "dense", "dense"),
    # PP x CP x TP: every piece split again by sequence parallelism, the stages exchanging T / (cp x tp) positions
    "pp2_cp2_tp2": (8, [*Z3, "--parallel.pp", "2", "--parallel.cp", "2", "--parallel.tp", "2",
                        "--train.grad_accum_steps", "2", *HYBRID], "hybrid", "hybrid"),
    # FSDP2 with parameter, gradient and optimizer-state shards on the host (parallel.offload=cpu)
    "offload": (2, ["--parallel.zero_stage", "2", "--parallel.offload", "cpu"], "dense", "dense2"),
}
EIGHT = {name for name, (n, *_rest) in LAYOUTS.items() if n == 8}


@pytest.fixture(scope="module")
def trained(small_data_dir, small_argv, tmp_path_factory):
    """name -> run directory, trained on first use: "single_<model>" one process, else LAYOUTS[name]."""
    root, done = tmp_path_factory.mktemp("composed"), {}

    def get(name: str):
        if name in done:
            return done[name]
        run = root / name
        if name.startswith("single_"):
            model = name.removeprefix("single_")
            extra = [*STEPS, *SINGLES[model], *dump_grads(GRADS[model.removesuffix("2")])]
            assert main(small_argv(small_data_dir, run, extra)) == 0
        else:
            nproc, extra, model, _ = LAYOUTS[name]
            res = ranks(small_argv(small_data_dir, run, [*STEPS, *extra, *dump_grads(GRADS[model])]), nproc=nproc)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            (run / "stdout.log").write_text(res.stdout + res.stderr)
        done[name] = run
        return run

    return get


def _layouts(eight: bool):
    return [pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS if (n in EIGHT) == eight]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*_layouts(False), *_layouts(True)])
def test_composed_layout_trains_like_one_process(layout, trained):
    run, ref = trained(layout), trained("single_" + LAYOUTS[layout][3])
    assert_same_steps(steps(run), steps(ref))
    assert read_metrics(run)[-1]["val_loss"] == pytest.approx(read_metrics(ref)[-1]["val_loss"], rel=1e-5)
    # the step-1 gradients: sharded over dp_shard (x cp), tp and ep, gathered whole
    assert_same_grads(run, ref)
    assert_same_weights(run, ref)


@pytest.mark.slow
def test_composed_layouts_report_their_mesh(trained):
    log = (trained("hsdp_cp2_ep2") / "stdout.log").read_text()
    assert "4 processes, dp=2, tp=1, pp=1, ep=2, cp=2, zero_stage=3 (HSDP: dp_shard=1)" in log, log[-2000:]
    assert "replicated across them (HSDP)" in log
    log = (trained("offload") / "stdout.log").read_text()
    assert "shards kept on the CPU (offload)" in log, log[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [("hsdp_cp2_ep2", "cp2_ep2"), ("pp2_cp2", "single_hybrid"),
                                      ("hsdp_tp2", "single_dense")])
def test_checkpoint_of_one_layout_resumes_in_another(src, dst, trained, small_data_dir, small_argv, tmp_path):
    """Step 2's checkpoint continues at the other layout with the one-process run's steps 3 and 4."""
    model = (LAYOUTS[src][2] if src in LAYOUTS else src.removeprefix("single_")).removesuffix("2")
    run = rolled_back(trained(src), tmp_path / "run")
    if dst in LAYOUTS:
        nproc, extra = LAYOUTS[dst][:2]
    else:
        nproc, extra = 1, SINGLES[dst.removeprefix("single_")]
    resume_from_step_2(small_argv(small_data_dir, run, [*STEPS, *extra]), one_process=nproc == 1, nproc=nproc)
    assert_same_steps(steps(run), steps(trained("single_" + model)))


ZERO3 = ("parallel.zero_stage", "3")


@pytest.mark.parametrize("over, world, dp", [
    ([ZERO3, ("parallel.dp_shard", "2"), ("parallel.tp", "2")], 8, 4),
    ([ZERO3, ("parallel.dp_shard", "2"), ("parallel.tp", "2"), ("parallel.pp", "2"), ("train.grad_accum_steps", "2")],
     16, 4),
    ([ZERO3, ("parallel.dp_shard", "1"), ("parallel.cp", "2")], 4, 2),
    ([ZERO3, ("parallel.cp", "2"), ("parallel.pp", "2"), ("train.grad_accum_steps", "2")], 4, 1),
    ([("parallel.cp", "2"), ("parallel.ep", "2"), ("model.moe.n_experts", "4")], 2, 1),
    ([ZERO3, ("parallel.dp_shard", "2"), ("parallel.ep", "2"), ("model.moe.n_experts", "4")], 4, 4),
    ([ZERO3, ("parallel.offload", "cpu"), ("parallel.tp", "2")], 4, 2),
    ([ZERO3, ("train.compile", "true"), ("parallel.tp", "2")], 4, 2),
])
def test_composed_layouts_resolve(over, world, dp):
    assert Layout.from_config(load_config("tiny", over), world).dp == dp


@pytest.mark.parametrize("over, world, needle", [
    ([("parallel.pp", "2"), ("parallel.cp", "2"), ("train.grad_accum_steps", "2")], 4,
     r"parallel.pp=2 with dp x cp = 1 x 2 needs parallel.zero_stage 2 or 3"),
    ([("parallel.cp", "2"), ("parallel.ep", "4"), ("model.moe.n_experts", "4")], 2,
     r"dp x cp = 1 x 2 = 2 is not a multiple of it"),
    ([("parallel.zero_stage", "3"), ("parallel.dp_shard", "1")], 4, r"dp_shard=1 shards nothing"),
    ([("parallel.offload", "cpu")], 2, r"parallel.zero_stage=0 shards nothing; set parallel.zero_stage 2 or 3"),
    ([("parallel.offload", "cpu"), ZERO3, ("parallel.pp", "2"), ("train.grad_accum_steps", "2")], 4,
     r"parallel.offload=cpu is not yet tested with parallel.pp=2 .* set parallel.offload=none"),
    ([("parallel.offload", "cpu"), ("parallel.zero_stage", "3")], 1,
     r"has one; on one process use parallel.engine=deepspeed with parallel.offload_optimizer=true"),
])
def test_what_cannot_compose_is_refused(over, world, needle):
    with pytest.raises(ConfigError, match=needle):
        Layout.from_config(load_config("tiny", over), world)


def test_offload_settings_are_checked_in_the_config():
    with pytest.raises(ConfigError, match=r"parallel.offload: value 'gpu' is not allowed; choose one of \['none', 'cpu'\]"):
        load_config("tiny", [("parallel.offload", "gpu")])
    cfg = load_config("tiny", [("parallel.offload", "cpu"), ("parallel.engine", "deepspeed"),
                               ("parallel.zero_stage", "2")])
    with pytest.raises(ConfigError, match=r"with DeepSpeed set parallel.offload_optimizer=true instead"):
        Layout.from_config(cfg, 2)


@pytest.mark.slow
def test_plan_counts_offloaded_state_in_host_memory():
    """parallel.offload=cpu: the plan's GPU peak loses the sharded weights, gradients and optimizer state, which it
    counts in host memory instead; what is gathered for compute and the activations are the same."""
    from hybridtron.train.plan import format_table, plan_table

    # 8 x 256 tokens: the step's peak is in the first micro-batch's forward (shorter, it moves into the backward,
    # at the fused loss's gradient of the logits, with gradients alive)
    small = [("model.d_model", "64"), ("model.n_layers", "2"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
             ("data.seq_len", "256"), ("train.micro_batch_size", "8")]
    cfg = load_config("tiny", small)
    off = load_config("tiny", [*small, ("parallel.offload", "cpu")])
    base = plan_table(cfg, 2, 80, stages=(3,))[0]
    rows = plan_table(off, 2, 80, stages=(0, 3))
    assert "refused" in rows[0] and "shards nothing" in rows[0]["refused"]
    row = rows[1]
    assert row["host"] > 0
    assert row["total"] == pytest.approx(base["total"] - row["host"], rel=1e-9)
    assert row["optimizer"] == 0 and row["gathered"] == pytest.approx(base["gathered"])
    assert row["activations"] == pytest.approx(base["activations"])
    # at the step's peak (the first micro-batch's forward: no gradient yet) the host holds this rank's half of the
    # fp32 weights and of Adam's two moments, 3 x 4 bytes x P / 2, and the GPU the buffers only of that state
    P = base["params"]
    assert base["grads"] == 0 and row["host"] * 2**30 == pytest.approx(12 * P / 2, rel=0.01)
    assert row["weights"] < 0.05 * base["weights"]
    assert "GiB of sharded weights, gradients and optimizer state in host memory" in format_table(off, rows, 2, 80)


# ---- per-block compile under tensor parallel ---------------------------------------------------------------------

def _tp_compile_worker(rank: int, world: int, init_file: str, out: str) -> None:
    """One tp rank: the same tp2 model eager, with every block compiled (aot_eager: the graphs AOTAutograd traces,
    without Inductor's code generation), and compiled without the wait on the embedding's output (last: it fails
    in backward on every rank alike); rank 0 saves each one's loss and whole gradients, or its error."""
    import os

    import torch
    import torch.distributed as dist

    from hybridtron.model import GatedLM
    from hybridtron.train.parallel.mesh import Mesh
    from hybridtron.train.parallel.parallelize import _settle_async, apply_compile, apply_tensor_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = load_config("tiny", TP_MODEL)
    mesh = Mesh.setup(cfg, torch.device("cpu"))
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    ids = torch.randint(0, vocab, (2, 65), generator=torch.Generator().manual_seed(1))
    result = {}
    for compiled, settle in (("eager", True), ("compiled", True), ("compiled, no wait", False)):
        torch.manual_seed(0)
        model = GatedLM(cfg.model, vocab)
        model.init_weights()
        if compiled != "eager":
            apply_compile(model, backend="aot_eager")
        apply_tensor_parallel(model, mesh)
        if not settle:  # what torch does without the wait before the first compiled block
            hooks = model.embed_tokens._forward_hooks
            for key in [k for k, h in hooks.items() if h is _settle_async]:
                del hooks[key]
        try:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()
        except Exception as e:  # noqa: BLE001 -- the error is the result
            result[compiled] = f"{type(e).__name__}: {e}"
            continue
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        result[compiled] = (loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach(), grads)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


TP_MODEL = [("model.d_model", "64"), ("model.n_layers", "2"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
            ("data.seq_len", "64"), ("data.tokenizer.vocab_size", "512"), ("parallel.tp", "2")]


@pytest.fixture(scope="module")
def tp_compile(tmp_path_factory) -> dict:
    import torch
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("tp_compile")
    mp.spawn(_tp_compile_worker, args=(2, str(root / "init"), str(root / "result.pt")), nprocs=2)
    return torch.load(root / "result.pt", weights_only=False)


@pytest.mark.slow
def test_compiled_blocks_under_tensor_parallel_match_eager(tp_compile):
    """Each block compiled inside the tensor/sequence-parallel plans: the loss and every parameter's whole gradient
    are the eager tp2 model's (which the tensor-parallel tests match with one process)."""
    import torch

    assert not isinstance(tp_compile["compiled"], str), tp_compile["compiled"]
    (loss, grads), (closs, cgrads) = tp_compile["eager"], tp_compile["compiled"]
    torch.testing.assert_close(closs, loss, rtol=1e-5, atol=0)
    assert sorted(cgrads) == sorted(grads) and len(grads) > 10
    for k, g in grads.items():
        torch.testing.assert_close(cgrads[k], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(),
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_without_the_wait_compiled_blocks_fail_in_backward(tp_compile):
    """Why ``apply_tensor_parallel`` waits on the embedding's output: handed the asynchronous reduce-scatter's
    AsyncCollectiveTensor, a compiled block's backward returns a plain gradient where DTensor's redistribution
    expects a DTensor (torch 2.13; pytorch/pytorch#184980, fixed upstream by pytorch/pytorch#179522). When this
    test fails, torch no longer needs the wait."""
    result = tp_compile["compiled, no wait"]
    assert isinstance(result, str) and "_local_tensor" in result, result


@pytest.mark.slow
def test_plan_of_pipeline_with_context_parallel_runs_the_pieces():
    """Under pp x cp the planned stages run their rank's piece of each micro-batch: the activations of the heavier
    stage about halve against pp alone, and the hidden states between stages are (B, T / cp, d) exactly.

    The halving is checked with the CPU run's kernels, whose saved tensors all grow with the tokens a rank runs.
    With the GPU's fused attention (the plan's default) so little is saved at these toy sizes that ring
    attention's transient per-block scores, (B, H, T / cp, T / cp) in torch ops, set the peak instead."""
    from hybridtron.train.plan import plan_table, simulate

    small = [("model.d_model", "64"), ("model.n_layers", "2"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
             ("data.seq_len", "64"), ("train.micro_batch_size", "2"), ("train.grad_accum_steps", "2"), ZERO3,
             ("parallel.pp", "2")]

    def heaviest_activations(cfg, world):
        per_rank = simulate(cfg, world, kernels="cpu")
        return max(per_rank.values(), key=lambda r: r["memory"]["total"])["memory"]["activations"]

    acts_pp = heaviest_activations(load_config("tiny", small), 2)
    acts_both = heaviest_activations(load_config("tiny", [*small, ("parallel.cp", "2")]), 4)
    assert 0.35 < acts_both / acts_pp < 0.65, (acts_both, acts_pp)
    pp = plan_table(load_config("tiny", small), 2, 80, stages=(3,))[0]
    both = plan_table(load_config("tiny", [*small, ("parallel.cp", "2")]), 4, 80, stages=(3,))[0]
    # the last stage sends each of its 2 micro-batches' input gradients back: (2, 64, 64) fp32 under pp alone (no
    # FSDP over one rank), (2, 64 / cp, 64) in FSDP2's bf16 under cp (its dp x cp = 2 ranks shard, and FSDP2 casts
    # the blocks' inputs to bf16); the tied embedding's fp32 gradient is all-reduced whole under pp alone, as each
    # end's FSDP2 half under cp
    boundary, tied = 2 * 2 * 64 * 64 * 4, 4096 * 64 * 4
    assert pp["comm_gb"]["pp"] * 1e9 == pytest.approx(boundary + tied)
    assert both["comm_gb"]["pp"] * 1e9 == pytest.approx(boundary / 2 / 2 + tied / 2)
