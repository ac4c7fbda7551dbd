"""Hostile inputs for ``prepare``: binary files, invalid UTF-8, malformed/odd jsonl and parquet, empty corpora,
sources edited after prepare, documents far longer than anything normal. Each class either trains only on the
text documents with a count per skipped reason, or stops with one line naming the file (and line or row)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridtron.configs import ConfigError, load_config
from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import DataError, build_dataset, load_tokenizer, prepare_data, shards, sources
from hybridtron.data_pipeline.errors import (
    BadRecordError,
    EmptySourceError,
    SourceChangedError,
    TooManyBadRecordsError,
)
from hybridtron.data_pipeline.sources import binary_reason, find_cut, split_pieces
from hybridtron.data_pipeline.tokenizer import train_sentencepiece

from .conftest import quiet, stdlib_cfg
from .helpers import split_docs, stdlib_texts

GOOD = [f"good document {i}: " + "lorem ipsum dolor sit amet, ünïcödé\n" * (i % 4 + 1) for i in range(400)]


def _cfg(tmp_path: Path, tokenizer_json: Path, *srcs, **kw) -> DataConfig:
    srcs = [s if isinstance(s, SourceConfig) else SourceConfig(path=str(s)) for s in srcs]
    tok = TokenizerConfig(kind="pretrained", path=str(tokenizer_json))
    return stdlib_cfg(tmp_path / kw.pop("out", "out"), sources=srcs, tokenizer=tok, **kw)


def _decoded(prep, name: str) -> list[str]:
    tok = prep.tokenizer
    docs = [d for s in ("train", "val") for d in split_docs(prep.out_dir / name / s)]
    assert all(d[-1] == tok.eos_id and tok.eos_id not in d[:-1] for d in docs)
    return sorted(tok.decode(d[:-1].tolist()) for d in docs)


def _source(prep, name: str) -> dict:
    return json.loads((prep.out_dir / name / "train" / "manifest.json").read_text())["source"]


def _write_texts(d: Path, texts: list[str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (d / f"g{i:03d}.txt").write_text(t)


def _shard_bytes(out: Path, name: str) -> dict[str, bytes]:
    """The shard files (not the manifests, which also record the source files) of one source."""
    return {f"{s}/{p.name}": p.read_bytes() for s in ("train", "val") for p in sorted((out / name / s).glob("shard_*"))}


# ---- binary files ---------------------------------------------------------------------------------------------
def _binaries() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        "controls.dat": bytes(range(1, 32)) * 20,  # no NUL, but mostly control bytes
        "image.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + rng.bytes(300),
        "notes.txt.gz": gzip.compress(b"compressed text " * 50),
        "program": b"\x7fELF\x02\x01\x01\0" + rng.bytes(2000),
        "random.bin": rng.bytes(5000),
        "wide.txt": "text in UTF-16 is not UTF-8\n".encode("utf-16"),
    }


def test_binary_files_are_detected_skipped_and_counted(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:6])
    for name, data in _binaries().items():
        (d / name).write_bytes(data)
    logs = []
    prep = prepare_data(_cfg(tmp_path, tokenizer_json, d), log=logs.append)
    assert _decoded(prep, "corpus") == sorted(GOOD[:6])  # not one token of the binaries
    src = _source(prep, "corpus")
    assert src["skipped"] == {"binary_file": 6} and src["documents"] == 6 and src["records"] == 12
    assert prep.stats["skipped"] == {"binary_file": 6}
    assert [e.split(":")[0] for e in src["examples"]["binary_file"]] == [str(d / n) for n in sorted(_binaries())[:3]]
    assert "gzip-compressed" in json.dumps(src["examples"])
    assert any("binary files: 6 (" in m and "controls.dat" in m for m in logs)


def test_binary_file_stops_prepare_under_on_bad_record_error(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:3])
    (d / "image.png").write_bytes(_binaries()["image.png"])
    with pytest.raises(BadRecordError, match=r"image\.png: NUL bytes.*on_bad_record=skip") as e:
        prepare_data(_cfg(tmp_path, tokenizer_json, d, on_bad_record="error"), log=quiet)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "data",
    [
        b"def f(x):\n\treturn x\n\x0c\n# form feed above\n" * 100,
        b"\x1b[31mred\x1b[0m log line\r\n" * 300,  # ANSI colours
        ("café crème " * 100).encode("latin-1"),  # a few invalid bytes: invalid UTF-8, not binary
        "日本語のテキスト".encode() * 400,  # 3-byte characters cut by the 8 KiB sniff window
    ],
)
def test_text_is_not_taken_for_binary(data):
    assert binary_reason(data) is None


# ---- invalid UTF-8 ---------------------------------------------------------------------------------------------
def test_invalid_utf8_file_is_skipped_below_the_fraction(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:150])
    (d / "latin1.txt").write_bytes("first line\ncafé crème\n".encode("latin-1"))
    prep = prepare_data(_cfg(tmp_path, tokenizer_json, d), log=quiet)
    assert _decoded(prep, "corpus") == sorted(GOOD[:150])
    src = _source(prep, "corpus")
    assert src["skipped"] == {"invalid_utf8": 1}
    assert src["examples"]["invalid_utf8"] == [f"{d / 'latin1.txt'}: invalid UTF-8 at line 2 (byte 14): invalid continuation byte"]
    assert "\ufffd" not in "".join(_decoded(prep, "corpus"))


def test_invalid_utf8_above_the_fraction_stops(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:3])
    (d / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(TooManyBadRecordsError) as e:
        prepare_data(_cfg(tmp_path, tokenizer_json, d), log=quiet)
    msg = str(e.value)
    assert "\n" not in msg and "1 of 4 records are malformed" in msg and "max_malformed_fraction=0.01" in msg
    assert f"{d / 'latin1.txt'}: invalid UTF-8 at line 1 (byte 3)" in msg


def test_invalid_utf8_late_in_a_long_file_drops_the_whole_document(tmp_path, tokenizer_json, monkeypatch):
    """The file's first pieces are already encoding when its bad byte turns up: the document must vanish whole,
    and the documents after it must get the split they would have had without it."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 700)
    monkeypatch.setattr(sources, "READ_CHUNK", 1000)
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    for d in (clean, dirty):
        _write_texts(d, GOOD[:40])
    (dirty / "g010b.txt").write_bytes(("long line of words " * 2000).encode() + b"\xff tail")
    preps = {}
    for d in (clean, dirty):
        preps[d.name] = prepare_data(_cfg(tmp_path, tokenizer_json, SourceConfig(path=str(d), name="c"),
                                          out=f"out_{d.name}", max_malformed_fraction=0.1), log=quiet)
    assert _source(preps["dirty"], "c")["skipped"] == {"invalid_utf8": 1}
    assert _shard_bytes(preps["dirty"].out_dir, "c") == _shard_bytes(preps["clean"].out_dir, "c")


