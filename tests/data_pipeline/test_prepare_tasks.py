"""`hybridtron submit prepare`'s stages without SLURM (data_pipeline/prepare_tasks.py): which task takes which
part, the locks between tasks and a plain prepare, a task that leaves another live task's part alone, the merge
to the one-process bytes, and `hybridtron status DATA_DIR`. The same on a SLURM cluster: tests/slurm/
test_prepare_array.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtron.configs import ConfigError
from hybridtron.configs.job import SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import prepare_data
from hybridtron.data_pipeline.data_lock import TASKS_LOCK, hold_as_task, hold_data_dir, part_lock
from hybridtron.data_pipeline.errors import DataDirBusy, DataError
from hybridtron.data_pipeline.parts import FILES, PARTS_DIR, PLAN
from hybridtron.data_pipeline.prepare_tasks import (
    data_status,
    format_data_status,
    plan_stage,
    task_parts,
    task_stage,
)

from .conftest import quiet, stdlib_cfg
from .helpers import stdlib_texts, tree_bytes

PART_MB = 0.01  # 10 kB: a dozen parts of a few files each


def test_each_part_goes_to_exactly_one_task_round_robin_over_all_sources():
    counts = [5, 0, 3]
    got = [task_parts(counts, k, 3) for k in range(3)]
    assert got[0] == [(0, 0), (0, 3), (2, 1)]
    assert got[1] == [(0, 1), (0, 4), (2, 2)]
    assert got[2] == [(0, 2), (2, 0)]
    flat = sorted(p for g in got for p in g)
    assert flat == [(s, k) for s, n in enumerate(counts) for k in range(n)]  # all, once
    assert task_parts(counts, 0, 1) == flat  # one task: everything, in order
    assert task_parts([2], 5, 8) == []  # more tasks than parts: the extra ones have nothing to do
    with pytest.raises(DataError, match="task 3 of 3: a task number runs from 0 to 2"):
        task_parts(counts, 3, 3)


def test_a_task_is_refused_while_a_prepare_writes_and_a_prepare_while_a_task_writes(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    with hold_data_dir(out, is_main=True, patience_s=0):
        with pytest.raises(DataDirBusy, match=rf"being written by another process \(host .*pid {os.getpid()}"):
            with hold_as_task(out, patience_s=0.1):
                pass
    with hold_as_task(out, patience_s=0), hold_as_task(out, patience_s=0):  # tasks share it
        with pytest.raises(DataDirBusy, match="being written by the array tasks of a `hybridtron submit prepare`"):
            with hold_data_dir(out, is_main=True, patience_s=0.1):
                pass
    assert sorted(os.listdir(out)) == [TASKS_LOCK]  # a task's share leaves the (empty) file; a prepare removes it
    with hold_data_dir(out, is_main=True, patience_s=0):  # both gone: free again
        pass
    assert os.listdir(out) == []


def test_a_part_lock_is_one_writer(tmp_path):
    a = part_lock(tmp_path / "part-00000.lock")
    assert a is not None and part_lock(tmp_path / "part-00000.lock") is None
    os.close(a)
    b = part_lock(tmp_path / "part-00000.lock")
    assert b is not None
    os.close(b)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i, t in enumerate(stdlib_texts(24)):
        (root / f"{i:03d}.txt").write_text(t[:20_000])
    return root


def _cfg(corpus: Path, out: Path, tokenizer_json: Path, **kw):
    base = dict(sources=[SourceConfig(path=str(corpus))],
                tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)), workers=1, part_mb=PART_MB)
    return stdlib_cfg(out, **{**base, **kw})


def test_tasks_then_merge_write_the_one_process_bytes_and_leave_a_live_tasks_part_alone(corpus, tokenizer_json,
                                                                                        tmp_path):
    ref = tmp_path / "ref"
    prepare_data(_cfg(corpus, ref, tokenizer_json, part_mb=256.0), log=quiet)  # one process, no parts at all
    out = tmp_path / "out"
    cfg = _cfg(corpus, out, tokenizer_json)
    said: list[str] = []
    planned = plan_stage(cfg, log=said.append)
    n = planned[corpus.name]
    assert n >= 6, said
    parts = out / corpus.name / PARTS_DIR
    assert (parts / PLAN).is_file() and (parts / FILES).is_file()

    # another task (of another submission) is writing part 0: its lock is held and its scratch is there
    other = part_lock(parts / "part-00000.lock")
    scratch = parts / ".part-00000.bin.tmp-elsewhere-123"
    scratch.write_bytes(b"half a part")
    said.clear()
    assert task_stage(cfg, 0, 2, log=said.append) == len(range(0, n, 2)) - 1
    assert any("being written by another task" in s for s in said), said
    assert scratch.exists() and not (parts / "part-00000.json").exists()  # left alone
    st = data_status(out, now=os.path.getmtime(parts / PLAN) + 3600)
    assert st["parts"]["parts_done"] == len(range(0, n, 2)) - 1 and st["parts"]["eta_s"] > 0
    os.close(other)  # that task died: its scratch is now the next taker's to clean

    assert task_stage(cfg, 0, 2, log=quiet) == 1  # only the part it had left
    assert not scratch.exists()
    assert task_stage(cfg, 0, 2, log=quiet) == 0  # idempotent
    assert task_stage(cfg, 1, 2, log=quiet) == len(range(1, n, 2))
    text = format_data_status(data_status(out))
    assert f"parts {n} of {n} done" in text and "all parts done" in text, text

    prepare_data(cfg, log=said.append)  # the merge: a plain prepare
    assert any(f"{n} parts of <= {PART_MB:g} MB, {n} done" in s for s in said), said
    got, want = tree_bytes(out), tree_bytes(ref)
    assert sorted(got) == sorted(want) and [k for k in got if got[k] != want[k]] == []
    st = data_status(out)
    assert st["ready"] and "ready:" in format_data_status(st)


def test_a_task_refuses_files_changed_since_the_plan(corpus, tokenizer_json, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(corpus, src)
    cfg = _cfg(src, tmp_path / "out", tokenizer_json)
    plan_stage(cfg, log=quiet)
    (src / "000.txt").write_text("changed")
    with pytest.raises(DataError, match="its files or settings changed since the plan stage"):
        task_stage(cfg, 0, 2, log=quiet)


def test_a_task_without_a_plan_stage_says_so(corpus, tokenizer_json, tmp_path):
    with pytest.raises(DataError, match="holds no tokenizer: the plan stage"):
        task_stage(_cfg(corpus, tmp_path / "out", tokenizer_json), 0, 2, log=quiet)


def _fake_parts(out: Path, n: int, done: dict[int, tuple[float, float]], size: int = 1_000_000) -> None:
    d = out / "books" / PARTS_DIR
    d.mkdir(parents=True)
    (d / PLAN).write_text(json.dumps({"parts": [[k, k + 1] for k in range(n)]}))
    (d / FILES).write_text(json.dumps([[f"/c/{k}.txt", size, 0.0] for k in range(n)]))
    for k, (t0, t1) in done.items():
        (d / f"part-{k:05d}.bin").write_bytes(b"\0\0" * 250_000)
        (d / f"part-{k:05d}.idx").write_bytes(b"\0" * 8)
        (d / f"part-{k:05d}.json").write_text(json.dumps({"index": k, "n_docs": 1, "n_tokens": 250_000,
                                                          "dtype": "uint16", "bytes": size, "started": t0,
                                                          "finished": t1}))


def test_status_says_parts_done_rates_and_time_left(tmp_path):
    out = tmp_path / "data"
    _fake_parts(out, 10, {0: (1000.0, 1010.0), 3: (1000.0, 1012.0), 7: (1010.0, 1020.0)})
    (out / "books" / PARTS_DIR / "part-00001.bin").write_bytes(b"\0\0")  # a part in progress is not done
    s = data_status(out, now=1030.0)  # 3 MB in 30 s: 0.1 MB/s; 7 MB left: 70 s
    assert (s["parts"]["parts_done"], s["parts"]["parts"]) == (3, 10)
    text = format_data_status(s)
    assert "books     parts 3 of 10 done, 3.00 MB of 10.00 MB, 750,000 tokens" in text, text
    assert "progress  3 of 10 parts, 3.00 MB of 10.00 MB, 100.00 kB/s, 25,000 tokens/s over 30 s, about 1 min 10 " \
           "s left" in text, text
    assert data_status(out / "books" / PARTS_DIR, now=1030.0)["parts"] == s["parts"]  # a source's .parts: the same


def test_status_of_a_data_directory_on_the_command_line(tmp_path):
    out = tmp_path / "data"
    _fake_parts(out, 4, {0: (1000.0, 1010.0)})
    res = subprocess.run([sys.executable, "-m", "hybridtron.cli", "status", str(out)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "parts 1 of 4 done" in res.stdout and "left" in res.stdout, res.stdout
    res = subprocess.run([sys.executable, "-m", "hybridtron.cli", "status", str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "no run directory" in res.stderr and "(or a data directory, data.out_dir" in res.stderr, res.stderr
    (tmp_path / "tok" / "tokenizer").mkdir(parents=True)
    res = subprocess.run([sys.executable, "-m", "hybridtron.cli", "status", str(tmp_path / "tok")], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "a tokenizer, no shards" in res.stdout, res.stderr


def test_data_status_refuses_a_directory_without_data(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ConfigError, match="holds no prepared data, parts or tokenizer"):
        data_status(tmp_path / "x")


def test_prepare_on_the_command_line_refuses_while_tasks_write(tmp_path):
    """A plain `hybridtron prepare` (or a train) started while array tasks still write: one line, exit 2, nothing
    merged or deleted under them."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep").write_text("a task's part")
    with hold_as_task(out, patience_s=0):
        res = subprocess.run([sys.executable, "-m", "hybridtron.cli", "prepare", "--data.out_dir", str(out),
                              "--data.sources", "[{path: stdlib, max_files: 2}]"], capture_output=True, text=True,
                             timeout=120)
    assert res.returncode == 2, res.stderr
    assert "array tasks of a `hybridtron submit prepare`" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert (out / "keep").read_text() == "a task's part"


def test_a_task_uses_the_cpus_slurm_gave_it(monkeypatch):
    from hybridtron.data_pipeline.prepare_tasks import _task_processes

    cfg = stdlib_cfg(Path("unused"))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert _task_processes(cfg, 100) == (6, 1) and _task_processes(cfg, 2) == (2, 3)
    cfg.workers, cfg.num_workers = 4, 2  # the config's, where set
    assert _task_processes(cfg, 100) == (4, 2)
