"""``eval`` and ``sample`` take ``--model.kernels.<op>`` overrides: a run is evaluated with another backend (our
Triton kernel under the interpreter, torch's SDPA, flex attention's forward) and gives the reference's loss."""

from __future__ import annotations

import json

import pytest

from hybridtron.cli import main
from hybridtron.kernels import backend


@pytest.mark.slow
def test_eval_and_sample_with_other_attention_backends(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, ["--train.max_steps", "2", "--train.warmup_steps", "1",
                                               "--train.eval_every", "0", "--model.doc_mask", "true"])) == 0
    capsys.readouterr()
    losses = {}
    for name in ("reference", "triton", "sdpa", "flex"):
        backend.clear_cache()
        assert main(["eval", "--run-dir", str(run), "--batches", "1", "--model.kernels.attention", name]) == 0
        losses[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"]
    assert all(abs(v - losses["reference"]) < 1e-4 for v in losses.values()), losses
    texts = []
    for name in ("reference", "sdpa"):  # decoding runs SDPA with the cache; the prompt's prefill the backend asked
        assert main(["sample", "--run-dir", str(run), "--max-new-tokens", "4", "--temperature", "0",
                     "--model.kernels.attention", name]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert main(["eval", "--run-dir", str(run), "--model.kernels.attention", "fla"]) == 2  # refused in one line
    assert "fla does not implement attention" in capsys.readouterr().err
