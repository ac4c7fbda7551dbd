"""bench/gpu_issues.py: every command it would run on the GPU is one its bench accepts (checked by each bench's own
argument parser, stopped right after parsing), and without a GPU it refuses to run instead of timing CPU kernels."""

from __future__ import annotations

import argparse
import importlib

import pytest

from hybridtron.bench import gpu_issues


class _Parsed(Exception):
    def __init__(self, args):
        self.args_ = args


BENCHES = [c for c in gpu_issues.COMMANDS if c[1] != "pytest"]


@pytest.mark.parametrize("name,module,extra", BENCHES, ids=[c[0] for c in BENCHES])
def test_every_command_parses_with_its_bench(name, module, extra, monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    bench = importlib.import_module(f"hybridtron.bench.{module}")
    with pytest.raises(_Parsed) as parsed:
        bench.main(list(extra))
    assert vars(parsed.value.args_), name


def test_a_bad_argument_is_caught_by_that_check(monkeypatch):
    """The check above can fail: an option the bench does not have ends in argparse's error, not in a parse."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    bench = importlib.import_module("hybridtron.bench.kernels")
    with pytest.raises(SystemExit):
        bench.main(["--ops", "delta_rule", "--no-such-option"])


def test_dry_run_lists_each_command_and_no_gpu_is_refused(capsys, monkeypatch):
    assert gpu_issues.main(["--dry-run", "--only", "delta_rule_conv", "train_moe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["delta_rule_conv", "train_moe"]
    assert "-m hybridtron.bench.kernels --ops delta_rule conv --no-append" in out[0]
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_issues.main(["--only", "delta_rule_conv"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_gpu_tests_it_names_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name, module, extra in gpu_issues.COMMANDS:
        if module == "pytest":
            files = [a for a in extra if a.endswith(".py")]
            assert files and all((root / f).is_file() for f in files), (name, files)


QUICK = [(name, module, [a.replace("{out}", "/tmp/x") for a in extra]) for name, module, extra, _ in gpu_issues.QUICK]


@pytest.mark.parametrize("name,module,extra", QUICK, ids=[c[0] for c in QUICK])
def test_every_quick_command_parses_with_its_bench(name, module, extra, monkeypatch):
    test_every_command_parses_with_its_bench(name, module, extra, monkeypatch)


def test_quick_check_runs_under_one_deadline_and_reads_every_verdict(tmp_path, monkeypatch, capsys):
    """The quick check's driver with stand-in commands (each writes the JSON its bench would): commands run in order
    until the deadline leaves under 30 s, one table names every target met / NOT met / not measured, quick.json
    holds it all."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    payloads = {
        "backend_probe": {"rows": [
            {"op": "delta_rule", "backend": "triton", "docs": False, "size": "small", "rel_err": [1e-16]},
            {"op": "delta_rule", "backend": "triton", "docs": False, "size": "full", "rel_err": [4e-3, 6e-3], "ms": 7.5},
            {"op": "delta_rule", "backend": "fla", "docs": False, "size": "small", "after_s": 1.0,
             "error": "AcceleratorError: CUDA error: an illegal memory access was encountered"}]},
        "ring": {"rows": [{"backend": "sdpa", "rel_err": [0.004, 0.008, 0.006, 0.005], "tokens_per_rank": 32768,
                           "rank_s": 0.061, "sdpa_cp1_s": 0.028, "time_ratio": 2.18, "memory_ratio": 1.4},
                          {"backend": "triton", "error": "OutOfResources: shared memory"}]},
        "kernel_grid": {"verdicts": [{"target": "attention T4k D128", "value": 0.97, "bound": ">= 0.95", "met": True}]},
        "train_hybrid": {"rows": [{"tokens_per_s": 60000.0, "mfu": 0.41}], "kernel_choices": {
            "ddp": {"attention[...]": "sdpa", "delta_rule[...]": "fla"}}},
        "hf_hybrid": {"ratio": 2.1, "hf_has_fla": True},
        "checkpoint_stall": {"async_over_sync": 0.12, "sync_stall_s": 9.5, "state_mb": 3000},
        "train_dense": {"rows": [{"tokens_per_s": 90000.0, "mfu": 0.56}]},
    }
    clock = [0.0]
    monkeypatch.setattr(gpu_issues.time, "monotonic", lambda: clock[0])
    spent = {"backend_probe": 60, "ring": 30, "kernel_grid": 150, "checkpoint_stall": 30, "train_hybrid": 110,
             "hf_hybrid": 70, "train_dense": 100}
    ran = []

    def fake_run(name, cmd, log, timeout):
        ran.append((name, timeout))
        assert cmd[1:3] == ["-m", f"hybridtron.bench.{dict((n, m) for n, m, _, _ in gpu_issues.QUICK)[name]}"]
        (tmp_path / f"{name}.json").write_text(json.dumps(payloads[name]))
        clock[0] += spent[name]
        return 0, spent[name]

    monkeypatch.setattr(gpu_issues, "_run", fake_run)
    assert gpu_issues.main(["--quick", "--out", str(tmp_path)]) == 0
    # each command gets its cap or what is left; train_dense gets the 30 s left, and nothing starts after it
    assert ran == [("backend_probe", 90), ("ring", 60), ("kernel_grid", 200), ("checkpoint_stall", 60), ("train_hybrid", 110),
                   ("hf_hybrid", 100), ("train_dense", 30)]
    assert gpu_issues.missing_packages() == ([], [])  # the dev install has everything the check imports
    out = capsys.readouterr().out
    assert "| attention T4k D128 | 0.97 | >= 0.95 | met |" in out
    assert "| hybrid preset MFU (60,000 tokens/s) | 0.41 | >= 45% | NOT met |" in out
    assert "| dense preset MFU (90,000 tokens/s) | 0.56 | >= 55% | met |" in out
    assert "| moe preset MFU (0 tokens/s) | - | >= 30% | not measured |" in out
    assert "| hybrid_1b tokens/s: ours / transformers + fla | 2.10 | >= 2.0 | met |" in out
    assert "- train_moe: not run (deadline)" in out
    assert "| delta_rule triton docs=False runs at hybrid_1b's class (7.5 ms) | 0.01 | no error | met |" in out
    # a backend that faulted at the small size is reported by its one row
    assert "delta_rule fla docs=False runs at hybrid_1b's class (AcceleratorError: CUDA error: an illegal memory " in out
    assert "train_hybrid ddp: auto chose attention[...]: sdpa; delta_rule[...]: fla" in out
    saved = json.loads((tmp_path / "quick.json").read_text())
    assert "| checkpoint stall: async / sync (9.50 s sync, 3,000 MB) | 0.12 | < 1 | met |" in out
    assert saved["versions"]["gpu"] == "Fake H100" and len(saved["verdicts"]) == 16
    assert "| cp-2 rank (sdpa, 2 x 32,768) time / SDPA causal over its 32,768 (61 / 28 ms) | 2.18 | <= 2.4 | met |" in out
    assert "| cp-2 rank (sdpa) peak memory / SDPA causal over its tokens | 1.40 | <= 1.25 | NOT met |" in out
    assert "| ring attention (triton) runs (OutOfResources: shared memory) | - | no error | NOT met |" in out
    assert "| dense_1b tokens/s: fp8 tensorwise / bf16 | - | >= 1.25 | not measured |" in out


