"""The benchmark scripts behind bench/RESULTS.md run and print what the results file quotes."""

from __future__ import annotations

import re

from hybridtron.bench import bench_arch, bench_delta_rule


def test_bench_delta_rule_checks_agreement_and_prints_speedup(capsys):
    bench_delta_rule.main(["--seq", "37", "--heads", "2", "--dim", "8", "--chunk", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    err = float(re.search(r"max \|chunked - recurrent\| = (\S+)", out).group(1))
    assert err < 1e-4
    assert re.search(r"chunked speed-up over the recurrence: \d+\.\dx", out)


def test_bench_arch_prints_one_row_per_preset(capsys):
    bench_arch.main(["--presets", "tiny", "tiny_moe", "--steps", "1", "--repeats", "1", "--seq", "16", "--batch", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [r.split("|")[1].strip() for r in rows] == ["tiny", "tiny_moe"]
    assert all(float(r.split("|")[5].replace(",", "")) > 0 for r in rows)
