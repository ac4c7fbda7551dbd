"""data.workers: a source tokenized in parts by worker processes gives the shards one process gives, byte for
byte, whatever the number of workers; a killed worker or prepare leaves a directory the next run finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtron.configs.job import SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import prepare_data
from hybridtron.data_pipeline.errors import BadRecordError
from hybridtron.data_pipeline.parts import PARTS_DIR, TEST_PART_DELAY, plan_parts

from .conftest import quiet, stdlib_cfg
from .helpers import split_docs, stdlib_texts, tree_bytes

PART_MB = 0.004  # 4 kB: several files per part, and the larger files alone


def test_parts_are_runs_of_whole_files_whatever_the_workers():
    assert plan_parts([3, 3, 3, 3], 6) == [(0, 2), (2, 4)]
    assert plan_parts([1, 10, 1, 1], 5) == [(0, 1), (1, 2), (2, 4)]  # a file over the size is a part of its own
    assert plan_parts([7], 5) == [(0, 1)] and plan_parts([], 5) == []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources: 40 Python files as text (one with invalid UTF-8), and jsonl files with a malformed line, a
    non-string text and empty texts among their records, so that the skipped records' counts and places are
    merged across parts."""
    root = tmp_path_factory.mktemp("corpus")
    text = root / "text"
    text.mkdir()
    for i, t in enumerate(stdlib_texts(40)):
        (text / f"{i:03d}.txt").write_text(t)
    (text / "017b.txt").write_bytes(b"valid start \xff\xfe then not UTF-8")
    lines = root / "lines"
    lines.mkdir()
    for f in range(6):
        recs = [json.dumps({"text": f"record {f}-{r}: " + "word " * (50 * r + 10)}) for r in range(8)]
        recs[3] = '{"text": "unterminated' if f == 2 else recs[3]
        recs[5] = json.dumps({"text": 42}) if f == 4 else recs[5]
        recs[6] = json.dumps({"text": ""})
        (lines / f"part{f}.jsonl").write_text("\n".join(recs) + "\n")
    return root


def _cfg(corpus: Path, out: Path, tokenizer_json: Path, **kw):
    base = dict(sources=[SourceConfig(path=str(corpus / "text")), SourceConfig(path=str(corpus / "lines"))],
                tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)), max_malformed_fraction=0.2)
    return stdlib_cfg(out, **{**base, **kw})


@pytest.fixture(scope="module")
def one_process(corpus, tokenizer_json, tmp_path_factory):
    """What one process writes (data.workers=1: no parts, today's path)."""
    out = tmp_path_factory.mktemp("w1")
    prepare_data(_cfg(corpus, out, tokenizer_json, workers=1, part_mb=PART_MB), log=quiet)
    return tree_bytes(out)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_any_number_of_workers_writes_the_same_bytes(workers, corpus, tokenizer_json, one_process, tmp_path):
    out = tmp_path / "out"
    said = []
    prepare_data(_cfg(corpus, out, tokenizer_json, workers=workers, part_mb=PART_MB), log=said.append)
    assert any(f"{workers} worker processes" in s for s in said), said  # the parallel path did run
    got = tree_bytes(out)
    assert sorted(got) == sorted(one_process)
    assert [k for k in got if got[k] != one_process[k]] == []
    assert not (out / "text" / PARTS_DIR).exists() and not (out / "lines" / PARTS_DIR).exists()
    manifest = json.loads(got["lines/train/manifest.json"])
    assert manifest["source"]["skipped"] == {"empty": 6, "malformed_json": 1, "not_string": 1}
    assert len(split_docs(out / "text" / "train")) + len(split_docs(out / "text" / "val")) == 40  # one is bad UTF-8


def test_the_first_bad_record_in_file_order_stops_it(corpus, tokenizer_json, tmp_path):
    """on_bad_record=error: the error of the first bad record in file order, as one process raises it, even when
    a later part's worker finds its own first."""
    errors = []
    for workers in (1, 3):
        cfg = _cfg(corpus, tmp_path / f"w{workers}", tokenizer_json, workers=workers, part_mb=PART_MB,
                   on_bad_record="error", sources=[SourceConfig(path=str(corpus / "lines"))])
        with pytest.raises(BadRecordError) as e:
            prepare_data(cfg, log=quiet)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "part2.jsonl line 4" in errors[0], errors