# ---- jsonl -----------------------------------------------------------------------------------------------------
def _hostile_jsonl(path: Path) -> list[str]:
    """Writes a jsonl with one record of every kind; returns the texts that must be kept."""
    lines = [
        json.dumps({"text": GOOD[0]}).encode(),  # 1
        b'{"text": "unterminated',  # 2 malformed
        json.dumps({"text": ["a", "list"]}).encode(),  # 3 not a string (was concatenated once)
        json.dumps({"text": 42}).encode(),  # 4 not a string
        b'{"text": "lone \\ud800 surrogate"}',  # 5 lone surrogate escape
        json.dumps({"text": ""}).encode(),  # 6 empty
        json.dumps({"body": "no text field"}).encode(),  # 7 missing
        json.dumps({"text": None}).encode(),  # 8 missing (null)
        b"   ",  # 9 blank: not a record
        b"[1, 2]",  # 10 not an object
        json.dumps({"text": GOOD[1]}).encode(),  # 11
        b'{"text": "caf\xe9"}',  # 12 invalid UTF-8
        json.dumps({"text": {"nested": "object"}}).encode(),  # 13 not a string
        b'{"text": "a pair \\ud83d\\ude00 is fine"}',  # 14: a valid surrogate pair escape
        b"\xef\xbb\xbf" + json.dumps({"text": "bom"}).encode(),  # 15: a BOM is only skipped on line 1: malformed
    ]
    path.write_bytes(b"\r\n".join(lines) + b"\n")
    return [GOOD[0], GOOD[1], "a pair \U0001f600 is fine"]


JSONL_COUNTS = {
    "empty": 1,
    "missing_text": 2,
    "invalid_utf8": 1,
    "lone_surrogate": 1,
    "malformed_json": 3,
    "not_string": 3,
}


