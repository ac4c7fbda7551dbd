"""A user's DeepSpeed JSON (`parallel.deepspeed_config`): honoured as given or refused by name, never dropped.

Fast tests check what the merge fills, keeps and refuses (an optimizer block other than the job's AdamW, a
scheduler, sections the trainer never runs, another precision), and that a refusal comes before any data or model.
One slow test trains with a JSON of ZeRO-2 tuning keys and an AdamW block on two processes (`torchrun`, gloo)
and checks the engine was given those keys and that the steps are the one-process run's.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from hybridtron.cli import main
from hybridtron.configs import ConfigError, load_config
from hybridtron.train.parallel.deepspeed_engine import EFFECTIVE, deepspeed_config

from .test_data_parallel import STEPS, assert_same_steps, assert_same_weights, ranks, steps

CPU = torch.device("cpu")
DS = [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "2")]


def merged(tmp_path, user: dict, over=()) -> dict:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    return deepspeed_config(load_config("tiny", [*DS, *over, ("parallel.deepspeed_config", str(path))]), 2, CPU)


def test_an_adamw_block_is_filled_from_the_job_and_other_keys_reach_the_engine_as_given(tmp_path):
    t = load_config("tiny").train
    conf = merged(tmp_path, {
        "optimizer": {"type": "adamw", "params": {"lr": t.lr, "betas": "auto", "weight_decay": t.weight_decay,
                                                   "torch_adam": True}},
        "zero_optimization": {"stage": "auto", "overlap_comm": True, "reduce_bucket_size": 12345,
                              "contiguous_gradients": False},
        "communication_data_type": "fp32", "wall_clock_breakdown": True, "steps_per_print": 7,
        "curriculum_learning": {"enabled": False}})
    assert conf["optimizer"] == {"type": "adamw", "params": {
        "lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps, "weight_decay": t.weight_decay, "torch_adam": True}}
    assert conf["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 12345,
                                         "contiguous_gradients": False}
    assert conf["communication_data_type"] == "fp32" and conf["wall_clock_breakdown"] is True
    assert conf["steps_per_print"] == 7 and conf["zero_allow_untested_optimizer"] is True  # a default, ours
    assert conf["curriculum_learning"] == {"enabled": False}  # switched off: nothing to refuse


@pytest.mark.parametrize("user, needle", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
     r"sets optimizer.params.lr=0.0001 but this job needs 0.003 \(from train.lr\); .* or set train.lr to match"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.999]}}},
     r"optimizer.params.betas=\[0.9, 0.999\] .* \(from train.beta1 and train.beta2\)"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, r"optimizer.params.eps=1e-06 .* set train.eps"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}}}, r"\(from train.weight_decay\)"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, r"adam_w_mode=False .* decouples weight"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, r"amsgrad=True .* no AMSGrad"),
    ({"optimizer": {"type": "AdamW", "params": {"freeze_step": 5}}}, r"sets optimizer freeze_step, which"),
    ({"optimizer": {"type": "OneBitLamb", "params": {}}}, r"optimizer type 'OneBitLamb', .* make it type AdamW"),
    ({"optimizer": {"params": {}}}, r"optimizer type None"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
     r'sets "scheduler", .* train.lr, train.schedule \(cosine, wsd, constant\), train.warmup_steps'),
    ({"activation_checkpointing": {"partition_activations": True}}, r"use train.activation_checkpointing"),
    ({"dataloader_drop_last": True}, r'"dataloader_drop_last", .* data loader is hybridtron'),
    ({"fp16": {"enabled": True}}, r"fp16.enabled=True but this job needs False \(train.dtype is fp32 or bf16"),
    ({"bf16": {"enabled": True}}, r"bf16.enabled=True but this job needs False \(from train.dtype\)"),
    ({"bfloat16": {"enabled": True}}, r"bf16.enabled=True .* \(from train.dtype\)"),
    ({"gradient_clipping": 0.5}, r"gradient_clipping=0.5 but this job needs 1.0 \(from train.grad_clip\)"),
    ({"zero_force_ds_cpu_optimizer": True}, r"zero_force_ds_cpu_optimizer=True .* hybridtron's torch AdamW"),
])
def test_what_the_trainer_would_not_honour_is_refused_by_name(tmp_path, user, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        merged(tmp_path, user)
    assert "\n" not in str(e.value)


def test_a_refused_json_stops_the_run_before_data_or_model(small_data_dir, small_argv, tmp_path, capsys):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"scheduler": {"type": "WarmupLR"}}))
    run = tmp_path / "run"
    argv = small_argv(small_data_dir, run, ["--parallel.engine", "deepspeed", "--parallel.deepspeed_config", str(user)])
    assert main(argv) == 2
    assert 'sets "scheduler"' in capsys.readouterr().err
    assert not run.exists()  # refused before rank 0 wrote config.yaml, let alone built a model


@pytest.mark.slow
def test_a_users_json_trains_on_two_processes_like_one_process(small_data_dir, small_argv, tmp_path):
    t = load_config("tiny").train
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 20000,
                              "allgather_bucket_size": 20000, "contiguous_gradients": True},
        "communication_data_type": "fp32",
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "weight_decay": "auto"}}}))
    single, ds = tmp_path / "single", tmp_path / "ds"
    assert main(small_argv(small_data_dir, single, [*STEPS, "--train.grad_accum_steps", "2"])) == 0
    res = ranks(small_argv(small_data_dir, ds, [*STEPS, "--parallel.engine", "deepspeed",
                                                   "--parallel.zero_stage", "2", "--parallel.deepspeed_config",
                                                   str(user)]))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    given = json.loads((ds / EFFECTIVE).read_text())  # rank 0's engine.config: the dict DeepSpeed parsed
    assert given["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 20000,
                                          "allgather_bucket_size": 20000, "contiguous_gradients": True}
    assert given["communication_data_type"] == "fp32" and given["train_batch_size"] == 8
    assert given["optimizer"]["params"]["weight_decay"] == t.weight_decay
    # and DeepSpeed reads them where they were meant (this process has no group: one rank's batch)
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig({k: v for k, v in given.items() if k != "train_batch_size"})
    z = parsed.zero_config
    assert (z.stage, z.overlap_comm, z.reduce_bucket_size, z.allgather_bucket_size) == (2, True, 20000, 20000)
    assert parsed.communication_data_type == torch.float32 and parsed.gradient_clipping == t.grad_clip
    assert_same_steps(steps(ds), steps(single))
    assert_same_weights(ds, single)


def test_a_refused_run_leaves_no_process_group_behind(tmp_path, small_data_dir, small_argv):
    """DeepSpeed on one process gets a one-rank group of its own; a run refused after it was made must not leave
    it to the next run in the same process (the planner, for one, refuses to start inside a process group)."""
    import torch.distributed as dist

    ds = tmp_path / "ds.json"
    ds.write_text('{"scheduler": {"type": "WarmupLR"}}')
    assert main(small_argv(small_data_dir, tmp_path / "run", ["--parallel.engine", "deepspeed",
                                                              "--parallel.deepspeed_config", str(ds)])) == 2
    assert not dist.is_initialized()


def test_deepspeed_on_a_cpu_builds_no_extension(tmp_path, small_data_dir, small_argv, monkeypatch):
    """DeepSpeed's CPU backend would compile its shared-memory all-reduce (about 2 minutes of C++ on a fresh
    machine) though training never calls it: nothing is built into an empty extensions directory."""
    ext = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    t0 = time.monotonic()
    try:  # one process: the engine sets LOCAL_RANK=0 for DeepSpeed, which must not outlive this test
        assert main(small_argv(small_data_dir, tmp_path / "run", ["--parallel.engine", "deepspeed",
                                                                  "--train.max_steps", "2"])) == 0
    finally:
        os.environ.pop("LOCAL_RANK", None)
    assert not any(ext.rglob("*.so")), sorted(ext.rglob("*"))
    assert time.monotonic() - t0 < 60
