from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridtron.atomic import this_host
from hybridtron.configs.job import SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import load_tokenizer, prepare_data, shards
from hybridtron.data_pipeline.errors import DataError
from hybridtron.data_pipeline.prepare import is_val

from .conftest import N_FILES, quiet, stdlib_cfg
from .helpers import split_docs, stdlib_texts, tree_bytes


def test_shards_hold_every_document_plus_eos(prepared_stdlib):
    cfg, prep = prepared_stdlib
    tok = prep.tokenizer
    texts = stdlib_texts(N_FILES)
    out = prep.out_dir / "stdlib"
    got = {s: split_docs(out / s) for s in ("train", "val")}
    for docs in got.values():
        assert all(d[-1] == tok.eos_id and tok.eos_id not in d[:-1] for d in docs)
    decoded = {s: [tok.decode(d[:-1].tolist()) for d in docs] for s, docs in got.items()}
    # every file is one document, each in exactly one split, in file order within the split
    assert sorted(decoded["train"] + decoded["val"]) == sorted(texts)
    assert _is_subsequence(decoded["train"], texts) and _is_subsequence(decoded["val"], texts)
    assert len(decoded["val"]) >= 1 and len(decoded["train"]) >= 1
    assert prep.stats["train"]["docs"] == len(got["train"])
    assert prep.stats["val"]["tokens"] == sum(len(d) for d in got["val"])
    assert prep.sources == ["stdlib"] and prep.tokenizer_dir == prep.out_dir / "tokenizer"


def _is_subsequence(part, whole) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def test_manifest_fields(prepared_stdlib):
    cfg, prep = prepared_stdlib
    m = json.loads((prep.out_dir / "stdlib" / "train" / "manifest.json").read_text())
    assert m["complete"] and m["dtype"] == "uint16"
    assert m["tokenizer_fingerprint"] == prep.tokenizer.fingerprint
    assert all(e["n_docs"] <= cfg.shard_docs for e in m["shards"]) and len(m["shards"]) >= 2
    assert sum(e["n_tokens"] for e in m["shards"]) == m["n_tokens"]


def test_split_is_hash_of_seed_and_index():
    hits = sum(is_val(0, i, 0.1) for i in range(20000))
    assert 1700 < hits < 2300
    assert [is_val(0, i, 0.3) for i in range(50)] != [is_val(1, i, 0.3) for i in range(50)]


def test_rerun_is_idempotent(copy_prepared):
    before = tree_bytes(copy_prepared.out_dir)
    logs = []
    prep = prepare_data(copy_prepared, log=logs.append)
    assert not any("tokenizing" in m or "training" in m for m in logs)
    assert tree_bytes(copy_prepared.out_dir) == before
    assert prep.stats["train"]["docs"] > 0


@pytest.mark.parametrize("mode", ["raise_before_commit", "raise_after_files"])
def test_interrupted_prepare_resumes_to_same_result(prepared_stdlib, tmp_path, monkeypatch, mode):
    ref_cfg, _ = prepared_stdlib
    cfg = stdlib_cfg(tmp_path / "out")
    # reuse the reference tokenizer so both runs tokenize identically
    shutil.copytree(ref_cfg.out_dir + "/tokenizer", tmp_path / "out" / "tokenizer")
    real = shards.write_shard
    calls = []

    def crashing(directory, index, docs, dtype):
        calls.append(index)
        if len(calls) == 3:
            if mode == "raise_after_files":
                real(directory, index, docs, dtype)  # files on disk, manifest not yet updated
                (directory / "shard_99999.bin.tmp").write_bytes(b"partial")
            raise KeyboardInterrupt("simulated crash")
        return real(directory, index, docs, dtype)

    monkeypatch.setattr(shards, "write_shard", crashing)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, log=quiet)
    monkeypatch.setattr(shards, "write_shard", real)
    logs = []
    prepare_data(cfg, log=logs.append)
    assert any("resuming" in m for m in logs)
    assert tree_bytes(cfg.out_dir) == tree_bytes(ref_cfg.out_dir)