def test_jsonl_bad_records_are_counted_by_reason(tmp_path, tokenizer_json):
    f = tmp_path / "data.jsonl"
    keep = _hostile_jsonl(f)
    for streaming in (True, False):
        cfg = _cfg(tmp_path, tokenizer_json, f, out=f"out{streaming}", streaming=streaming, max_malformed_fraction=1.0)
        prep = prepare_data(cfg, log=quiet)
        assert _decoded(prep, "data") == sorted(keep)
        src = _source(prep, "data")
        assert src["skipped"] == JSONL_COUNTS and src["documents"] == 3 and src["records"] == 14
        ex = src["examples"]
        assert ex["malformed_json"][0].startswith(f"{f} line 2: not valid JSON: Invalid control character")
        assert ex["not_string"][0] == f"{f} line 3: text field 'text' holds a list, not a string"
        assert ex["lone_surrogate"] == [f"{f} line 5: text holds a lone surrogate \\ud800 at character 5"]
        assert ex["missing_text"][0] == f"{f} line 7: no field 'text' (fields: body)"
        assert ex["malformed_json"][1] == f"{f} line 10: a JSON list, not an object"
        assert ex["invalid_utf8"][0].startswith(f"{f} line 12: invalid UTF-8")


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_jsonl_damage_stops_with_file_and_line(tmp_path, tokenizer_json, policy):
    f = tmp_path / "data.jsonl"
    _hostile_jsonl(f)
    err = TooManyBadRecordsError if policy == "skip" else BadRecordError
    with pytest.raises(err, match=rf"{f} line 2: not valid JSON") as e:
        prepare_data(_cfg(tmp_path, tokenizer_json, f, on_bad_record=policy), log=quiet)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "line,match",
    [
        (b'{"text": "lone \\udc00"}', r"line 2: text holds a lone surrogate \\udc00"),
        (b'{"text": ["a", "b"]}', r"line 2: text field 'text' holds a list"),
        (b'{"text": 3.5}', r"line 2: text field 'text' holds a float"),
        (b'{"text": "x"', r"line 2: not valid JSON"),
        (b"[" * 100000, r"line 2: not valid JSON"),  # nested too deeply for the parser
    ],
)
def test_each_bad_jsonl_line_is_one_line_error(tmp_path, tokenizer_json, line, match):
    f = tmp_path / "data.jsonl"
    f.write_bytes(json.dumps({"text": "fine"}).encode() + b"\n" + line + b"\n")
    with pytest.raises(BadRecordError, match=match) as e:
        prepare_data(_cfg(tmp_path, tokenizer_json, f, on_bad_record="error"), log=quiet)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_oversized_jsonl_line_is_skipped_and_the_rest_read(tmp_path, tokenizer_json):
    f = tmp_path / "data.jsonl"
    big = json.dumps({"text": "word " * 300_000})  # 1.5 MB, above max_record_mb=1
    f.write_text("\n".join([json.dumps({"text": GOOD[2]}), big, json.dumps({"text": GOOD[3]})]) + "\n")
    prep = prepare_data(_cfg(tmp_path, tokenizer_json, f, max_record_mb=1, max_malformed_fraction=0.5), log=quiet)
    assert _decoded(prep, "data") == sorted(GOOD[2:4])
    assert _source(prep, "data")["skipped"] == {"too_large": 1}
    assert _source(prep, "data")["examples"]["too_large"][0].startswith(f"{f} line 2: a line of 1,500,")


def test_json_array_file(tmp_path, tokenizer_json):
    f = tmp_path / "data.json"
    f.write_text(json.dumps([{"text": t} for t in GOOD[:5]], indent=2))
    prep = prepare_data(_cfg(tmp_path, tokenizer_json, f), log=quiet)
    assert _decoded(prep, "data") == sorted(GOOD[:5])


# ---- parquet ---------------------------------------------------------------------------------------------------
def test_parquet_integer_column_stops_naming_file_and_row(tmp_path, tokenizer_json):
    f = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), f)
    with pytest.raises(TooManyBadRecordsError, match=rf"3 of 3 records.*{f} row 0: column 'text' holds int64"):
        prepare_data(_cfg(tmp_path, tokenizer_json, f), log=quiet)
    with pytest.raises(BadRecordError, match=rf"{f} row 0: column 'text' holds int64, not strings"):
        prepare_data(_cfg(tmp_path, tokenizer_json, f, on_bad_record="error"), log=quiet)


