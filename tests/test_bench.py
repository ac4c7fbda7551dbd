"""The benchmark scripts behind bench/RESULTS.md run and print what the results file quotes."""

from __future__ import annotations

import re

import pytest

from hybridtron.bench import bench_arch, bench_data, bench_delta_rule


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


def _catalogs() -> list:
    from pathlib import Path

    return sorted(Path("/usr/share/locale").rglob("*.mo"))[:40]


def test_mo_reader_agrees_with_gettext():
    """bench_data's .mo reader returns the translations the standard library's gettext parser finds."""
    import gettext

    catalogs = _catalogs()
    assert catalogs, "no gettext catalogs under /usr/share/locale (Debian installs them with most packages)"
    checked = 0
    for mo in catalogs:
        with open(mo, "rb") as f:
            try:
                ref = gettext.GNUTranslations(f)._catalog
            except (OSError, UnicodeDecodeError):
                continue
        want = {v for k, v in ref.items() if k not in ("", ("", 0)) and v}
        try:
            got = {m.decode("utf-8") for m in bench_data.mo_messages(mo.read_bytes())}
        except UnicodeDecodeError:
            continue  # a catalog in another charset: the mixed corpus skips it too
        assert got == want, mo
        checked += 1
    assert checked >= 5


@pytest.mark.slow
def test_bench_data_mixed_corpus_runs_and_counts_the_same_tokens(capsys):
    # The bench asserts that prepare and encode_batch produce the same number of tokens.
    bench_data.main(["--corpus", "mixed", "--mixed-mb", "0.3", "--vocab", "300", "--repeats", "1", "--steps", "5",
                     "--train-steps", "1"])
    out = capsys.readouterr().out
    m = re.search(r"corpus: (\d+) gettext catalogs \((\d+) languages\), ([\d.]+) MB", out)
    assert m and int(m.group(1)) > 1 and int(m.group(2)) > 1 and float(m.group(3)) >= 0.3, out
    assert re.search(r"prepare / encode_batch throughput: best \d+%", out)
