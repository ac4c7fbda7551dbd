"""bench/bench_train.py on the CPU at tiny sizes: every variant trains through torchrun and comes back as a row of
the table (a failing one as a row that says why), and the table is appended with its header. (Its numbers need a
GPU; this only exercises the code.)"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

from hybridtron.bench import bench_train as bench

TINY = ["--device", "cpu", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--seq", "32", "--micro-batch", "2",
        "--vocab", "512", "--extra", "data.sources=[{path: stdlib, max_files: 40}]", "model.n_layers=2",
        "model.d_model=64", "--timeout", "240"]


def table_rows(text: str) -> dict[str, list[str]]:
    """variant -> its cells, from the Markdown table in ``text``."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("variant", "---"):
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_variants_train_and_a_failing_one_is_a_row(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Measured results\n")
    rows = bench.main([*TINY, "--variants", "ddp", "ds_zero1", "bad:model.n_heads=3", "--work-dir", str(tmp_path),
                       "--append", str(results)])
    out = capsys.readouterr().out
    assert [r.variant for r in rows] == ["ddp", "ds_zero1", "bad"]
    cells = table_rows(results.read_text())
    assert list(cells) == ["ddp", "ds_zero1", "bad"], results.read_text()
    for name, engine, zero in (("ddp", "torch", "0"), ("ds_zero1", "deepspeed", "1")):
        c = cells[name]
        assert c[1:3] == [engine, zero], c
        assert float(c[3].replace(",", "")) > 0 and math.isfinite(float(c[6])), c
        assert c[4] == c[5] == "-" and c[8] == "", c  # no MFU nor GPU memory on the CPU, no failure
    # both engines train the same model on the same batches: the same final loss in fp32
    assert rows[0].final_loss == pytest.approx(rows[1].final_loss, rel=1e-4)
    bad = cells["bad"]
    assert bad[3] == "-" and bad[6] == "-", bad
    assert "model.n_heads=3 does not divide model.d_model=64" in bad[8], bad
    text = results.read_text()
    assert text.startswith("# Measured results\n\n## End-to-end training, tiny, CPU")
    assert "seq 32 x micro-batch 2 x accumulation 1 = 64 tokens/step; 1 warm-up + 2 timed steps" in text
    assert "Command: `python -m hybridtron.bench.bench_train --device cpu" in text
    assert "the torch engine wraps neither DDP nor FSDP2" in text
    assert f"appended to {results}" in out
    # the prepared data is reused: a second bench finds it done and leaves it as it was
    data = list((tmp_path / "data").iterdir())
    assert len(data) == 1 and (data[0] / "tokenizer").is_dir()
    before = made(data[0])
    assert bench.main([*TINY, "--work-dir", str(tmp_path), "--prepare-only"]) == []
    assert made(data[0]) == before


def made(data: Path) -> dict[Path, int]:
    """The tokenizer and shard files of a prepared directory, with their mtimes."""
    return {f: f.stat().st_mtime_ns for f in data.rglob("*")
            if f.is_file() and (f.suffix in (".bin", ".idx") or "tokenizer" in f.parent.name)}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes to kill in /proc")
def test_timeout_kills_the_launcher_and_what_it_started(tmp_path):
    """A variant past its time is killed with every process under it, workers in sessions of their own included."""
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    t0 = time.perf_counter()
    rc, wall = bench.run_logged([sys.executable, "-c", script], tmp_path / "logs" / "slow", timeout=3)
    assert rc is None and wall < 30 and time.perf_counter() - t0 < 30
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), f"process {child} survived the timeout"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_failure_reason_skips_the_launchers_summary():
    stderr = "\n".join([
        "[W] some warning",
        "hybridtron train: error: data.seq_len=8192 exceeds the rotary table model.max_seq_len=4096; lower it",
        "Traceback (most recent call last):",
        '  File "/x/torch/distributed/run.py", line 9, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "hybridtron.cli FAILED",
        "------------------------------------------------------------",
    ])
    assert bench.failure_reason(stderr).startswith("hybridtron train: error: data.seq_len=8192 exceeds")
    oom = "Traceback (most recent call last):\n  File \"a.py\"\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB"
    assert bench.failure_reason(oom) == "torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB"
    assert bench.failure_reason("one\ntwo\nthree\nfour") == "two / three / four"


def test_summary_takes_the_timed_steps_and_refuses_missing_ones():
    recs = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 * s, "mfu": 0.1 * s, "peak_mem_gib": float(s)}
            for s in range(1, 6)]
    got = bench.summarize(recs, warmup=2, steps=3, device="cuda")
    assert got == {"tokens_per_s": 400.0, "mfu": pytest.approx(0.4), "peak_gib": 5.0, "final_loss": 0.0}
    assert bench.summarize(recs, 2, 3, "cpu")["peak_gib"] is None
    with pytest.raises(ValueError, match="has 2 of the 3 timed steps"):
        bench.summarize(recs[:4], warmup=2, steps=3, device="cpu")


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant 'zero9'"):
        bench.main([*TINY, "--variants", "zero9", "--work-dir", str(tmp_path)])


def test_mfu_verdicts_take_each_presets_issue_target_by_checkpointing():
    rows = [bench.Row("ddp", "torch", "0", mfu=0.31, checkpointing="none"),
            bench.Row("ddp_ac", "torch", "0", mfu=0.24, checkpointing="full"),
            bench.Row("ds", "deepspeed", "1", checkpointing="none", note="exit 1"),  # no MFU: no verdict
            bench.Row("bad", "torch", "0", mfu=0.5)]  # config did not load: no mode, no preset target
    assert bench.notes(rows, 2, None, "hybrid_moe") == [
        "- ddp (activation checkpointing none): MFU 31.0%; target >= 30%: met.",
        "- ddp_ac (activation checkpointing full): MFU 24.0%; target >= 25%: NOT met."]
    assert bench.notes(rows, 2, None, "hybrid_1b") == [
        "- ddp (activation checkpointing none): MFU 31.0%; target >= 40%: NOT met."]
    assert bench.notes(rows, 2, None, "configs/dense_1b.yaml")[0].endswith("target >= 55%: NOT met.")
    assert bench.notes(rows, 2, None, "tiny") == []  # no issue sets a target for it
    assert len(bench.notes(rows, 2, 0.2, "tiny")) == 3  # --target-mfu applies to every row with an MFU