def test_parquet_odd_types_are_counted(tmp_path, tokenizer_json):
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.table({"text": GOOD[:20]}), d / "a_good.parquet")
    pq.write_table(pa.table({"text": pa.array([1, 2], pa.int64())}), d / "b_ints.parquet")
    pq.write_table(pa.table({"text": pa.array([["x"], ["y", "z"]])}), d / "c_lists.parquet")
    raw = [GOOD[20].encode(), b"caf\xe9", None, b""]
    pq.write_table(pa.table({"text": pa.array(raw, pa.binary())}), d / "d_bytes.parquet")
    pq.write_table(pa.table({"text": pa.array([GOOD[21], None], pa.large_string())}), d / "e_nulls.parquet")
    (d / "f_broken.parquet").write_bytes(b"PAR1 this is not really parquet")
    pq.write_table(pa.table({"body": ["no text column"]}), d / "g_other.parquet")
    prep = prepare_data(_cfg(tmp_path, tokenizer_json, d, max_malformed_fraction=0.5), log=quiet)
    assert _decoded(prep, "pq") == sorted(GOOD[:22])
    src = _source(prep, "pq")
    assert src["skipped"] == {
        "empty": 1,
        "missing_text": 3,
        "invalid_utf8": 1,
        "not_string": 4,
        "unreadable_file": 1,
    }
    assert src["examples"]["invalid_utf8"] == [f"{d / 'd_bytes.parquet'} row 1: invalid UTF-8 at byte 3: unexpected end of data"]
    assert src["examples"]["unreadable_file"][0].startswith(f"{d / 'f_broken.parquet'}: not a readable Parquet file")


# ---- empty corpora ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_directory_of_empty_files_trains_no_tokenizer(tmp_path, kind):
    d = tmp_path / "empty"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text("")
    cfg = stdlib_cfg(tmp_path / "out", sources=[SourceConfig(path=str(d))],
                     tokenizer=TokenizerConfig(kind=kind, vocab_size=300))
    with pytest.raises(EmptySourceError, match=r"no text to train the tokenizer on.*empty: skipped empty texts: 3"):
        prepare_data(cfg, log=quiet)
    assert not (tmp_path / "out" / "tokenizer" / "tokenizer_meta.json").exists()


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_a_reader_that_cannot_start_is_named_not_reported_as_no_records(tmp_path, kind, monkeypatch):
    """Found on a lent H200 (2026-11-28) whose image lacks the datasets package: prepare said "stdlib: no records"."""
    d = tmp_path / "src"
    d.mkdir()
    # enough words for 300 SentencePiece pieces: the tokenizer's sample is read without datasets, the shards are not
    letters = "abcdefghij"
    (d / "a.txt").write_text("".join(letters[i % 10] + letters[i // 10 % 10] + letters[i // 100 % 10]
                                     + ("\n" if i % 10 == 9 else " ") for i in range(3000)))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    cfg = stdlib_cfg(tmp_path / "out", sources=[SourceConfig(path=str(d))],
                     tokenizer=TokenizerConfig(kind=kind, vocab_size=300))
    with pytest.raises(DataError, match=r"^reading data sources needs the 'datasets' package, which does not import"):
        prepare_data(cfg, log=quiet)


def test_source_with_no_document_stops(tmp_path, tokenizer_json):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "a.txt").write_text("")
    (d / "b.bin").write_bytes(b"\0\1\2")
    good = tmp_path / "good"
    _write_texts(good, GOOD[:4])
    with pytest.raises(EmptySourceError, match=r"source 'empty' holds no document.*binary files: 1.*empty texts: 1"):
        prepare_data(_cfg(tmp_path, tokenizer_json, good, d), log=quiet)


def test_one_document_corpus_gets_advice_that_can_help(tmp_path, tokenizer_json):
    f = tmp_path / "book.txt"
    f.write_text(GOOD[3] * 50)
    logs = []
    cfg = _cfg(tmp_path, tokenizer_json, f, val_fraction=0.4)
    prepare_data(cfg, log=logs.append)
    assert any(m.startswith("warning: book has no validation document") and "per document" in m for m in logs)
    with pytest.raises(DataError, match=r"book/val holds 0 tokens in 0 documents.*split is per document.*add documents") as e:
        build_dataset(cfg, "val")
    assert "val_fraction" not in str(e.value)


