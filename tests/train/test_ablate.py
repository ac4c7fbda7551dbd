"""`hybridtron ablate`: variants of one preset on the same data and steps -> table, JSON and loss plot."""

from __future__ import annotations

import json
import os
import re

import pytest

from hybridtron.cli import main
from hybridtron.train.ablate import parse_variant


def ablate_argv(cli_args, data_dir, out, variants, extra=()):
    argv = cli_args(data_dir, out, ["--train.max_steps", "4", "--train.warmup_steps", "1", "--train.eval_every", "2",
                                    "--checkpoint.every", "0", *extra])
    argv[0] = "ablate"
    for v in variants:
        argv += ["--variant", v]
    return argv


@pytest.mark.slow
def test_ablate_writes_table_json_and_plot(small_data_dir, cli_args, tmp_path, capsys):
    out = tmp_path / "abl"
    variants = ["base:", "moe:model.moe.n_experts=4,model.moe.top_k=1", "hybrid:model.layer_pattern=LA"]
    assert main(ablate_argv(cli_args, small_data_dir, out, variants)) == 0
    res = json.loads((out / "ablation.json").read_text())["variants"]
    assert list(res) == ["base", "moe", "hybrid"]
    for name, r in res.items():
        assert r["steps"] == 4, name
        assert 0 < r["final_train_loss"] < 10 and 0 < r["final_val_loss"] < 10
        assert r["tokens_per_s"] > 0
        metrics = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert r["final_val_loss"] == [m["val_loss"] for m in metrics if "val_loss" in m][-1]
    assert res["base"]["params"] == res["base"]["active_params"]
    assert res["moe"]["active_params"] < res["moe"]["params"]  # 4 experts, one active per token
    assert res["moe"]["overrides"] == [["model.moe.n_experts", "4"], ["model.moe.top_k", "1"]]
    # Same data: the first step's loss of the base and hybrid runs differ only through the model, so
    # both runs read the same batch (tokens_seen equal at every step).
    seen = {n: [json.loads(x)["tokens_seen"] for x in (out / n / "metrics.jsonl").read_text().splitlines()
                if "tokens_seen" in x] for n in res}
    assert seen["base"] == seen["moe"] == seen["hybrid"]
    table = (out / "ablation.md").read_text()
    assert "| moe | model.moe.n_experts=4, model.moe.top_k=1 | 4 |" in table
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "| hybrid |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "variants, message",
    [
        (["a:model.layer_pattern=LQ"], "at least two"),
        (["a:", "b:model.layer_pattern=LQ"], "variant 'b'.*unknown"),
        (["a:", "b:data.seq_len=32"], "variant 'b' overrides data.seq_len"),
        (["a:", "b:train.max_steps=9"], "variant 'b' overrides train.max_steps"),
        (["a:", "a:model.n_layers=4"], "used twice"),
        (["a:", "b/c:"], "names a directory"),
        (["a:", "bmodel.n_layers=4"], "NAME:KEY=VALUE"),
    ],
)
def test_bad_variants_are_refused_before_training(variants, message, small_data_dir, cli_args, tmp_path, capsys):
    out = tmp_path / "abl"
    assert main(ablate_argv(cli_args, small_data_dir, out, variants)) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not out.exists()  # nothing trained, nothing written


def test_parse_variant():
    assert parse_variant("x:model.moe.every=2, model.moe.top_k=1") == ("x", [("model.moe.every", "2"),
                                                                            ("model.moe.top_k", "1")])
    assert parse_variant("base:") == ("base", [])


@pytest.mark.slow
def test_ablate_over_seeds_reports_mean_spread_and_attention_sink(small_data_dir, cli_args, tmp_path):
    out = tmp_path / "seeds"
    argv = ablate_argv(cli_args, small_data_dir, out, ["base:", "ungated:model.attn_gate=none"])
    assert main(argv + ["--seeds", "0", "1", "2"]) == 0
    res = json.loads((out / "ablation.json").read_text())["variants"]
    for name, r in res.items():
        assert r["n_seeds"] == 3 and set(r["seeds"]) == {"0", "1", "2"}
        finals = [r["seeds"][s]["final_val_loss"] for s in ("0", "1", "2")]
        assert len(set(finals)) == 3, finals  # the seeds train differently...
        mean = sum(finals) / 3
        sd = (sum((f - mean) ** 2 for f in finals) / 2) ** 0.5
        assert r["final_val_loss"] == pytest.approx(mean) and r["final_val_loss_sd"] == pytest.approx(sd)
        for s in ("0", "1", "2"):  # ...each in its own run directory with its own seed
            cfg = (out / name / f"seed{s}" / "config.yaml").read_text()
            assert f"seed: {s}\n" in cfg.split("train:")[1]
        assert set(r["attention_sink"]) == {"layers.0", "layers.1"} and all(0 < v < 1 for v in r["attention_sink"].values())
    table = (out / "ablation.md").read_text()
    assert f"| base | (preset) | 4 | {res['base']['final_train_loss']:.4f} ± {res['base']['final_train_loss_sd']:.4f} |" in table
    assert "attention sink" in table and "Over 3 seeds" in table
    assert main(argv + ["--seeds", "1", "1"]) == 2  # refused in one line