def test_a_rerun_removes_what_killed_prepares_left_and_says_so(copy_prepared, dead_pid, live_pid):
    out, host = Path(copy_prepared.out_dir), this_host()
    gone = [out / "tokenizer" / f".tokenizer.json.tmp-{host}-{dead_pid}",  # killed while saving the tokenizer
            out / "stdlib" / "train" / f".shard_00001.bin.tmp-{host}-{dead_pid}",  # ... a shard
            out / f".prepare_config.json.tmp-{host}-{dead_pid}"]
    # (what a split directory's writer keeps there: test_shards.py)
    kept = [out / "tokenizer" / f".tokenizer.json.tmp-node9-{dead_pid}",  # another node's: not ours to judge
            out / f".prepare_config.json.tmp-{host}-{live_pid}"]  # a prepare still running
    for p in gone + kept:
        p.write_bytes(b"half")
    logs = []
    prepare_data(copy_prepared, log=logs.append)
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)
    said = [m for m in logs if "scratch" in m]
    assert len(said) == 1 and said[0].startswith(f"removed 3 scratch entries of dead processes in {out}: ")
    assert all(str(p.relative_to(out)) in said[0] for p in gone)


def test_changed_tokenizer_config_is_refused(copy_prepared):
    copy_prepared.tokenizer = TokenizerConfig(kind="bpe", vocab_size=400)
    with pytest.raises(ValueError, match=r"made from bpe training \(vocab_size 300.*one made from bpe training \(vocab_size 400"):
        prepare_data(copy_prepared, log=quiet)


def test_changed_split_config_is_refused(copy_prepared):
    copy_prepared.val_fraction = 0.3
    with pytest.raises(shards.ShardError, match="delete"):
        prepare_data(copy_prepared, log=quiet)
    # the seed also draws the tokenizer's sample: the tokenizer made with another one is refused first
    copy_prepared.val_fraction, copy_prepared.seed = 0.2, 7
    with pytest.raises(DataError, match="seed 0.*seed 7.*delete"):
        prepare_data(copy_prepared, log=quiet)


def test_streaming_gives_same_tokens(prepared_stdlib, tmp_path):
    ref_cfg, _ = prepared_stdlib
    cfg = stdlib_cfg(tmp_path / "s", streaming=True)
    shutil.copytree(ref_cfg.out_dir + "/tokenizer", tmp_path / "s" / "tokenizer")
    prepare_data(cfg, log=quiet)
    assert tree_bytes(cfg.out_dir) == tree_bytes(ref_cfg.out_dir)


def _decoded(prep, name):
    tok = prep.tokenizer
    return [tok.decode(d[:-1].tolist()) for s in ("train", "val") for d in split_docs(prep.out_dir / name / s)]


TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet, ünïcödé " * (i % 5 + 1) for i in range(30)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_jsonl_and_parquet_with_text_field(tmp_path, tokenizer_json, fmt):
    rows = [{"id": i, "content": t} for i, t in enumerate(TEXTS)]
    if fmt == "jsonl":
        f = tmp_path / "data.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        f = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), f)
    for streaming in (False, True):
        cfg = stdlib_cfg(
            tmp_path / f"out{streaming}",
            sources=[SourceConfig(path=str(f), text_field="content")],
            tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
            streaming=streaming,
        )
        prep = prepare_data(cfg, log=quiet)
        assert prep.sources == ["data"]
        assert sorted(_decoded(prep, "data")) == sorted(TEXTS)
        assert prep.tokenizer.fingerprint == load_tokenizer(tokenizer_json).fingerprint


def test_missing_text_field_is_named(tmp_path, tokenizer_json):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps({"body": "x"}) + "\n")
    cfg = stdlib_cfg(
        tmp_path / "o",
        sources=[SourceConfig(path=str(f))],
        tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
    )
    with pytest.raises(KeyError, match="'text'"):
        prepare_data(cfg, log=quiet)


@pytest.mark.parametrize("pattern", ["dir", "glob"])
def test_directory_and_glob_sources(tmp_path, tokenizer_json, pattern):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i, t in enumerate(TEXTS[:10]):
        (d / ("sub" if i % 2 else "") / f"f{i:02d}.txt").write_text(t)
    (d / "notes.md").write_text("not matched by the glob")
    path = str(d) if pattern == "dir" else str(d / "**" / "*.txt")
    cfg = stdlib_cfg(
        tmp_path / "o",
        sources=[SourceConfig(path=path, name="c")],
        tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
    )
    prep = prepare_data(cfg, log=quiet)
    expected = TEXTS[:10] + (["not matched by the glob"] if pattern == "dir" else [])
    assert sorted(_decoded(prep, "c")) == sorted(expected)


def test_no_matching_files_names_the_path(tmp_path, tokenizer_json):
    cfg = stdlib_cfg(
        tmp_path / "o",
        sources=[SourceConfig(path=str(tmp_path / "nothing*.txt"))],
        tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
    )
    with pytest.raises(FileNotFoundError, match="nothing"):
        prepare_data(cfg, log=quiet)