# ---- sources edited after prepare ---------------------------------------------------------------------------------
def _prepare_killed_at_shard(n: int, cfg: DataConfig, monkeypatch) -> None:
    """Run prepare and interrupt it while it writes its n-th shard, as a kill would."""
    real = shards.write_shard
    calls = []

    def crashing(*a):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt("simulated crash")
        return real(*a)

    monkeypatch.setattr(shards, "write_shard", crashing)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, log=quiet)
    monkeypatch.setattr(shards, "write_shard", real)


def _bump_mtime(f: Path) -> None:
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_manifest_records_size_mtime_and_hash(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:5])
    prep = prepare_data(_cfg(tmp_path, tokenizer_json, d), log=quiet)
    for split in ("train", "val"):
        files = json.loads((prep.out_dir / "corpus" / split / "manifest.json").read_text())["source"]["files"]
        assert [f[0] for f in files] == [str(p) for p in sorted(d.iterdir())]
        for path, size, mtime, digest in files:
            st = os.stat(path)
            assert (size, mtime) == (st.st_size, st.st_mtime_ns)
            assert digest == hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()


def test_file_edited_in_place_is_refused_or_rebuilt(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:6])
    cfg = _cfg(tmp_path, tokenizer_json, d)
    prepare_data(cfg, log=quiet)
    f = d / "g002.txt"
    edited = GOOD[2].replace("lorem", "LOREM")  # same size, other content
    f.write_text(edited)
    _bump_mtime(f)
    with pytest.raises(SourceChangedError, match=rf"file {f} changed \(same size, new mtime.*on_source_change=rebuild") as e:
        prepare_data(cfg, log=quiet)  # what `train` does too: it calls prepare_data
    assert "\n" not in str(e.value)
    cfg.on_source_change = "rebuild"
    logs = []
    prep = prepare_data(cfg, log=logs.append)
    assert any(f"file {f} changed" in m and "rebuilding" in m for m in logs)
    assert _decoded(prep, "corpus") == sorted([*GOOD[:2], edited, *GOOD[3:6]])
    logs = []
    prepare_data(cfg, log=logs.append)  # and now it is current again
    assert not any("tokenizing" in m for m in logs)


@pytest.mark.parametrize("change,match", [
    ("grow", r"g001\.txt changed \(size \d+ -> \d+ bytes\)"),
    ("add", r"file .*new\.txt was added"),
    ("remove", r"file .*g004\.txt was removed"),
])
def test_size_change_added_and_removed_files_are_named(tmp_path, tokenizer_json, change, match):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:6])
    cfg = _cfg(tmp_path, tokenizer_json, d)
    prepare_data(cfg, log=quiet)
    if change == "grow":
        with open(d / "g001.txt", "a") as fh:
            fh.write("more")
    elif change == "add":
        (d / "new.txt").write_text("new")
    else:
        (d / "g004.txt").unlink()
    with pytest.raises(SourceChangedError, match=match):
        prepare_data(cfg, log=quiet)


def test_touched_file_with_same_content_is_reused(tmp_path, tokenizer_json):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:6])
    cfg = _cfg(tmp_path, tokenizer_json, d)
    prep = prepare_data(cfg, log=quiet)
    before = _shard_bytes(prep.out_dir, "corpus")
    f = d / "g003.txt"
    f.write_text(GOOD[3])  # rewritten with the same bytes
    _bump_mtime(f)
    logs = []
    prepare_data(cfg, log=logs.append)
    assert not any("tokenizing" in m for m in logs)
    assert _shard_bytes(prep.out_dir, "corpus") == before
    rec = {p: m for p, _, m, _ in _source(prep, "corpus")["files"]}
    assert rec[str(f)] == f.stat().st_mtime_ns  # refreshed: the next run does not hash it again


