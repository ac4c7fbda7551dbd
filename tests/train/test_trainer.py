"""The loop trains, resumes bitwise-exactly, and stops on non-finite losses."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from hybridtron.cli import main
from hybridtron.train.metrics import read_metrics


def _losses(run_dir):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)}


def test_validation_loss_falls_below_start(small_data_dir, cli_args, tmp_path):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, ["--train.max_steps", "60", "--train.eval_every", "20", "--train.lr", "1e-2"])) == 0
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == list(range(1, 61))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen"):
        assert all(key in r for r in recs), key
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) == 3
    # An untrained model predicts ~uniformly: its loss is ln(vocab) (~6.2 here). After 60 steps
    # the held-out loss must be far below that (at least 1 nat), and still falling.
    assert vals[-1] < math.log(512) - 1.0
    assert vals[-1] < vals[0] - 0.1
    assert recs[-1]["tokens_seen"] == 60 * 8 * 64


def test_exact_resume_matches_uninterrupted(small_data_dir, cli_args, tmp_path):
    extra = ["--train.max_steps", "16", "--train.grad_accum_steps", "2", "--checkpoint.every", "0",
             "--train.eval_every", "8"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(cli_args(small_data_dir, full, extra)) == 0
    assert main(cli_args(small_data_dir, split, extra + ["--train.exit_interval", "7"])) == 0
    assert (split / "checkpoints" / "latest").read_text() == "step_00000007"
    assert max(_losses(split)) == 7
    assert main(cli_args(small_data_dir, split, extra + ["--train.exit_interval", "7"])) == 0
    assert main(cli_args(small_data_dir, split, extra + ["--train.exit_interval", "7"])) == 0
    a, b = _losses(full), _losses(split)
    assert sorted(b) == list(range(1, 17))
    assert a == b  # bitwise: fp32 on the CPU, same data order, restored optimizer and RNG
    va = [r["val_loss"] for r in read_metrics(full) if "val_loss" in r]
    vb = [r["val_loss"] for r in read_metrics(split) if "val_loss" in r]
    assert va == vb


def test_sigterm_checkpoints_and_resumes_exactly(small_data_dir, cli_args, tmp_path):
    extra = ["--train.max_steps", "400", "--checkpoint.every", "0", "--train.eval_every", "0"]
    run = tmp_path / "sig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridtron.cli", *cli_args(small_data_dir, run, extra)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "received signal" in out
    stopped = int((run / "checkpoints" / "latest").read_text().split("_")[1])
    assert 5 <= stopped < 400
    assert max(_losses(run)) == stopped

    # resume to stopped+3 and compare with an uninterrupted run of the same length
    target = str(stopped + 3)
    extra2 = ["--checkpoint.every", "0", "--train.eval_every", "0", "--train.max_steps", "400",
              "--train.exit_interval", target]
    assert main(cli_args(small_data_dir, run, extra2)) == 0
    ref = tmp_path / "ref"
    assert main(cli_args(small_data_dir, ref, extra2)) == 0
    a, b = _losses(ref), _losses(run)
    assert sorted(b) == list(range(1, stopped + 4))
    assert a == b


def test_nan_loss_stops_without_checkpoint(small_data_dir, cli_args, tmp_path, monkeypatch, capsys):
    from hybridtron.model import GatedLM

    real = GatedLM.forward
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        out = real(self, *a, **k)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 4:
                return out * float("nan")
        return out

    monkeypatch.setattr(GatedLM, "forward", poisoned)
    run = tmp_path / "nan"
    assert main(cli_args(small_data_dir, run, ["--checkpoint.every", "2"])) == 3
    err = capsys.readouterr().err
    assert "diverged" in err and "at step 4" in err and "Traceback" not in err
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["loss"] is None and recs[-1]["skipped"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    assert not (run / "checkpoints" / "step_00000004").exists()

    calls["n"] = 0
    run2 = tmp_path / "skip"
    assert main(cli_args(small_data_dir, run2, ["--train.nan_policy", "skip", "--train.max_steps", "6"])) == 0
    recs = {r["step"]: r for r in read_metrics(run2)}
    assert recs[4].get("skipped") is True and math.isfinite(recs[6]["loss"])


def test_activation_checkpointing_same_losses_same_keys(small_data_dir, cli_args, tmp_path):
    extra = ["--train.max_steps", "6", "--checkpoint.every", "0", "--train.eval_every", "0"]
    assert main(cli_args(small_data_dir, tmp_path / "plain", extra)) == 0
    assert main(cli_args(small_data_dir, tmp_path / "ac", extra + ["--train.activation_checkpointing", "true"])) == 0
    a, b = _losses(tmp_path / "plain"), _losses(tmp_path / "ac")
    for s in a:
        assert a[s][0] == pytest.approx(b[s][0], rel=1e-5, abs=1e-6)
    from safetensors import safe_open

    keys = []
    for name in ("plain", "ac"):
        with safe_open(str(tmp_path / name / "checkpoints" / "step_00000006" / "model.safetensors"), "pt") as f:
            keys.append(sorted(f.keys()))
    assert keys[0] == keys[1] and not any("checkpoint" in k for k in keys[1])


def test_bad_config_fails_before_heavy_work(tmp_path, capsys):
    rc = main(["train", "--run-dir", str(tmp_path / "r"), "--model.n_heads", "3"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.n_heads=3" in err and "d_model=128" in err
    assert not (tmp_path / "r").exists()


def test_resume_with_other_model_is_refused(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "r"
    assert main(cli_args(small_data_dir, run, ["--train.max_steps", "6", "--train.eval_every", "0"])) == 0
    rc = main(cli_args(small_data_dir, run, ["--model.n_layers", "3"]))
    assert rc == 2 and "model.n_layers" in capsys.readouterr().err


def test_metrics_jsonl_has_no_duplicate_steps_after_crash(small_data_dir, cli_args, tmp_path):
    run = tmp_path / "r"
    extra = ["--train.max_steps", "6", "--train.eval_every", "0", "--checkpoint.every", "3",
             "--checkpoint.at_exit", "false"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    # simulate a crash after step 6 but before any checkpoint at 6: drop checkpoints past 3
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "checkpoints" / "latest").write_text("step_00000003")
    assert main(cli_args(small_data_dir, run, extra)) == 0
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_bf16_autocast_and_mfu_fields(small_data_dir, cli_args, tmp_path):
    """bf16 autocast (the GPU default) runs through the same loop on the CPU; MFU is logged when a peak is known."""
    from hybridtron.configs import load_config
    from hybridtron.model import flops_per_token

    run = tmp_path / "bf16"
    peak = 1e12
    extra = ["--train.max_steps", "6", "--train.eval_every", "3", "--train.dtype", "bf16",
             "--train.peak_flops", str(peak)]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    recs = read_metrics(run)
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert recs[-1]["loss"] < math.log(512)
    cfg = load_config(str(run / "config.yaml"))
    fpt = flops_per_token(cfg.model, cfg.model.vocab_size, cfg.data.seq_len)
    for r in recs:
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / peak, rel=1e-9)
    # the same run in fp32 differs: autocast really changed the arithmetic
    run32 = tmp_path / "fp32"
    assert main(cli_args(small_data_dir, run32, extra[:-4])) == 0
    assert read_metrics(run32)[0]["loss"] != recs[0]["loss"]
    assert "mfu" not in read_metrics(run32)[0]  # CPU without a configured peak: no made-up MFU


def test_data_errors_are_one_clear_line(tmp_path, capsys):
    rc = main(["prepare", "--data.sources", f"[{{path: {tmp_path}/nothing/*.txt}}]",
               "--data.out_dir", str(tmp_path / "d")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "matches no files" in err and "nothing" in err and "Traceback" not in err


def test_doc_mask_passes_document_ids(small_data_dir, cli_args, tmp_path, monkeypatch):
    """model.doc_mask hands the packed document ids to the model (whose masking math tests/model checks)."""
    from hybridtron.model import GatedLM

    real, seen = GatedLM.forward, []

    def spy(self, input_ids, doc_ids=None, labels=None):
        if self.training:
            seen.append(doc_ids)
        return real(self, input_ids, doc_ids, labels=labels)

    monkeypatch.setattr(GatedLM, "forward", spy)
    extra = ["--train.max_steps", "6", "--train.eval_every", "0", "--checkpoint.every", "0"]
    assert main(cli_args(small_data_dir, tmp_path / "plain", extra)) == 0
    assert len(seen) == 6 and all(d is None for d in seen)
    seen.clear()
    assert main(cli_args(small_data_dir, tmp_path / "doc", extra + ["--model.doc_mask", "true"])) == 0
    assert len(seen) == 6 and all(d is not None and d.shape == (8, 64) for d in seen)
    assert all(int(d[:, 0].abs().sum()) == 0 for d in seen)  # ids restart at 0 in every sample


def test_peak_flops_picks_the_variant_before_its_family():
    from hybridtron.train.metrics import peak_flops_for_name

    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA H100 NVL") == 835e12  # not the SXM figure of the bare "H100" key
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("Some Future GPU") is None


@pytest.mark.slow
def test_resume_with_longer_cosine_keeps_the_lr(small_data_dir, cli_args, tmp_path, capsys):
    """A cosine run resumed with a larger train.max_steps continues at its floor (no jump to a re-stretched
    curve); the plan is saved in the checkpoint and the resume logs what it made of the new settings."""
    from hybridtron.configs import load_config

    extra = ["--train.warmup_steps", "2", "--checkpoint.every", "0", "--train.eval_every", "0"]
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, extra + ["--train.max_steps", "8"])) == 0
    saved = json.loads((run / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert saved["extra"]["schedule"]["end"] == 8 and saved["extra"]["schedule"]["kind"] == "cosine"
    capsys.readouterr()
    assert main(cli_args(small_data_dir, run, extra + ["--train.max_steps", "12", "--train.lr", "1e-2"])) == 0
    out = capsys.readouterr()
    assert "schedule_on_resume=keep" in out.out + out.err and "train.lr=0.01" in out.out + out.err
    lrs = {r["step"]: r["lr"] for r in read_metrics(run)}
    train = load_config("tiny").train
    floor = train.lr * train.min_lr_ratio
    assert floor < lrs[8] < 2 * floor  # the last step of the first run, one step above its floor
    assert [lrs[s] for s in range(9, 13)] == pytest.approx([floor] * 4, rel=1e-9)