def test_sentencepiece_prepare_and_pretrained_model(tmp_path):
    cfg = stdlib_cfg(
        tmp_path / "sp", tokenizer=TokenizerConfig(kind="sentencepiece", vocab_size=400, sample_mb=0.2)
    )
    prep = prepare_data(cfg, log=quiet)
    assert prep.tokenizer.kind == "sp" and prep.tokenizer.vocab_size == 400
    assert sorted(_decoded(prep, "stdlib")) == sorted(stdlib_texts(N_FILES))
    model = prep.tokenizer_dir / "tokenizer.model"
    cfg2 = stdlib_cfg(tmp_path / "sp2", tokenizer=TokenizerConfig(kind="pretrained", path=str(model)))
    prep2 = prepare_data(cfg2, log=quiet)
    assert tree_bytes(prep2.out_dir / "stdlib") == tree_bytes(prep.out_dir / "stdlib")


@pytest.mark.parametrize("n_docs,expected", [(1, (1, 0)), (2, (1, 1))])
def test_tiny_corpus_fills_train_then_val(tmp_path, tokenizer_json, n_docs, expected):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(n_docs):
        (d / f"{i}.txt").write_text(f"doc {i}")
    cfg = stdlib_cfg(
        tmp_path / "o",
        sources=[SourceConfig(path=str(d))],
        tokenizer=TokenizerConfig(kind="pretrained", path=str(tokenizer_json)),
        val_fraction=0.01,
    )
    st = prepare_data(cfg, log=quiet).stats
    assert (st["train"]["docs"], st["val"]["docs"]) == expected


def test_arrow_cached_text_source_sees_edited_files(tmp_path):
    """Non-streaming reads go through an Arrow cache; editing a file in place must not serve stale text."""
    from hybridtron.configs.job import SourceConfig
    from hybridtron.data_pipeline.sources import iter_documents

    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("first version")
    src = SourceConfig(path=str(d))
    cache = tmp_path / "cache"
    assert [t for b in iter_documents(src, False, cache) for t in b] == ["first version"]
    import os

    (d / "a.txt").write_text("second, longer version")
    os.utime(d / "a.txt", ns=(1, 1))
    assert [t for b in iter_documents(src, False, cache) for t in b] == ["second, longer version"]


def test_prepare_resumed_by_the_cli_keeps_a_users_file_and_removes_its_own_leftovers(small_data_dir, small_argv,
                                                                                     tmp_path, monkeypatch, capsys,
                                                                                     dead_pid):
    """`hybridtron prepare` killed midway, then run again, with a file of the user's in a split directory: the file
    stays (one warning line names it), the killed write's shard files and scratch go, the shards come out as an
    uninterrupted prepare's."""
    from hybridtron.cli import main

    out = tmp_path / "data"
    shutil.copytree(small_data_dir / "tokenizer", out / "tokenizer")  # the same tokenizer: the same tokens
    argv = ["prepare", *small_argv(out, tmp_path / "run")[1:]]
    real = shards.write_shard
    calls = []

    def killed(directory, index, docs, dtype):
        calls.append(index)
        if len(calls) == 1:  # the files written, the manifest not yet: as a kill between the two leaves it
            real(directory, index, docs, dtype)
            raise KeyboardInterrupt("simulated kill")
        return real(directory, index, docs, dtype)

    monkeypatch.setattr(shards, "write_shard", killed)
    assert main(argv) == 130  # the command's Ctrl-C exit: one line, no traceback
    monkeypatch.setattr(shards, "write_shard", real)
    split = out / "stdlib" / "train"
    assert sorted(p.name for p in split.iterdir()) == ["shard_00000.bin", "shard_00000.idx"]  # listed nowhere
    stale = [split / f".manifest.json.tmp-{this_host()}-{dead_pid}", split / "shard_00009.bin"]  # ours, left over
    for f in stale:
        f.write_bytes(b"half")
    (split / "notes.txt").write_text("precious")
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out.splitlines()
    assert [ln for ln in said if "notes.txt" in ln] == [
        f"[hybridtron] warning: {split} holds notes.txt, which `hybridtron prepare` did not write; left as it is "
        f"(prepare reads and removes only its own files)"]
    assert (split / "notes.txt").read_text() == "precious" and not any(f.exists() for f in stale)
    (split / "notes.txt").unlink()
    assert tree_bytes(out) == tree_bytes(small_data_dir)  # the killed write's files were replaced by whole ones
