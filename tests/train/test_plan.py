"""`hybridtron plan`: per-GPU memory by category from a step on fake tensors, communication per step, and the
prediction checked against a real step (one process here, two gloo processes under torchrun)."""

from __future__ import annotations

import json

import pytest

from hybridtron.configs import load_config
from hybridtron.train.cli import main
from hybridtron.train.plan import GIB, comm_bytes, n_params, plan_table

SMALL = [("model.n_layers", "2"), ("model.d_model", "64"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
         ("data.seq_len", "64"), ("train.micro_batch_size", "4"), ("train.dtype", "fp32")]


def test_plan_divides_state_by_the_zero_stage():
    cfg = load_config("tiny", SMALL)
    P = n_params(cfg)
    rows = {r["zero_stage"]: r for r in plan_table(cfg, world=4, gpu_memory_gib=80)}
    rel = pytest.approx
    # fp32 weights and AdamW's two fp32 moments: whole with DDP, a quarter each with ZeRO-2/3 on 4 GPUs
    # (the rotary tables are the only buffers: a few KiB).
    assert rows[0]["weights"] == rel(4 * P / GIB, rel=0.02) and rows[0]["optimizer"] == rel(8 * P / GIB, rel=0.02)
    for z in (2, 3):
        assert rows[z]["weights"] == rel(P / GIB, rel=0.05) and rows[z]["optimizer"] == rel(2 * P / GIB, rel=0.05)
        assert rows[z]["gathered"] > 0
    assert rows[2]["gathered"] >= rows[3]["gathered"]  # ZeRO-2 holds every layer gathered until backward
    assert rows[0]["comm_gb_per_step"] == rel(2 * 0.75 * 4 * P / 1e9)
    assert rows[2]["comm_gb_per_step"] == rel((0.75 * 4 * P + 0.75 * 4 * P) / 1e9)
    assert rows[3]["comm_gb_per_step"] == rel((2 * 0.75 * 4 * P + 0.75 * 4 * P) / 1e9)
    assert all(r["fits"] for r in rows.values())
    assert not any(r["fits"] for r in plan_table(cfg, world=4, gpu_memory_gib=0.001))
    assert comm_bytes(P, 1, 3, 4, 2) == 0


def test_activation_checkpointing_lowers_the_planned_activations():
    plain = plan_table(load_config("tiny", SMALL), 1, 80, stages=(0,))[0]
    ckpt = plan_table(load_config("tiny", [*SMALL, ("train.activation_checkpointing", "true")]), 1, 80, stages=(0,))[0]
    assert ckpt["activations"] < plain["activations"]


def test_plan_cli_prints_a_row_per_stage(capsys):
    assert main(["plan", "--config", "tiny", "--gpus-per-node", "2", *[f"--{k}={v}" for k, v in SMALL]]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs, dp=2" in out and [ln.split("|")[1].strip() for ln in out.splitlines()
                                      if ln.startswith("| ") and ln[2].isdigit()] == ["0", "2", "3"]


def _measured(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def test_measured_step_matches_the_plan_on_one_process(capsys):
    assert main(["plan", "--config", "tiny", "--measure", *[f"--{k}={v}" for k, v in SMALL]]) == 0
    res = _measured(capsys.readouterr().out)
    assert 0.9 <= res["predicted_over_measured"] <= 1.1, res


@pytest.mark.slow
def test_measured_step_matches_the_plan_under_zero3_on_two_processes():
    from .test_data_parallel import torchrun

    res = torchrun(["plan", "--config", "tiny", "--measure", "--parallel.zero_stage", "3",
                    *[f"--{k}={v}" for k, v in SMALL]])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = _measured(res.stdout)
    assert got["dp"] == 2 and got["zero_stage"] == 3 and 0.9 <= got["predicted_over_measured"] <= 1.1, got
    assert got["measured_gib"]["gathered"] > 0


def test_plan_refuses_the_deepspeed_engine(capsys):
    assert main(["plan", "--parallel.engine", "deepspeed"]) == 2
    assert "plan models the torch engine" in capsys.readouterr().err


@pytest.mark.parametrize("dim", ["tp", "pp", "ep", "cp"])
def test_plan_refuses_the_model_splitting_dimensions_by_name(dim, capsys):
    over = ["--model.moe.n_experts", "4"] if dim == "ep" else []
    assert main(["plan", f"--parallel.{dim}", "2", *over]) == 2
    err = capsys.readouterr().err
    assert f"not parallel.{dim}=2" in err and "with those set to 1" in err, err


def test_plan_with_gradient_accumulation_and_checkpointing():
    # Several micro-batches per step (each module runs more than once per step) with recomputation.
    over = [*SMALL, ("train.grad_accum_steps", "3"), ("train.activation_checkpointing", "true")]
    one = {r["zero_stage"]: r for r in plan_table(load_config("tiny", SMALL), 2, 80, stages=(0, 3))}
    acc = {r["zero_stage"]: r for r in plan_table(load_config("tiny", over), 2, 80, stages=(0, 3))}
    for z in (0, 3):
        assert acc[z]["optimizer"] == pytest.approx(one[z]["optimizer"])
        assert acc[z]["comm_gb_per_step"] == pytest.approx(one[z]["comm_gb_per_step"] * (3 if z else 1))
