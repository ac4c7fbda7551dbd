"""bench/kernels.py on the CPU at tiny sizes: it checks candidates against ours, prints the table with the
targets' verdicts and appends it to a results file. (Its numbers need a GPU; this only exercises the code.)"""

from __future__ import annotations

from hybridtron.bench import kernels as bench


def test_bench_runs_tiny_on_cpu_and_appends(tmp_path, capsys):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Measured results\n")
    rows = bench.main(["--device", "cpu", "--dtype", "float32", "--no-compile", "--tokens", "8", "--d-model", "16",
                       "--ffn-hidden", "24", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                       "--rotary-fraction", "0.5", "--vocab", "40", "--ce-tokens", "6", "--dr-seq", "20",
                       "--dr-heads", "2", "--dr-head-dim", "16", "--dr-chunk", "16", "--repeats", "2",
                       "--warmup", "0", "--append", str(out)])
    timed = {(r.op, r.impl) for r in rows if r.seconds is not None}
    for op in ("norm", "rotary", "swiglu"):
        assert (op, "torch eager") in timed and (op, "triton (ours)") in timed
    assert ("cross_entropy", "triton (ours, chunked)") in timed
    assert ("delta_rule", "triton (ours)") in timed and ("delta_rule", "torch eager (reference)") in timed
    assert "| delta_rule | T20 H2 D16 C16 float32 | fla chunk_gated_delta_rule | fla unavailable" in out.read_text()
    # every timed peer agrees with our kernel (fp32): the check runs before timing
    assert all(r.max_err is not None and r.max_err < 1e-4 for r in rows if r.seconds is not None), rows
    text = out.read_text()
    assert text.startswith("# Measured results\n") and "## Fused kernels, CPU" in text
    assert "| norm | 8x16 float32 +residual | triton (ours) |" in text
    assert "torch.compile skipped (--no-compile)" in text
    assert "- cross_entropy: " in text and "appended to" in capsys.readouterr().out


def test_verdicts_say_met_or_not():
    rows = [
        bench.Row("norm", "s", "triton (ours)", seconds=1.0, extra={"gbs": 3000.0}),
        bench.Row("norm", "s", "torch.compile", seconds=1.5),
        bench.Row("swiglu", "s", "triton (ours)", seconds=2.0, extra={"gbs": 2000.0}),
        bench.Row("swiglu", "s", "torch.compile", seconds=1.0),
        bench.Row("cross_entropy", "s", "triton (ours, chunked)", seconds=1.05, peak_mib=100.0),
        bench.Row("cross_entropy", "s", "plain (logits + F.cross_entropy)", seconds=1.0, peak_mib=1000.0),
    ]
    rows += [bench.Row("delta_rule", "s", "triton (ours)", seconds=1.2),
             bench.Row("delta_rule", "s", "fla chunk_gated_delta_rule", seconds=1.0)]
    lines = bench.verdicts(rows, copy_gbs=3300.0)
    assert "- delta_rule: 1.20x fla's time (target <= 1: NOT met)" in lines
    assert lines[0] == ("- norm: 91% of copy bandwidth (target >= 85%: met); 1.50x torch.compile's speed "
                        "(target > 1: met)")
    assert "61% of copy bandwidth (target >= 85%: NOT met)" in lines[1] and "0.50x" in lines[1]
    assert lines[2] == ("- cross_entropy: 1.05x the plain path's time (target <= 1.1: met); 10% of its peak "
                        "memory (target <= 15%: met)")