def test_interrupted_prepare_of_an_edited_source_starts_over(tmp_path, tokenizer_json, monkeypatch):
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:12])
    cfg = _cfg(tmp_path, tokenizer_json, d, shard_docs=2)
    _prepare_killed_at_shard(3, cfg, monkeypatch)
    (d / "g000.txt").write_text("edited while the prepare was down")
    logs = []
    prep = prepare_data(cfg, log=logs.append)
    assert any("starting this source over" in m for m in logs) and not any("resuming" in m for m in logs)
    fresh = prepare_data(_cfg(tmp_path, tokenizer_json, d, shard_docs=2, out="fresh"), log=quiet)
    assert _shard_bytes(prep.out_dir, "corpus") == _shard_bytes(fresh.out_dir, "corpus")


def test_interrupted_hostile_prepare_resumes_to_the_same_result(tmp_path, tokenizer_json, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_CHARS", 700)
    monkeypatch.setattr(sources, "READ_CHUNK", 1000)
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:30])
    (d / "g005b.txt").write_bytes(("words and words " * 500).encode() + b"\xc3(")  # dropped after its first pieces
    (d / "g007b.txt").write_text("x" * 3000)  # cut in pieces without any boundary
    (d / "g009b.bin").write_bytes(b"\0" * 10)
    (d / "g011b.txt").write_text("")
    ref = prepare_data(_cfg(tmp_path, tokenizer_json, d, shard_docs=3, out="ref", max_malformed_fraction=0.1), log=quiet)
    cfg = _cfg(tmp_path, tokenizer_json, d, shard_docs=3, max_malformed_fraction=0.1)
    _prepare_killed_at_shard(4, cfg, monkeypatch)
    logs = []
    prep = prepare_data(cfg, log=logs.append)
    assert any("resuming" in m for m in logs)
    for s in ("train", "val"):
        assert (prep.out_dir / "corpus" / s / "manifest.json").read_bytes() == (
            ref.out_dir / "corpus" / s / "manifest.json"
        ).read_bytes()
    assert _shard_bytes(prep.out_dir, "corpus") == _shard_bytes(ref.out_dir, "corpus")
    assert _decoded(prep, "corpus") == sorted([*GOOD[:30], "x" * 3000])


# ---- long documents in pieces ---------------------------------------------------------------------------------
def test_find_cut_prefers_newline_then_space_then_letter_digit_then_whitespace_run():
    assert find_cut("a" * 10 + "b\nc" + "d" * 10, 20) == 12  # after the newline
    assert find_cut("a" * 10 + "\n\nc" + "d x" + "d" * 10, 20) == 14  # a blank line is skipped; before the space
    assert find_cut("a" * 12 + "123" + "b" * 10, 20) == 15  # between a digit and a letter
    assert find_cut("+" * 12 + ",\n   +" + "+" * 10, 20) == 16  # before the last space of an indentation
    assert find_cut("+" * 30, 20) == 20  # nothing to choose: the limit


def test_split_pieces_is_bounded_and_lossless():
    rng = np.random.default_rng(0)
    alphabet = list("ab1 \n\t+é日")
    for limit in (7, 64, 1000):
        for n in (0, 1, limit, limit + 1, 5000):
            text = "".join(rng.choice(alphabet, size=n))
            pieces = list(split_pieces(text, limit))
            assert "".join(pieces) == text and all(0 < len(p) <= limit for p in pieces) or text == ""
            assert len(pieces) == 1 if n <= limit else len(pieces) > 1


@pytest.fixture(scope="module")
def sp_tokenizer():
    return train_sentencepiece(stdlib_texts(12), vocab_size=400, max_chars=300_000)


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_pieces_encode_exactly_like_the_whole_text(kind, tokenizer_json, sp_tokenizer):
    import base64

    tok = load_tokenizer(tokenizer_json) if kind == "bpe" else sp_tokenizer
    texts = [t for t in stdlib_texts(40) if len(t) > 3000][:10]
    texts += [
        base64.b64encode(np.random.default_rng(1).bytes(20000)).decode(),  # no whitespace at all
        " ".join(f"word{i} and  two   spaces\n\n\tindent" for i in range(2000)),
    ]
    # a small window makes the rare rules run: stdlib lists of indented lines leave only rule 4 in 250
    # characters, which SentencePiece does not honour (it never comes to that in a real 128 Ki window)
    limit = 500 if kind == "bpe" else 3000
    for t in texts:
        pieces = list(split_pieces(t, limit))
        assert len(pieces) > 1
        assert [i for p in tok.encode_batch(pieces) for i in p] == tok.encode(t)