def test_backend_probe_names_each_backend_on_tiny_classes(tmp_path, capsys):
    """bench/backend_probe.py on the CPU (Triton's interpreter): one process per backend; ours agrees with the
    reference in float64, a backend that cannot run is named by its error, and the exit code says so."""
    import json

    from hybridtron.bench import backend_probe

    rc = backend_probe.main(["--set", "B=1", "T=64", "Hk=1", "Hv=2", "Dk=16", "Dv=16", "--backends", "triton",
                             "no_such", "--docs", "1", "--json", str(tmp_path / "p.json")])
    assert rc == 1
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["backend"], r["size"], "error" in r) for r in rows] == [
        ("triton", "small", False), ("triton", "full", False), ("no_such", "small", True)]
    assert max(rows[0]["rel_err"]) < 1e-10 and max(rows[1]["rel_err"]) < 3e-2  # float64; bf16 at "full"
    assert "'no_such' is not a backend" in rows[2]["error"]
    out = capsys.readouterr().out
    assert "delta_rule no_such docs=True small: FAILED after" in out


def test_fp8_rows_against_their_bf16_rows(tmp_path):
    """The FP8 rows' verdicts: tokens/s over the bf16 row's (dense_1b judged against 1.25, hybrid_1b printed), and
    the last step's loss gap judged against 1%."""
    import json

    for name, tps, loss in (("train_dense", 100.0, 4.00), ("train_dense_fp8", 130.0, 4.02),
                            ("train_hybrid", 80.0, 5.0), ("train_hybrid_fp8", 88.0, 5.1)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": [{"tokens_per_s": tps, "final_loss": loss}]}))
    vs = {v["target"]: v for v in gpu_issues.fp8_verdicts(tmp_path)}
    dense, dense_loss = vs["dense_1b tokens/s: fp8 tensorwise / bf16"], vs["dense_1b last-step loss: |fp8 - bf16| / bf16"]
    assert dense["value"] == pytest.approx(1.3) and dense["met"] is True
    assert dense_loss["value"] == pytest.approx(0.005) and dense_loss["met"] is True
    hybrid = vs["hybrid_1b tokens/s: fp8 tensorwise / bf16"]
    assert hybrid["value"] == pytest.approx(1.1) and hybrid["met"] is None and hybrid["bound"] == "printed"
    assert vs["hybrid_1b last-step loss: |fp8 - bf16| / bf16"]["met"] is False  # 2% apart
    (tmp_path / "train_dense_fp8.json").write_text(json.dumps({"rows": [{"tokens_per_s": 110.0, "final_loss": 4.0}]}))
    assert {v["target"]: v for v in gpu_issues.fp8_verdicts(tmp_path)}[dense["target"]]["met"] is False


def test_bench_ring_simulates_the_ring_on_the_cpu(tmp_path):
    """bench_ring end to end at tiny sizes on the CPU (sdpa's CPU kernel, float64 blocks): the simulated ring agrees
    with whole attention, gradients included, and the timing row has its fields."""
    import json

    from hybridtron.bench import bench_ring

    assert bench_ring.main(["--backends", "sdpa", "--tokens", "64", "--check-tokens", "32", "--heads", "4,2,16",
                            "--json", str(tmp_path / "ring.json")]) == 0
    row = json.loads((tmp_path / "ring.json").read_text())["rows"][0]
    assert max(row["rel_err"]) < 1e-5, row  # float64 blocks against a float32 reference
    assert row["time_ratio"] > 0 and row["tokens_per_rank"] == 64


def test_kernel_grid_verdicts():
    from hybridtron.bench import kernel_grid

    results = {
        "att T4k D128": {"chosen": "sdpa", "times_ms": {"sdpa": 1.0, "triton": 2.0},
                         "sdpa_kernels": {"CUDNN_ATTENTION": 0.9, "FLASH_ATTENTION": 1.2, "EFFICIENT_ATTENTION": "x"}},
        "att T4k D128 docs": {"chosen": "triton", "times_ms": {"triton": 0.25, "sdpa": 2.0}},
        "dr B1 T4k": {"chosen": "fla", "times_ms": {"fla": 4.0, "triton": 4.4}},
        "dr B4 T4k": {"chosen": "triton", "times_ms": {"triton": 6.0}, "fla_unchecked_ms": 5.0},
    }
    vs = {v["target"]: v for v in kernel_grid.verdicts(results)}
    att = vs["attention T4k D128: auto speed / fastest SDPA kernel's"]
    assert att["value"] == pytest.approx(0.9) and att["met"] is False  # cuDNN alone beat sdpa's own priority
    assert vs["attention T4k D128: time with 512-token documents / without"]["value"] == pytest.approx(0.25)
    assert vs["delta rule B1 T4k docs: auto time / fla's"]["met"] is True
    ours = vs["delta rule B1 T4k docs: ours (triton) time / fla's"]
    assert ours["value"] == pytest.approx(1.1) and ours["met"] is False
    assert vs["delta rule B4 T16k docs: auto time / fla's"]["met"] is None  # not measured
    dropped = vs["delta rule B4 T4k docs: auto time / fla's"]  # fla dropped by the check: its time is the baseline
    assert dropped["value"] == pytest.approx(1.2) and dropped["met"] is False
    assert any("| NOT met |" in line for line in kernel_grid.verdict_lines(list(vs.values())))


def test_kernel_grid_runs_end_to_end_on_tiny_classes(tmp_path, monkeypatch, capsys):
    """The grid's own code path at tiny classes on the CPU (the tuner's real checks, injected timings): each class
    measured and remembered in the cache, SDPA's kernels timed alone (those the CPU lacks named as failed), the
    JSON written, the budget honoured."""
    import json

    from hybridtron.bench import kernel_grid
    from hybridtron.kernels import backend, tune

    from ..kernels.helpers import fake_timer

    def fp32(shape, **dims):  # bf16 on the CPU is outside flash-attention's rule for SDPA's GQA gradients too
        return shape[0], tuple((k, "float32" if k == "dtype" else dims.get(k, v)) for k, v in shape[1])

    att = fp32(kernel_grid._attention(64, 2, 1, 8, False, B=1))
    none = frozenset()
    monkeypatch.setattr(kernel_grid, "GRID", [("att T4k D128", att, "tiny", none),
                                              ("conv C6144 docs", fp32(kernel_grid._conv(8), T=64, B=1), "tiny", none),
                                              ("dr B1 T4k", kernel_grid._delta(1, 64, 1, 1), "not reached", none)])
    monkeypatch.setenv("HYBRIDTRON_CACHE_DIR", str(tmp_path / "cache"))
    tune.reset()
    backend.clear_cache()
    clock = [0.0]
    monkeypatch.setattr(kernel_grid.time, "monotonic", lambda: clock[0])

    def tick():
        clock[0] += 5.0

    tune.configure(timer=fake_timer({"sdpa": 1.0, "triton": 2.0}, tick=tick))
    try:
        assert kernel_grid.main(["--device", "cpu", "--budget-s", "22", "--json", str(tmp_path / "g.json")]) == 0
    finally:
        tune.reset()
    data = json.loads((tmp_path / "g.json").read_text())
    assert set(data["results"]) == {"att T4k D128", "conv C6144 docs"} and data["skipped"] == ["dr B1 T4k"]
    assert data["results"]["att T4k D128"]["chosen"] == "sdpa"
    assert set(data["results"]["att T4k D128"]["sdpa_kernels"]) == set(kernel_grid.SDPA_KERNELS)
    assert len(json.loads((tmp_path / "cache" / "kernel_choices.json").read_text())["machines"]) == 1
    assert "| target | value | bound | verdict |" in capsys.readouterr().out


def test_checkpoint_stall_bench_measures_both_kinds_of_save_on_the_cpu(tmp_path, capsys):
    """bench_checkpoint (the quick check's checkpoint_stall row) at a tiny size on the CPU: both saves go through
    the trainer's CheckpointManager, and what it writes is the row's input."""
    import json

    from hybridtron.bench import bench_checkpoint

    out = tmp_path / "stall.json"
    assert bench_checkpoint.main(["--mb", "4", "--saves", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ranks"] == 1 and res["device"] == "cpu" and res["state_mb"] == 13  # 3 x 4 MB of 1024 x 1024 fp32
    assert res["sync_stall_s"] > 0 and res["async_stall_s"] > 0 and res["async_write_s"] > 0
    assert res["async_over_sync"] == res["async_stall_s"] / res["sync_stall_s"]
    assert "async/sync" in capsys.readouterr().out
    assert not list(tmp_path.glob("bench-ckpt-*"))  # its checkpoints are removed