@pytest.mark.slow
def test_a_signal_stops_the_whole_ablation_and_the_same_command_resumes_it(small_data_dir, cli_args, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "pre"
    argv = ablate_argv(cli_args, small_data_dir, out, ["a:", "b:model.n_layers=1"],
                       extra=["--train.max_steps", "60", "--train.eval_every", "0", "--train.progress_bar", "false"])
    cmd = [sys.executable, "-m", "hybridtron.cli", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "a" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)  # what scancel or a SLURM preemption sends
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log
    assert "stopped during variant a" in log and "run the same command again" in log
    assert not (out / "b").exists() and not (out / "ablation.json").exists()  # b never started
    stop = json.loads((out / "last_stop.json").read_text())
    assert stop["stopped_by"] == "signal" and stop["variant"] == "a"
    stopped_at = stop["step"]
    # the same command again: a continues from its checkpoint, then b runs
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"step"' in x]
    assert steps[0] == 1 and steps[-1] == 60 and stopped_at + 1 in steps  # a continued, not restarted
    assert json.loads((out / "ablation.json").read_text())["variants"]["b"]["steps"] == 60


@pytest.mark.slow
def test_a_finished_variant_keeps_only_its_final_checkpoint(small_data_dir, cli_args, tmp_path, capsys):
    out = tmp_path / "abl"
    argv = cli_args(small_data_dir, out, ["--train.warmup_steps", "1", "--train.eval_every", "0",
                                          "--checkpoint.every", "2", "--checkpoint.keep_last", "3"])
    argv = ["ablate", *argv[1:], "--variant", "base:", "--variant", "deep:model.n_layers=3"]
    assert main([*argv, "--train.max_steps", "6"]) == 0
    said = capsys.readouterr().out
    for name in ("base", "deep"):
        # step 6, the final one, is what the table was made from; a rerun reads the variant back from it
        assert sorted(os.listdir(out / name / "checkpoints")) == ["latest", "step_00000006"], name
        assert (out / name / "checkpoints" / "step_00000006" / "model.safetensors").is_file()
        assert re.search(rf"ablate: removed 2 earlier checkpoints of {re.escape(str(out / name))} \([\d.,]+ MiB\); "
                         rf"kept the final one, step_00000006 \(--keep-checkpoints keeps them all\)", said), said
    # Trained on while an export reads base's step 6: that one stays too (train/checkpoint_pins.py).
    from hybridtron.train.checkpoint_pins import pinned

    with pinned(lambda: out / "base" / "checkpoints" / "step_00000006"):
        assert main([*argv, "--train.max_steps", "8"]) == 0
    said = capsys.readouterr().out
    assert "kept the final one, step_00000008, and step_00000006, which an export is reading" in said, said
    assert sorted(os.listdir(out / "base" / "checkpoints")) == ["latest", "step_00000006", "step_00000008"]
    assert sorted(os.listdir(out / "deep" / "checkpoints")) == ["latest", "step_00000008"]
    # With --keep-checkpoints: each variant resumes from its final checkpoint and keeps what it saves.
    assert main([*argv, "--train.max_steps", "10", "--keep-checkpoints"]) == 0
    assert "earlier checkpoint" not in capsys.readouterr().out
    assert sorted(os.listdir(out / "deep" / "checkpoints")) == ["latest", "step_00000008", "step_00000010"]
    for name in ("base", "deep"):
        assert [json.loads(x)["step"] for x in (out / name / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in x] == list(range(1, 11))  # each run went on from the last one's final checkpoint
    assert json.loads((out / "ablation.json").read_text())["variants"]["deep"]["steps"] == 10