def test_prepare_in_small_pieces_writes_the_same_shards(prepared_stdlib, tmp_path, monkeypatch):
    """Force every stdlib file through the piecewise path: the shards must not change by one byte."""
    import shutil

    ref_cfg, ref = prepared_stdlib
    monkeypatch.setattr(sources, "PIECE_CHARS", 600)
    monkeypatch.setattr(sources, "READ_CHUNK", 1000)
    cfg = stdlib_cfg(tmp_path / "small")
    shutil.copytree(ref.tokenizer_dir, tmp_path / "small" / "tokenizer")
    prep = prepare_data(cfg, log=quiet)
    assert _shard_bytes(prep.out_dir, "stdlib") == _shard_bytes(ref.out_dir, "stdlib")


# ---- config and CLI ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [
    ("on_bad_record", "drop"),
    ("max_malformed_fraction", 1.5),
    ("max_malformed_fraction", -0.1),
    ("max_record_mb", 0),
    ("on_source_change", "ignore"),
])
def test_config_rejects_bad_values(key, value):
    cfg = DataConfig()
    setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=f"data.{key}"):
        cfg.validate()
    with pytest.raises(ConfigError):
        load_config("tiny", [(f"data.{key}", str(value))])


def test_config_defaults_are_careful():
    cfg = DataConfig()
    assert (cfg.on_bad_record, cfg.max_malformed_fraction, cfg.on_source_change) == ("skip", 0.01, "error")


def _cli(args: list[str], capsys) -> tuple[int, str]:
    from hybridtron.cli import main

    rc = main(args)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", ["jsonl_line", "surrogate", "list_text", "parquet_ints", "empty_dir", "binary", "edited"])
def test_cli_reports_input_errors_in_one_line(tmp_path, tokenizer_json, capsys, case):
    data = tmp_path / "data"
    data.mkdir()
    expect = str(data)
    if case == "jsonl_line":
        (data / "a.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
        expect = f"{data / 'a.jsonl'} line 2: not valid JSON"
    elif case == "surrogate":
        (data / "a.jsonl").write_text('{"text": "\\ud83d alone"}\n')
        expect = f"{data / 'a.jsonl'} line 1: text holds a lone surrogate \\ud83d"
    elif case == "list_text":
        (data / "a.jsonl").write_text('{"text": ["x", "y"]}\n')
        expect = f"{data / 'a.jsonl'} line 1: text field 'text' holds a list"
    elif case == "parquet_ints":
        pq.write_table(pa.table({"text": [7, 8]}), data / "a.parquet")
        expect = f"{data / 'a.parquet'} row 0: column 'text' holds int64"
    elif case == "empty_dir":
        (data / "a.txt").write_text("")
        expect = "source 'data' holds no document"
    elif case == "binary":
        (data / "a.txt").write_text("fine")
        (data / "b.png").write_bytes(_binaries()["image.png"])
        expect = f"{data / 'b.png'}: NUL bytes"
    else:
        (data / "a.txt").write_text("first")
    policy = "error" if case in ("jsonl_line", "binary") else "skip"
    args = [
        "prepare", "--config", "tiny", "--data.sources", f"[{{path: '{data}'}}]",
        "--data.tokenizer.kind", "pretrained", "--data.tokenizer.path", str(tokenizer_json),
        "--data.out_dir", str(tmp_path / "out"), "--data.on_bad_record", policy,
    ]  # fmt: skip
    if case == "edited":
        assert _cli(args, capsys)[0] == 0
        (data / "a.txt").write_text("second")
        expect = f"file {data / 'a.txt'} changed (size 5 -> 6 bytes)"
    rc, err = _cli(args, capsys)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("hybridtron prepare: error: ")
    assert expect in err


@pytest.mark.parametrize("streaming", [True, False])
def test_file_changing_while_read_is_one_line_in_both_modes(tmp_path, tokenizer_json, monkeypatch, streaming):
    """Non-streaming reads run inside datasets' Arrow builder, which wraps what the reader raises."""
    d = tmp_path / "corpus"
    _write_texts(d, GOOD[:3])
    real = sources._check_unchanged

    def changed(fh, stamp):
        real(fh, [stamp[0], stamp[1] + 1, stamp[2]])

    monkeypatch.setattr(sources, "_check_unchanged", changed)
    with pytest.raises(sources.UnreadableFileError, match=r"g000\.txt changed while prepare was reading it") as e:
        prepare_data(_cfg(tmp_path, tokenizer_json, d, streaming=streaming), log=quiet)
    assert "\n" not in str(e.value)


def test_broken_pretrained_tokenizer_is_one_line(tmp_path):
    f = tmp_path / "tokenizer.json"
    f.write_text("{not json")
    with pytest.raises(DataError, match=rf"{f} is not a valid HF tokenizers tokenizer.json"):
        load_tokenizer(f)


# ---- everything at once, with the memory bound ----------------------------------------------------------------------
HUGE_MB = 20
RSS_BOUND_MB = 1024  # docs/data.md's bound for prepare's peak RSS growth at the default settings

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig
    from hybridtron.data_pipeline import prepare_data
    root, tok = sys.argv[1], sys.argv[2]
    cfg = DataConfig(
        sources=[SourceConfig(path=root + "/text", name="text"), SourceConfig(path=root + "/data.jsonl"),
                 SourceConfig(path=root + "/pq", name="pq")],
        tokenizer=TokenizerConfig(kind="pretrained", path=tok), out_dir=root + "/out", max_malformed_fraction=0.2,
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after the imports
    prep = prepare_data(cfg, log=lambda *a: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (peak - base) / 1024, "stats": prep.stats}))
    """
)


@pytest.fixture(scope="module")
def bpe_2048(tmp_path_factory) -> Path:
    """A 2048-id BPE: the session's 300-id one makes 2.2x the tokens of the huge line, hence 2.2x the time."""
    from hybridtron.data_pipeline.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("bpe2048")
    train_bpe(stdlib_texts(100), 2048, 2_000_000).save(d)
    return d / "tokenizer.json"


