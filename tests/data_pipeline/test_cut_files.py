"""A file bigger than data.part_mb is cut into parts at record boundaries (jsonl lines, parquet row groups), and
the shards are still byte-identical to one process's: the same documents in the same order, the same bad-record
counts, and places that name the line in the whole file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridtron.configs.job import SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import prepare_data
from hybridtron.data_pipeline.errors import BadRecordError
from hybridtron.data_pipeline.parts import PARTS_DIR, PLAN, plan_source
from hybridtron.data_pipeline.sources import file_stamp

from .conftest import quiet, stdlib_cfg
from .helpers import tree_bytes

PART_MB = 0.008  # 8 kB: the big files below are cut into many pieces


def _record(text) -> bytes:
    return json.dumps({"text": text}).encode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cut")
    lines = root / "lines"
    lines.mkdir()
    recs = []
    for r in range(60):
        recs.append(_record(f"record {r}: " + "word " * (r % 17 * 9 + 3)))
        if r % 11 == 0:
            recs.append(b"")  # a blank line: not a record
        if r % 29 == 5:
            recs.append(_record("long " * 3000))  # 15 kB: longer than a part
    recs[40] = b'{"text": "unterminated'  # malformed, deep in the file: its place is a line of the whole file
    recs[57] = _record(42)
    recs[62] = _record("")
    # a byte order mark, CRLF line ends, no newline at the end
    (lines / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(recs))
    (lines / "b.jsonl").write_bytes(b"\n".join(_record(f"small {r}") for r in range(5)) + b"\n")
    # every line longer than a part: one piece per line at most
    (lines / "c.jsonl").write_bytes(b"\n".join(_record(f"{r} " + "x" * 9000) for r in range(4)) + b"\n")
    (lines / "d.jsonl").write_bytes(b"\x1f\x8b" + bytes(range(256)) * 40)  # gzip: a binary file, cut all the same
    (lines / "e.json").write_bytes(b"[" + b",\n".join(_record(f"element {r} " + "y" * 300) for r in range(30)) + b"]")

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = root / "rows"
    rows.mkdir()
    texts = [f"row {r}: " + "token " * (r % 13 * 4 + 5) for r in range(200)]
    texts[63], texts[150] = None, ""
    pq.write_table(pa.table({"text": texts, "n": list(range(200))}), rows / "t.parquet", row_group_size=16,
                   compression="none")
    pq.write_table(pa.table({"text": ["tiny one", "tiny two"]}), rows / "u.parquet")
    return root


def _cfg(corpus: Path, out: Path, tokenizer_json: Path, **kw):
    base = dict(sources=[SourceConfig(path=str(corpus / "lines")), SourceConfig(path=str(corpus / "rows"))],
                tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)), max_malformed_fraction=0.2,
                part_mb=PART_MB)
    return stdlib_cfg(out, **{**base, **kw})


@pytest.fixture(scope="module")
def one_process(corpus, tokenizer_json, tmp_path_factory):
    out = tmp_path_factory.mktemp("w1")
    prepare_data(_cfg(corpus, out, tokenizer_json, workers=1), log=quiet)
    return tree_bytes(out)


def test_a_big_jsonl_file_is_cut_at_line_starts(corpus):
    f = corpus / "lines" / "a.jsonl"
    data = f.read_bytes()
    parts = plan_source([file_stamp(f)], "jsonl", 8000)
    assert len(parts) >= 4 and all(p[:2] == (0, 1) for p in parts)
    assert parts[0][2] == 0 and parts[-1][3] == len(data)
    for p, q in zip(parts, parts[1:], strict=False):
        assert p[3] == q[2] and data[q[2] - 1:q[2]] == b"\n"  # contiguous, each from a line start
    assert all(p[4] == p[3] - p[2] for p in parts)
    # lines longer than a part: a piece per line at most, never an empty one
    c = corpus / "lines" / "c.jsonl"
    cut = plan_source([file_stamp(c)], "jsonl", 8000)
    assert [p[2] for p in cut] == [0, *[i + 1 for i, b in enumerate(c.read_bytes()[:-1]) if b == 10]]
    # the same whatever else: the plan is a function of the bytes and the size alone
    assert plan_source([file_stamp(f)], "jsonl", 8000) == parts
    # a JSON array is parsed whole, text files are one document: neither is cut
    assert plan_source([file_stamp(corpus / "lines" / "e.json")], "jsonl", 4000) == [(0, 1)]
    assert plan_source([file_stamp(f)], "text", 4000) == [(0, 1)]
    # files that fit keep the plan they always had: runs of whole files
    small = [file_stamp(corpus / "lines" / "b.jsonl")] * 3
    assert plan_source(small, "jsonl", 1e6) == [(0, 3)]


def test_a_big_parquet_file_is_cut_at_row_groups(corpus):
    f = corpus / "rows" / "t.parquet"
    parts = plan_source([file_stamp(f)], "parquet", 8000)
    assert len(parts) > 3
    assert parts[0][2] == 0 and parts[-1][3] == 13  # 200 rows in groups of 16
    assert all(p[3] == q[2] for p, q in zip(parts, parts[1:], strict=False))
    assert sum(p[4] for p in parts) == f.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_cut_files_give_the_bytes_of_one_process(workers, corpus, tokenizer_json, one_process, tmp_path):
    out = tmp_path / "out"
    said: list[str] = []
    # streaming: the same documents as through datasets' Arrow cache (which the other tests take), in a third of
    # the time for this many parts
    prepare_data(_cfg(corpus, out, tokenizer_json, workers=workers, streaming=True), log=said.append)
    assert any("pieces of" in s and f"{workers} worker processes" in s for s in said), said
    got = tree_bytes(out)
    assert [k for k in set(got) | set(one_process) if got.get(k) != one_process.get(k)] == []
    source = json.loads(got["lines/train/manifest.json"])["source"]
    assert source["skipped"] == {"binary_file": 1, "empty": 1, "malformed_json": 1, "not_string": 1}
    a = next(ex for ex in source["examples"]["malformed_json"])
    assert "a.jsonl line 41:" in a, a  # the 41st line of the file
    assert all("line +" not in ex for exs in source["examples"].values() for ex in exs)
    assert [f[3] is None for f in source["files"]] == [False, False, False, True, False]  # d.jsonl: binary


def test_the_first_bad_record_of_a_cut_file_is_named_by_its_line_in_the_file(corpus, tokenizer_json, tmp_path):
    errors = []
    for workers in (1, 2):
        cfg = _cfg(corpus, tmp_path / f"w{workers}", tokenizer_json, workers=workers, on_bad_record="error",
                   sources=[SourceConfig(path=str(corpus / "lines" / "a.jsonl"))])
        with pytest.raises(BadRecordError) as e:
            prepare_data(cfg, log=quiet)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "a.jsonl line 41:" in errors[0], errors


@pytest.mark.slow
def test_slurm_stages_with_one_worker_merge_cut_parts_to_the_same_bytes(corpus, tokenizer_json, one_process,
                                                                        tmp_path):
    """The plan, tasks and merge of `submit prepare`, each task one process (data.workers=1), on cut files."""
    from hybridtron.data_pipeline.prepare_tasks import plan_stage, task_stage

    out = tmp_path / "out"
    cfg = _cfg(corpus, out, tokenizer_json, workers=1)
    planned = plan_stage(cfg, log=quiet)
    plan = json.loads((out / "lines" / PARTS_DIR / PLAN).read_text())
    assert planned["lines"] == len(plan["parts"]) > 10 and any(len(p) == 5 for p in plan["parts"])
    for k in range(2):
        task_stage(cfg, k, 2, log=quiet)
    prepare_data(cfg, log=quiet)  # the merge
    got = tree_bytes(out)
    assert [k for k in set(got) | set(one_process) if got.get(k) != one_process.get(k)] == []
