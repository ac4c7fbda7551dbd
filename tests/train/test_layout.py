"""The process layout is resolved and refused from the config and the launcher's environment alone."""

from __future__ import annotations

import pytest

from hybridtron.configs import ConfigError, load_config
from hybridtron.train.parallel.layout import Layout
from hybridtron.train.parallel.mesh import Mesh, launch_world


def test_dp_minus_one_takes_every_process():
    cfg = load_config("tiny")
    assert Layout.from_config(cfg, 1).dp == 1 and Layout.from_config(cfg, 8).dp == 8


def test_fixed_dp_must_match_the_world():
    cfg = load_config("tiny", [("parallel.dp", "4")])
    assert Layout.from_config(cfg, 4).dp == 4
    with pytest.raises(ConfigError, match=r"needs 4 processes, but the launcher started 2 \(WORLD_SIZE\)"):
        Layout.from_config(cfg, 2)


def test_self_guided_ffn_is_refused_under_fsdp_and_deepspeed_but_not_ddp():
    over = [("model.ffn.kind", "lowrank"), ("model.ffn.rank", "16"), ("model.ffn.self_guided", "true")]
    assert Layout.from_config(load_config("tiny", over), 2).dp == 2
    with pytest.raises(ConfigError, match="model.ffn.self_guided .* parallel.zero_stage=0"):
        Layout.from_config(load_config("tiny", [*over, ("parallel.zero_stage", "3")]), 2)
    with pytest.raises(ConfigError, match="model.ffn.self_guided .* DeepSpeed engine"):
        Layout.from_config(load_config("tiny", [*over, ("parallel.engine", "deepspeed")]), 1)


def test_launcher_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert launch_world() == (0, 0, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ConfigError, match="RANK=5 and WORLD_SIZE=4"):
        launch_world()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="not integers"):
        launch_world()


def test_one_process_mesh_is_inert(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    import torch

    mesh = Mesh.setup(load_config("tiny"), torch.device("cpu"))
    assert not mesh.distributed and mesh.is_main and mesh.dp == 1
    t = torch.tensor([3.0])
    assert mesh.mean(2.5) == 2.5 and mesh.any(False) is False and mesh.sum_(t) is t and t.item() == 3.0
    assert mesh.broadcast("x") == "x"


def test_deepspeed_json_is_built_from_the_job_and_a_users_file_is_honoured(tmp_path):
    import json

    import torch

    from hybridtron.train.parallel.deepspeed_engine import deepspeed_config

    cpu = torch.device("cpu")
    over = [("parallel.engine", "deepspeed"), ("parallel.zero_stage", "2"), ("train.micro_batch_size", "4"),
            ("train.grad_accum_steps", "3"), ("parallel.offload_optimizer", "true")]
    conf = deepspeed_config(load_config("tiny", over), dp=2, device=cpu)
    assert conf["train_batch_size"] == 24 and conf["gradient_accumulation_steps"] == 3
    assert conf["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert conf["bf16"] == {"enabled": False} and conf["fp16"] == {"enabled": False}  # fp32 on the CPU
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
        "stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7}, "communication_data_type": "fp32"}))
    conf = deepspeed_config(load_config("tiny", [*over, ("parallel.deepspeed_config", str(user))]), 2, cpu)
    assert conf["train_micro_batch_size_per_gpu"] == 4 and conf["communication_data_type"] == "fp32"
    assert conf["zero_optimization"]["overlap_comm"] is True and conf["zero_optimization"]["reduce_bucket_size"] == 5e7
    user.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"sets zero_optimization.stage=3 but this job needs 2"):
        deepspeed_config(load_config("tiny", [*over, ("parallel.deepspeed_config", str(user))]), 2, cpu)


@pytest.mark.parametrize("over, needle", [
    ([("parallel.zero_stage", "1")], "needs parallel.engine=deepspeed"),
    ([("parallel.offload_optimizer", "true")], "need parallel.engine=deepspeed"),
    ([("parallel.engine", "deepspeed"), ("parallel.deepspeed_config", "/nonexistent/ds.json")], "is not a file"),
    ([("parallel.engine", "deepspeed"), ("train.nan_policy", "skip")], "nan_policy=skip is not available"),
])
def test_deepspeed_settings_are_refused_where_they_cannot_work(over, needle):
    with pytest.raises(ConfigError, match=needle):
        Layout.from_config(load_config("tiny", over), 1)


@pytest.mark.parametrize("over, world, needle", [
    ([("model.ffn.kind", "lowrank"), ("model.ffn.rank", "16")], 2, "not structured feed-forwards"),
    ([("model.layer_pattern", "LA"), ("model.deltanet.n_k_heads", "1")], 2,
     r"n_k_heads \(Gated DeltaNet key heads\)=1 is not divisible"),
    ([("model.moe.n_experts", "4"), ("model.moe.expert_hidden", "33")], 2, "expert_hidden .*=33 is not divisible"),
    ([("model.scale.two_sided", "true")], 2, "scale vectors"),
    ([("model.n_kv_heads", "1")], 2, "model.n_kv_heads=1 is not divisible by parallel.tp=2"),
    ([("data.seq_len", "127")], 2, "data.seq_len=127 is not divisible"),
    ([("parallel.zero_stage", "0")], 4, "needs parallel.zero_stage 2 or 3"),
])
def test_tensor_parallel_refuses_what_it_cannot_shard(over, world, needle):
    with pytest.raises(ConfigError, match=needle):
        Layout.from_config(load_config("tiny", [("parallel.tp", "2"), *over]), world)


def test_tensor_parallel_layout_resolves():
    cfg = load_config("tiny", [("parallel.tp", "2"), ("parallel.zero_stage", "3")])
    assert Layout.from_config(cfg, 2).dp == 1 and Layout.from_config(cfg, 8).dp == 4
    with pytest.raises(ConfigError, match="a multiple of 2"):
        Layout.from_config(cfg, 3)


def test_only_the_mesh_creates_process_groups():
    """One object owns the layout: no module but train/parallel/mesh.py creates a process group or device mesh
    (the planner's fake single-process world aside)."""
    import re
    from pathlib import Path

    import hybridtron

    root = Path(hybridtron.__file__).parent
    creating = re.compile(r"\b(new_group|init_process_group|init_device_mesh|DeviceMesh)\(")
    found = {str(p.relative_to(root)) for folder in ("train", "model", "kernels", "data_pipeline", "slurm")
             for p in (root / folder).rglob("*.py") if creating.search(p.read_text())}
    assert found == {"train/parallel/mesh.py", "train/plan/memory.py"}, found
