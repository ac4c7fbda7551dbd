"""Rough edges a new user met: weights readable by the group (the umask, not safetensors' 0600), no empty data
directory left by a failed `prepare`, a negative sampling temperature refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from hybridtron.cli import main
from hybridtron.configs import ModelConfig
from hybridtron.model import GatedLM
from hybridtron.train.checkpoint import CheckpointManager, TrainerState


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640  # what a file created with 0666 gets
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def tiny_model() -> GatedLM:
    torch.manual_seed(0)
    model = GatedLM(ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64), 320)
    model.init_weights()
    return model


def test_checkpoint_and_export_weights_honour_the_umask(umask_027, tok_dir, tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    ckpt = CheckpointManager(tmp_path / "run").save(TrainerState(step=1), model, opt, "model: {}\n", tok_dir)
    assert mode(ckpt / "model.safetensors") == umask_027 == mode(ckpt / "optimizer.pt")
    pytest.importorskip("transformers")
    from hybridtron.train.hf.export import export_model

    export_model(model.eval(), tok_dir, tmp_path / "hf", log=lambda _: None)
    assert mode(tmp_path / "hf" / "model.safetensors") == umask_027 == mode(tmp_path / "hf" / "config.json")


def test_a_failed_prepare_leaves_no_directory_behind(tmp_path, capsys):
    out = tmp_path / "new" / "data"
    code = main(["prepare", "--config", "tiny", "--data.sources", f"[{{path: {tmp_path}/missing}}]",
                 "--data.out_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "matches no files" in err, err
    assert list(tmp_path.iterdir()) == []  # neither data/ nor the new/ above it
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("x")
    assert main(["prepare", "--config", "tiny", "--data.sources", f"[{{path: {tmp_path}/missing}}]",
                 "--data.out_dir", str(tmp_path / "kept" / "data")]) == 2
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]  # what existed before stays


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_sample_refuses_a_negative_temperature(value, tmp_path, capsys):
    code = main(["sample", "--checkpoint", str(tmp_path / "no_such_checkpoint"), "--temperature", value])
    err = capsys.readouterr().err
    # refused before any checkpoint is looked for
    assert code == 2 and f"--temperature {value} must be >= 0 (0 = greedy decoding)" in err, err
    assert len(err.strip().splitlines()) == 1