@pytest.mark.slow
def test_hostile_corpus_end_to_end_in_bounded_memory(tmp_path, bpe_2048):
    """Binary files, invalid UTF-8, a 20 MB line, malformed jsonl and odd parquet in one prepare: counts, peak
    RSS growth (measured in a child process: tokenizers allocates in Rust) and shards holding only the texts."""
    rng = np.random.default_rng(0)
    text_dir = tmp_path / "text"
    _write_texts(text_dir, GOOD[:20])
    for name, data in _binaries().items():
        (text_dir / name).write_bytes(data)
    (text_dir / "latin1.txt").write_bytes("café".encode("latin-1"))
    (text_dir / "empty.txt").write_text("")
    words = np.array("the of and data model tokens memory shard value x1 (a) [b] pipeline über".split())
    huge = " ".join(rng.choice(words, size=HUGE_MB * 200_000))[: HUGE_MB * 1_000_000]  # one line, no newline
    (text_dir / "huge.txt").write_text(huge)
    keep_jsonl = _hostile_jsonl(tmp_path / "data.jsonl")
    with open(tmp_path / "data.jsonl", "a") as fh:  # enough good records to stay under the fraction
        fh.writelines(json.dumps({"text": t}) + "\n" for t in GOOD[100:160])
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": GOOD[200:230]}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([1.5, 2.5])}), tmp_path / "pq" / "b_floats.parquet")
    pq.write_table(pa.table({"text": pa.array([GOOD[230], None, ""])}), tmp_path / "pq" / "c_nulls.parquet")

    env = {**os.environ, "RAYON_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(bpe_2048)],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    by = res["stats"]["by_source"]
    assert by["text"]["skipped"] == {"binary_file": 6, "empty": 1, "invalid_utf8": 1}
    assert by["data"]["skipped"] == JSONL_COUNTS
    assert by["pq"]["skipped"] == {"not_string": 2, "missing_text": 1, "empty": 1}
    assert res["growth_mb"] < RSS_BOUND_MB, f"peak RSS grew {res['growth_mb']:.0f} MB for a {HUGE_MB} MB line"

    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    out = tmp_path / "out"
    got = {}
    for name in ("text", "data", "pq"):
        docs = [d for s in ("train", "val") for d in split_docs(out / name / s)]
        assert all(d[-1] == tok.eos_id and tok.eos_id not in d[:-1] for d in docs)
        got[name] = sorted(tok.decode(d[:-1].tolist()) for d in docs)
    assert got["text"] == sorted([*GOOD[:20], huge])
    assert got["data"] == sorted([*keep_jsonl, *GOOD[100:160]])
    assert got["pq"] == sorted([*GOOD[200:231]])
