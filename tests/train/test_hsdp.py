"""Hybrid sharding (HSDP, ``parallel.dp_shard`` < dp): FSDP2 shards within groups of dp_shard neighbouring dp ranks
and replicates over the groups. Four gloo processes as dp_replicate 2 x dp_shard 2 at ZeRO-3 train what one process
trains on the same global batch (per-step loss and gradient norm, the step-1 gradients, the weights), their
checkpoint holds each tensor in dp_shard pieces, and checkpoints resume across layouts (HSDP to one process and to
plain FSDP, one process to HSDP) with the same next steps. Layouts hybrid sharding cannot take are refused before
any model is built."""

from __future__ import annotations

import pytest

from hybridtron.cli import main
from hybridtron.configs import ConfigError, load_config
from hybridtron.train.checkpoint import SHARDED
from hybridtron.train.parallel.layout import Layout

from .test_data_parallel import (
    STEPS,
    assert_same_grads,
    assert_same_steps,
    assert_same_weights,
    dump_grads,
    ranks,
    rolled_back,
    steps,
)

HSDP = ["--parallel.zero_stage", "3", "--parallel.dp_shard", "2"]


@pytest.fixture(scope="module")
def runs(small_data_dir, small_argv, tmp_path_factory):
    """One process taking the global batch (4 ranks x micro-batch 4) as 4 accumulated micro-batches, and the
    4-process HSDP run."""
    root = tmp_path_factory.mktemp("hsdp")
    out = {"single": root / "single", "hsdp": root / "hsdp"}
    assert main(small_argv(small_data_dir, out["single"], [*STEPS, "--train.grad_accum_steps", "4", *dump_grads()])) == 0
    res = ranks(small_argv(small_data_dir, out["hsdp"], [*STEPS, *HSDP, *dump_grads()]), nproc=4)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out["hsdp.log"] = res.stdout + res.stderr
    # 2 micro-batches of 2 per rank: the cross-group all-reduce waits for the last one (set_requires_all_reduce)
    out["hsdp_accum"] = root / "hsdp_accum"
    res = ranks(small_argv(small_data_dir, out["hsdp_accum"], [*STEPS, *HSDP, "--train.micro_batch_size", "2",
                                                                 "--train.grad_accum_steps", "2", *dump_grads()]),
                   nproc=4)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "hsdp_accum"])
def test_hsdp_trains_like_one_process(layout, runs):
    assert_same_steps(steps(runs[layout]), steps(runs["single"]))
    assert_same_grads(runs[layout], runs["single"])  # reduce-scattered, then all-reduced across the groups
    assert_same_weights(runs[layout], runs["single"])
    log = runs["hsdp.log"]  # what FSDP2 applied, read back from the blocks
    assert "(HSDP: dp_shard=2)" in log and "replicated across them (HSDP)" in log


@pytest.mark.slow
def test_hsdp_checkpoint_holds_dp_shard_pieces(runs):
    """Sharded in 2 (dp_shard), not in 4 (dp): the replicas' identical pieces are written once."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(runs["hsdp"] / "checkpoints" / "step_00000004" / SHARDED)).read_metadata()
    chunks = meta.state_dict_metadata["model.embed_tokens.weight"].chunks
    assert [c.offsets[0] for c in chunks] == [0, 256] and all(c.sizes[0] == 256 for c in chunks), chunks


# The same global batch of 16 sequences at each layout: (processes, arguments)
LAYOUTS = {"single": (1, ["--train.grad_accum_steps", "4"]), "hsdp": (4, HSDP),
           "fsdp_dp2": (2, ["--parallel.zero_stage", "2", "--train.grad_accum_steps", "2"])}


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [("hsdp", "single"), ("hsdp", "fsdp_dp2"), ("single", "hsdp")])
def test_checkpoint_resumes_across_hybrid_sharding(src, dst, runs, small_data_dir, small_argv, tmp_path):
    """Step 2's checkpoint continues at the other layout with the one-process run's steps 3 and 4."""
    run = rolled_back(runs[src], tmp_path / "run")
    nproc, extra = LAYOUTS[dst]
    argv = small_argv(small_data_dir, run, [*STEPS, *extra])
    if nproc == 1:
        assert main(argv) == 0
    else:
        res = ranks(argv, nproc=nproc)
        assert res.returncode == 0 and "resumed from" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    assert_same_steps(steps(run), steps(runs["single"]))


@pytest.mark.parametrize("over, world, needle", [
    ([("parallel.zero_stage", "0")], 4, r"parallel.zero_stage=0 \(DDP\) shards nothing; set parallel.zero_stage 2 or 3"),
    ([("parallel.dp_shard", "3")], 4, r"parallel.dp_shard=3 does not divide dp=4.* choose a divisor of 4"),
    ([], 1, r"parallel.dp_shard=2 does not divide dp=1"),
    ([("parallel.dp_shard", "1")], 4, r"dp_shard=1 shards nothing.* parallel.zero_stage=0"),
])
def test_layouts_hybrid_sharding_cannot_take_are_refused(over, world, needle):
    cfg = load_config("tiny", [("parallel.zero_stage", "3"), ("parallel.dp_shard", "2"), *over])
    with pytest.raises(ConfigError, match=needle):
        Layout.from_config(cfg, world)


def test_dp_shard_settings_are_refused_in_the_config():
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=0 must be a positive integer, or -1"):
        load_config("tiny", [("parallel.dp_shard", "0")])
    with pytest.raises(ConfigError, match=r"DeepSpeed's own \(hpZ / MiCS\) is not wired here: set parallel.dp_shard=-1"):
        Layout.from_config(load_config("tiny", [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "3"),
                                                ("parallel.dp_shard", "2")]), 2)


def test_dp_shard_of_all_dp_is_plain_fsdp_and_composes():
    """dp_shard = dp shards over all of dp, as -1 does: nothing to refuse with the other dimensions."""
    cfg = load_config("tiny", [("parallel.zero_stage", "3"), ("parallel.tp", "2"), ("parallel.dp_shard", "2")])
    assert Layout.from_config(cfg, 4).dp == 2
    assert Layout.from_config(load_config("tiny", [("parallel.zero_stage", "2"), ("parallel.dp_shard", "2")]), 4).dp == 4


def test_refused_before_data_or_model(tmp_path, small_argv, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    code = main(small_argv(tmp_path / "data", tmp_path / "r", ["--parallel.dp_shard", "2"]))
    err = capsys.readouterr().err
    assert code == 2 and "parallel.zero_stage=0 (DDP) shards nothing" in err, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "data").exists()
