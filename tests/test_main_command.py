"""The README's main command, end to end at a small step count, then eval and sample on its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtron.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, stdout_only=False):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{cmd} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout if stdout_only else p.stdout + p.stderr


@pytest.mark.slow
def test_run_sh_train_twice_resumes_then_eval_and_sample(tmp_path, small_data_dir):
    # run.sh sets up the environment it is pointed at (here: the one running the tests, already
    # installed) and runs `hybridtron train`; the corpus is capped so this takes seconds.
    env = {**os.environ, "HYBRIDTRON_VENV": sys.prefix, "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "runs" / "tiny"
    data = tmp_path / "data"
    args = ["--run-dir", str(run), "--data.out_dir", str(data),
            "--data.sources", "[{path: stdlib, max_files: 30}]", "--data.tokenizer.vocab_size", "400",
            "--train.max_steps", "12", "--train.warmup_steps", "2", "--train.eval_every", "6",
            "--train.eval_batches", "2", "--train.exit_interval", "6", "--checkpoint.every", "6"]
    out1 = _run([str(REPO / "run.sh"), "train", *args], tmp_path, env)
    assert "stopped at step 6/12 (exit_interval)" in out1
    assert "run the same command again to resume" in out1 and "to train on" not in out1
    for line in ("run directory:", "metrics:", "tensorboard:", "checkpoint:", "data+tokenizer:"):
        assert line in out1
    assert (data / "tokenizer").is_dir()
    out2 = _run([str(REPO / "run.sh"), "train", *args], tmp_path, env)
    assert "resumed from" in out2 and "stopped at step 12/12 (max_steps)" in out2
    # finished: a rerun would stop at once, so the line says how to train on (issue 39.4)
    assert "to train on, run the same command with --train.max_steps N, N > 12: it resumes from step_00000012" in out2
    # not a terminal: plain progress lines for log files instead of a redrawn bar
    assert "step 10/12  loss" in out2 and "\r" not in out2

    recs = read_metrics(run)
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000006", "step_00000012"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000012"
    ck = run / "checkpoints" / "step_00000012"
    for f in ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml"):
        assert (ck / f).is_file(), f
    assert any((ck / "tokenizer").iterdir())
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "vocab_size: 448" in (run / "config.yaml").read_text()  # 400 ids padded to a multiple of 64

    cli = [sys.executable, "-m", "hybridtron.cli"]
    ev = json.loads(_run([*cli, "eval", "--run-dir", str(run)], tmp_path, env, stdout_only=True))  # the JSON alone
    assert ev["val_loss"] == pytest.approx(recs[-1]["val_loss"], rel=1e-6)
    text = _run([*cli, "sample", "--run-dir", str(run), "--prompt", "import ", "--max-new-tokens", "20",
                 "--temperature", "0"], tmp_path, env)
    assert text.startswith("import ")
