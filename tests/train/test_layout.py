"""The process layout is resolved and refused from the config and the launcher's environment alone."""

from __future__ import annotations

import pytest

from hybridtron.configs import ConfigError, load_config
from hybridtron.train.distributed import Mesh, launch_world, resolve_layout


def test_dp_minus_one_takes_every_process():
    cfg = load_config("tiny")
    assert resolve_layout(cfg, 1) == 1 and resolve_layout(cfg, 8) == 8


def test_fixed_dp_must_match_the_world():
    cfg = load_config("tiny", [("parallel.dp", "4")])
    assert resolve_layout(cfg, 4) == 4
    with pytest.raises(ConfigError, match=r"needs 4 processes, but the launcher started 2 \(WORLD_SIZE\)"):
        resolve_layout(cfg, 2)


def test_self_guided_ffn_is_refused_under_fsdp_but_not_ddp():
    over = [("model.ffn.kind", "lowrank"), ("model.ffn.rank", "16"), ("model.ffn.self_guided", "true")]
    assert resolve_layout(load_config("tiny", over), 2) == 2
    with pytest.raises(ConfigError, match="model.ffn.self_guided .* parallel.zero_stage=0"):
        resolve_layout(load_config("tiny", [*over, ("parallel.zero_stage", "3")]), 2)


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