def _prepare_cmd(corpus: Path, tokenizer_json: Path, out: Path, workers: int, part_mb: float = 0.02) -> list[str]:
    return [sys.executable, "-m", "hybridtron.cli", "prepare", "--config", "tiny",
            f"--data.sources=[{{path: {corpus / 'text'}}}, {{path: {corpus / 'lines'}}}]",
            "--data.tokenizer.kind", "pretrained", "--data.tokenizer.path", str(tokenizer_json),
            "--data.seq_len", "32", "--data.shard_docs", "3", "--data.val_fraction", "0.2",
            "--data.max_malformed_fraction", "0.2", "--data.out_dir", str(out),
            "--data.workers", str(workers), "--data.part_mb", str(part_mb)]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_for_parts(out: Path, n: int, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while len(list((out / "text" / PARTS_DIR).glob("part-*.json"))) < n:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "no part completed in 60 s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["a worker", "the whole prepare"])
def test_a_killed_prepare_is_finished_by_the_next_to_the_same_bytes(what, corpus, tokenizer_json, one_process,
                                                                     tmp_path):
    """As users run it (the CLI in a subprocess): kill -9 of one worker process (a node's OOM killer), or of the
    prepare and its workers (a lost node), after some parts are complete; the next prepare keeps those parts,
    tokenizes the rest and writes the bytes one process writes."""
    out = tmp_path / "out"
    env = {**os.environ, TEST_PART_DELAY: "0.3", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(_prepare_cmd(corpus, tokenizer_json, out, 2), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_parts(out, 2, job)
        if what == "a worker":
            workers = [c for c in _children(job.pid) if "spawn" in Path(f"/proc/{c}/cmdline").read_text()]
            assert workers, _children(job.pid)
            os.kill(workers[0], signal.SIGKILL)
            _, err = job.communicate(timeout=60)
            assert job.returncode == 2, err
            last = err.strip().splitlines()[-1]
            assert last.startswith("hybridtron prepare: error: a tokenizing worker of source 'text' died"), err
            assert "run prepare again" in last
        else:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    kept = len(list((out / "text" / PARTS_DIR).glob("part-*.json")))
    assert kept >= 2
    again = subprocess.run(_prepare_cmd(corpus, tokenizer_json, out, 3), capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr
    assert f"{kept} done; 3 worker processes" in again.stdout + again.stderr
    got = tree_bytes(out)
    assert [k for k in set(got) | set(one_process) if got.get(k) != one_process.get(k)] == []


def test_progress_lines_say_how_much_is_done_the_rate_and_the_time_left():
    from hybridtron.data_pipeline.progress import Progress

    now = [100.0]
    said: list[str] = []
    p = Progress("text: tokenizing", 3_000_000_000, said.append, every_s=30, clock=lambda: now[0], bar=False)
    now[0] += 10
    p.add(100_000_000, docs=1000, tokens=25_000_000)
    assert said == []  # under every_s since the start: no line yet
    now[0] += 90
    p.add(1_130_000_000, docs=309_000, tokens=256_000_000)
    assert said == ["text: tokenizing 41% (1.23 GB of 3.00 GB), 12.3 MB/s, 2.81M tokens/s, 310,000 documents, "
                    "about 2 min 24 s left"]  # 1.77 GB at 12.3 MB/s = 143.9 s


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_logs_progress_up_to_the_whole_source(workers, corpus, tokenizer_json, tmp_path, monkeypatch):
    from hybridtron.data_pipeline import progress

    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # a line at every step: the test cannot wait 30 s
    monkeypatch.setattr(progress, "bar_wanted", lambda: False)  # lines, also under `pytest -s` in a terminal
    said: list[str] = []
    prepare_data(_cfg(corpus, tmp_path / "out", tokenizer_json, workers=workers, part_mb=PART_MB,
                      sources=[SourceConfig(path=str(corpus / "text"))]), log=said.append)
    lines = [s for s in said if s.startswith("text: tokenizing ") and "%" in s]
    assert len(lines) > 3, said
    total = sum(f.stat().st_size for f in (corpus / "text").iterdir())
    from hybridtron.data_pipeline.progress import size

    assert lines[-1].startswith(f"text: tokenizing 100% ({size(total)} of {size(total)}), ") and "left" not in lines[-1]
    assert "41 documents" in lines[-1] or "40 documents" in lines[-1], lines[-1]


def test_parts_of_another_plan_are_not_reused_and_dead_workers_scratch_goes(tmp_path):
    """A source whose files changed since an interrupted prepare gets a new plan: its old parts are deleted, not
    merged into the new shards; with the same plan the complete parts stay and only scratch goes."""
    from hybridtron.data_pipeline.parts import PLAN, _prepare_parts_dir

    d = tmp_path / "src" / PARTS_DIR
    plan = {"key": "k", "inputs_digest": "d1", "part_mb": 1.0, "parts": [[0, 1], [1, 2]]}
    _prepare_parts_dir(d, plan, quiet)
    for ext, data in ((".bin", b"\0\0\0\0"), (".idx", b"\2" + b"\0" * 7), (".json", b"")):
        (d / f"part-00000{ext}").write_bytes(data)
    (d / "part-00000.json").write_text(json.dumps({"n_tokens": 2, "dtype": "uint16"}))
    (d / ".part-00001.bin.tmp-host-123").write_bytes(b"half")  # a worker killed mid-write
    (d / "part-00001.bin").write_bytes(b"\0\0")  # its .json never written: not complete
    _prepare_parts_dir(d, plan, quiet)
    assert sorted(f.name for f in d.iterdir()) == sorted([PLAN, "part-00000.bin", "part-00000.idx", "part-00000.json"])
    said: list[str] = []
    _prepare_parts_dir(d, {**plan, "inputs_digest": "d2"}, said.append)
    assert sorted(f.name for f in d.iterdir()) == [PLAN] and "planned from other files" in said[0]
