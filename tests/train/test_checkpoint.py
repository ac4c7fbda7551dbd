"""Checkpoints are atomic, pruned, and restore model, optimizer and RNG exactly."""

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from hybridtron.atomic import parse_scratch, this_host
from hybridtron.train import checkpoint as ck
from hybridtron.train.checkpoint import CheckpointError, CheckpointManager, TrainerState


def _setup(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    return model, opt, tok


def test_save_load_roundtrip_and_rng(tmp_path):
    model, opt, tok = _setup(tmp_path)
    mgr = CheckpointManager(tmp_path / "run", keep_last=2)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    path = mgr.save(TrainerState(step=3, consumed_samples=48, tokens_seen=999), model, opt, "a: 1\n", tok)
    expect = (torch.rand(3), random.random(), np.random.rand())
    assert (path / "tokenizer" / "tokenizer.json").is_file() and (path / "config.yaml").read_text() == "a: 1\n"

    model2 = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    state = CheckpointManager.load(mgr.latest(), model2, opt2)
    assert state == TrainerState(3, 48, 999)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expect[0], got[0]) and expect[1] == got[1] and expect[2] == got[2]


def test_keep_last_and_latest_pointer(tmp_path):
    model, opt, tok = _setup(tmp_path)
    mgr = CheckpointManager(tmp_path / "run", keep_last=2)
    for s in (10, 20, 30):
        mgr.save(TrainerState(step=s), model, opt, "", tok)
    assert [p.name for p in mgr.complete()] == ["step_00000020", "step_00000030"]
    assert (mgr.dir / "latest").read_text() == "step_00000030"
    assert mgr.latest().name == "step_00000030"


def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, tok = _setup(tmp_path)
    mgr = CheckpointManager(tmp_path / "run", keep_last=3)
    mgr.save(TrainerState(step=10), model, opt, "", tok)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", boom)
    with pytest.raises(OSError):
        mgr.save(TrainerState(step=20), model, opt, "", tok)
    monkeypatch.undo()
    assert mgr.latest().name == "step_00000010"
    assert [p.name for p in mgr.complete()] == ["step_00000010"]
    # A failed save removes its temporary directory; one left by a killed process goes at the next start.
    assert not [p for p in mgr.dir.iterdir() if ".tmp-" in p.name]
    (mgr.dir / ".tmp-step_00000020-999").mkdir()
    mgr.clean_partial()
    assert not [p for p in mgr.dir.iterdir() if ".tmp-" in p.name]


def test_a_save_writes_under_its_scratch_name_and_the_next_start_removes_partial_saves(tmp_path, monkeypatch, capsys,
                                                                                      dead_pid, live_pid):
    model, opt, tok = _setup(tmp_path)
    mgr = CheckpointManager(tmp_path / "run", keep_last=3)
    mgr.save(TrainerState(step=10), model, opt, "", tok)
    seen = []

    def boom(*a, **k):
        seen.extend(parse_scratch(p.name) for p in mgr.dir.iterdir() if p.name.startswith("."))
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", boom)
    with pytest.raises(OSError):
        mgr.save(TrainerState(step=20), model, opt, "", tok)
    monkeypatch.undo()
    assert seen == [("step_00000020", this_host(), os.getpid())]  # the name reclaim_scratch reads

    host, run = this_host(), mgr.dir.parent

    def left(path, is_dir=True):
        if is_dir:
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"half")
        else:
            path.write_text("step_00000020")
        return path

    # Every process of the run is at its start: every partial save goes, from any node, in any naming ...
    gone = [left(mgr.dir / f".step_00000020.tmp-{host}-{dead_pid}"), left(mgr.dir / f".step_00000030.tmp-node9-{dead_pid}"),
            left(mgr.dir / f".latest.tmp-{host}-{dead_pid}", is_dir=False), left(mgr.dir / f".tmp-step_00000040-{dead_pid}"),
            left(mgr.dir / ".tmp-step_00000050-sharded"), left(run / f".metrics.jsonl.tmp-{host}-{dead_pid}", False)]
    # ... but a save seen alive on this host (another run in this directory), and in the run directory, which other
    # commands write too, another node's scratch stay
    kept = [left(mgr.dir / f".step_00000060.tmp-{host}-{live_pid}"), left(run / f".config.yaml.tmp-node9-{dead_pid}", False)]
    lines = []
    assert sorted(mgr.clean_partial(log=lines.append)) == sorted(gone)
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)
    assert len(lines) == 1 and lines[0].startswith(f"removed 6 scratch entries of interrupted writes in {run}: ")
    assert all(p.name in lines[0] for p in gone)
    assert [p.name for p in mgr.complete()] == ["step_00000010"] and mgr.latest().name == "step_00000010"
    # Without a log, rank 0 prints the line.
    left(mgr.dir / f".step_00000070.tmp-{host}-{dead_pid}")
    capsys.readouterr()
    mgr.clean_partial()
    assert capsys.readouterr().out.startswith(f"[hybridtron] removed 1 scratch entry of interrupted writes in {mgr.dir}")


def test_stale_latest_pointer_falls_back(tmp_path):
    model, opt, tok = _setup(tmp_path)
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(TrainerState(step=10), model, opt, "", tok)
    (mgr.dir / "latest").write_text("step_00000099")
    assert mgr.latest().name == "step_00000010"


def test_mismatched_model_is_a_clear_error(tmp_path):
    model, opt, tok = _setup(tmp_path)
    mgr = CheckpointManager(tmp_path / "run")
    path = mgr.save(TrainerState(step=1), model, opt, "", tok)
    other = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 3))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        CheckpointManager.load(path, other)
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="incomplete"):
        CheckpointManager.load(path, model)


def test_optimizer_file_holds_no_pickled_code(tmp_path):
    model, opt, tok = _setup(tmp_path)
    path = CheckpointManager(tmp_path / "run").save(TrainerState(step=1), model, opt, "", tok)
    # weights_only=True refuses arbitrary objects; loading must succeed with it
    torch.load(path / "optimizer.pt", weights_only=True)
    torch.load(path / "rng.pt", weights_only=True)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "nested"])
def test_a_sharded_checkpoint_loads_with_its_optimizer_state_flat_or_nested(flat, tmp_path):
    """dcp/ holds the optimizer state flattened by parameter name since 2026-11-29 (what lets a pipeline resume);
    checkpoints written before hold torch's nested form (numbered param groups). Both load, each read in its own
    form (`_optimizer_is_flat`), hyperparameters and moments included."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, tok = _setup(tmp_path)
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    path = CheckpointManager(tmp_path / "run").save(TrainerState(step=3), model, opt, "a: 1\n", tok)
    msd, osd = get_state_dict(model, opt, options=ck._flat_optimizer() if flat else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: DCP says it saves alone
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / ck.SHARDED))
    for name in ("model.safetensors", "optimizer.pt"):
        (path / name).unlink()
    keys = list(dcp.FileSystemReader(str(path / ck.SHARDED)).read_metadata().state_dict_metadata)
    assert ("optim.param_groups.0.betas" in keys) != flat and ck._optimizer_is_flat(path) == flat, keys
    model2 = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    CheckpointManager.load(path, model2, opt2, restore_rng_state=False, verify=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(),
                                                  strict=True))
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert all(torch.equal(s1["state"][k]["exp_avg_sq"], s2["state"][k]["exp_avg_sq"]) for k in s1["state"])
    assert s2["param_groups"][0]["betas"] == (0.8, 0.9)
