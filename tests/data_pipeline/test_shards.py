from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hybridtron.data_pipeline import ShardError, build_dataset
from hybridtron.data_pipeline.shards import SplitReader, SplitWriter, token_dtype

from .helpers import split_docs


def _first_shard(cfg, split="train") -> tuple[Path, dict]:
    d = Path(cfg.out_dir) / "stdlib" / split
    return d, json.loads((d / "manifest.json").read_text())["shards"][0]


def test_intact_data_opens(copy_prepared):
    assert len(build_dataset(copy_prepared, "train")) > 0


def test_truncated_bin(copy_prepared):
    d, e = _first_shard(copy_prepared)
    f = d / e["bin"]
    f.write_bytes(f.read_bytes()[:-2])
    with pytest.raises(ShardError, match=r"shard_00000\.bin has .* bytes.*re-run `hybridtron prepare`"):
        build_dataset(copy_prepared, "train")


def test_flipped_byte(copy_prepared):
    d, e = _first_shard(copy_prepared)
    f = d / e["bin"]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard_00000\.bin fails its checksum"):
        build_dataset(copy_prepared, "train")


def test_missing_file(copy_prepared):
    d, e = _first_shard(copy_prepared, "val")
    (d / e["idx"]).unlink()
    with pytest.raises(ShardError, match=r"val/shard_00000\.idx is missing"):
        build_dataset(copy_prepared, "val")


def test_missing_manifest(copy_prepared):
    (Path(copy_prepared.out_dir) / "stdlib" / "train" / "manifest.json").unlink()
    with pytest.raises(ShardError, match="manifest.json is missing"):
        build_dataset(copy_prepared, "train")


def test_wrong_tokenizer_fingerprint(copy_prepared):
    d = Path(copy_prepared.out_dir) / "stdlib" / "train"
    with pytest.raises(ShardError, match="tokenized with tokenizer"):
        SplitReader(d, fingerprint="0" * 64)
    # and through build_dataset, when the tokenizer beside the shards is another one
    meta_f = Path(copy_prepared.out_dir) / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_f.read_text())
    meta["fingerprint"] = "f" * 64
    meta_f.write_text(json.dumps(meta))
    with pytest.raises(ShardError, match="not the one in use"):
        build_dataset(copy_prepared, "train")


def test_incomplete_split_refused(tmp_path):
    w = SplitWriter(tmp_path / "s", np.uint16, "fp", "key", shard_docs=2)
    for n in (3, 4, 5):
        w.add(np.arange(n, dtype=np.uint16))
    with pytest.raises(ShardError, match="incomplete"):
        SplitReader(tmp_path / "s", fingerprint="fp")
    w.finish()
    r = SplitReader(tmp_path / "s", fingerprint="fp")
    assert r.n_docs == 3 and r.n_tokens == 12
    np.testing.assert_array_equal(r.tokens(2, 9), [2, 0, 1, 2, 3, 0, 1])  # crosses the shard border at 7
    np.testing.assert_array_equal(r.doc_starts, [0, 3, 7, 12])
    assert [len(x) for x in split_docs(tmp_path / "s")] == [3, 4, 5]


def test_dtype_choice():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32 and token_dtype(300) == np.uint16


def test_checksum_verification_is_cached_by_size_mtime_and_inode(copy_prepared, monkeypatch):
    from hybridtron.data_pipeline import shards

    d, e = _first_shard(copy_prepared)
    n_files = 2 * len(json.loads((d / "manifest.json").read_text())["shards"])
    hashed = []
    real = shards.file_digest
    monkeypatch.setattr(shards, "file_digest", lambda f: hashed.append(Path(f).name) or real(f))

    SplitReader(d)
    assert len(hashed) == n_files and (d / shards.VERIFIED).is_file()  # (the copy's inodes are new)
    hashed.clear()
    SplitReader(d)
    assert hashed == []  # nothing changed: a stat per file, no reading
    # A rewritten shard (new mtime) is hashed again, and damage in it is caught.
    f = d / e["bin"]
    data = bytearray(f.read_bytes())
    data[0] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="fails its checksum"):
        SplitReader(d)
    assert hashed == [e["bin"]]
    # A torn cache file only costs a full verification.
    data[0] ^= 0x01
    f.write_bytes(bytes(data))
    (d / shards.VERIFIED).write_text('{"shard_00000.bin": [1, ')
    hashed.clear()
    SplitReader(d)
    assert len(hashed) == n_files


def test_a_split_directory_keeps_files_prepare_did_not_write(tmp_path, dead_pid, live_pid):
    """A data.out_dir pointed at a directory holding the user's files: prepare leaves them, named once in a warning
    (it used to delete every unlisted file, and then to refuse them); what an interrupted write of its own left is
    still removed, and a live writer's scratch is not."""
    from hybridtron.atomic import scratch_name, this_host

    d = tmp_path / "s"
    d.mkdir()
    (d / "notes.txt").write_text("precious")
    (d / "shard_00001.bin.bak").write_text("a user's backup")  # our name's prefix, not one of our names
    (d / "sub").mkdir()
    (d / "shard_00003.idx").symlink_to(d / "notes.txt")  # our name, but a link: never written by prepare
    foreign = ["notes.txt", "shard_00001.bin.bak", "shard_00003.idx", "sub"]
    live = d / f".shard_00002.bin.tmp-{this_host()}-{live_pid}"  # a prepare still writing
    other_host = d / f".shard_00002.idx.tmp-node9-{dead_pid}"  # another node's writer: not ours to judge
    stale = [d / "shard_00007.bin",  # a shard the manifest never listed
             scratch_name(d / "shard_00000.idx"),  # an interrupted atomic write of this process's
             d / f".manifest.json.tmp-{this_host()}-{dead_pid}",  # ... of a dead process of this host
             d / "shard_00004.bin.tmp",  # an older version's temporary name
             d / ".verified.json"]  # a reader's record of the digests it checked (SplitReader writes it)
    for f in [live, other_host, *stale]:
        f.write_bytes(b"half")
    logs = []
    w = SplitWriter(d, np.uint16, "fp", "key", shard_docs=2, log=logs.append)
    assert sorted(p.name for p in d.iterdir()) == sorted([*foreign, live.name, other_host.name])
    assert (d / "notes.txt").read_text() == "precious"
    assert len(logs) == 1 and logs[0].startswith(f"warning: {d} holds notes.txt, shard_00001.bin.bak, "
                                                 f"shard_00003.idx and 1 more, which `hybridtron prepare` did not "
                                                 f"write; left as they are"), logs
    w.reset("other")  # sources changed: the split starts over, the user's files stay, named once only
    assert len(logs) == 1 and (d / "notes.txt").read_text() == "precious"
