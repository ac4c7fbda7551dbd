"""Indexed token shards: ``shard_NNNNN.bin`` (token ids) + ``shard_NNNNN.idx`` (int64 document offsets, n_docs+1)
and one ``manifest.json`` per split directory.

Every document stored in a shard ends with the tokenizer's EOS id (appended at write time by ``prepare``).
A shard closes after ``shard_docs`` documents or once it holds ``MAX_SHARD_TOKENS`` tokens, so the tokens a
writer buffers are bounded whatever the documents' length.

What the split was made from: ``key`` (format, text field, split rule, reader version), ``inputs_digest`` (the
source files' paths, sizes and mtimes when the build started) and, once complete, ``source``: every source
file's ``[path, size, mtime_ns, blake2b]`` and the counts of what was kept and skipped (see ``prepare``).

Opening a split checks every shard file's size against the manifest and its blake2b against the manifest's
digest. The digest check is remembered in ``.verified.json`` beside the manifest, keyed by each file's size,
mtime and inode: a file unchanged since its last verification is not read again, so a start over hundreds of
GB of shards costs a ``stat`` per file, and a file replaced or rewritten since is hashed again. (An in-place
edit that keeps size and mtime, which takes a deliberate ``touch -d``, is not caught by the cache.)

Crash safety: each file is written under a ``.tmp`` name, fsynced and renamed; the manifest (also replaced
atomically) lists a shard only after both its files are in place. A shard file that the manifest does not
list is the remnant of an interrupted run and is deleted when a writer reopens the directory; so is the scratch
file of a write whose process is gone. Nothing else there is deleted, whoever put it there. The manifest's
``complete`` flag is set once the split's last shard is written; readers refuse an incomplete split.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridtron.atomic import (
    fsync_dir,
    parse_scratch,
    pid_alive,
    this_host,
    write_bytes_atomic,
    write_chunks_atomic,
    write_text_atomic,
)
from hybridtron.data_pipeline.errors import DataError

MANIFEST = "manifest.json"
VERIFIED = ".verified.json"  # digest checks already done: {file: [size, mtime_ns, inode, blake2b]}
# What a split directory holds (the names above), and the temporary names earlier versions wrote beside them
_OWN_NAME = re.compile(rf"^(shard_\d{{5}}\.(bin|idx)|{re.escape(MANIFEST)}|{re.escape(VERIFIED)})(\.tmp[\w.-]*)?$")
VERSION = 2
MAX_SHARD_TOKENS = 1 << 25  # 64 MiB of uint16 ids
_CHUNK = 1 << 22


def _writer_gone(host: str | None, pid: int) -> bool:
    """Whether the writer of a scratch file in a split directory is gone: this process (no write of its own is in
    flight when a writer opens or resets the directory), a dead process of this host, or a name of an older
    version, which carried no host. Another host's writer cannot be seen from here (atomic.reclaim_scratch's rule)."""
    if host is None or pid == os.getpid():
        return True
    return host == this_host() and not pid_alive(pid)


class ShardError(DataError):
    """Prepared data is missing, damaged, or was made with another tokenizer."""


def token_dtype(vocab_size: int) -> np.dtype:
    # ids run 0..vocab_size-1, so 65536 ids still fit uint16; half the disk and page cache of uint32
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def shard_stem(index: int) -> str:
    return f"shard_{index:05d}"


def _parts(doc) -> list[np.ndarray]:
    return [doc] if isinstance(doc, np.ndarray) else list(doc)


def write_shard(directory: Path, index: int, docs: list, dtype: np.dtype) -> dict:
    """Write one shard's two files; returns its manifest entry. Does not touch the manifest.
    A document is an array of ids or a list of arrays (the pieces of a long document), written in turn."""
    lengths = [sum(len(p) for p in _parts(d)) for d in docs]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    chunks = (memoryview(np.ascontiguousarray(p, dtype=dtype)).cast("B") for d in docs for p in _parts(d) if len(p))
    stem = shard_stem(index)
    return {
        "bin": stem + ".bin",
        "idx": stem + ".idx",
        "n_docs": len(docs),
        "n_tokens": int(offsets[-1]),
        "bin_blake2b": write_chunks_atomic(directory / (stem + ".bin"), chunks),
        "idx_blake2b": write_bytes_atomic(directory / (stem + ".idx"), offsets.tobytes()),
    }


def read_manifest(directory: Path) -> dict | None:
    f = Path(directory) / MANIFEST
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ShardError(f"{f} is not valid JSON ({e}); delete {directory} and re-run `hybridtron prepare`") from None


class SplitWriter:
    """Appends documents to a split directory, one shard per ``shard_docs`` documents, resuming after a crash.

    ``key`` identifies how the split is made (format, split rule, tokenizer); reopening a directory made another
    way is an error rather than a silent mix of two corpora. ``inputs_digest`` identifies the source files a
    build started from: ``prepare`` compares it (and, once complete, the recorded files) with the files now.
    """

    def __init__(
        self, directory: Path, dtype: np.dtype, fingerprint: str, key: str, shard_docs: int, inputs_digest: str = "",
        log: Callable[[str], object] | None = None,
    ):
        self.dir = Path(directory)
        self.log = log  # the warning about files in the directory that prepare did not write
        self._named: set[str] = set()  # those already named in a warning
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self.shard_docs = shard_docs
        self.fingerprint, self.key = fingerprint, key
        m = read_manifest(self.dir)
        if m is not None and m.get("version") != VERSION:
            raise ShardError(
                f"{self.dir} was prepared by another version of `hybridtron prepare` (manifest version "
                f"{m.get('version')}, this one writes {VERSION}); delete {self.dir.parent} and re-run `hybridtron prepare`"
            )
        if m is not None and (m.get("key") != key or m.get("tokenizer_fingerprint") != fingerprint):
            raise ShardError(
                f"{self.dir} was prepared from another source, split or tokenizer configuration; "
                f"use another data.out_dir or delete {self.dir} and re-run `hybridtron prepare`"
            )
        self.manifest = m or self._new_manifest(inputs_digest)
        self._remove_unlisted()
        self._buf: list = []
        self._buf_tokens = 0

    def _new_manifest(self, inputs_digest: str) -> dict:
        return {
            "version": VERSION,
            "dtype": self.dtype.name,
            "tokenizer_fingerprint": self.fingerprint,
            "key": self.key,
            "inputs_digest": inputs_digest,
            "shard_docs": self.shard_docs,
            "complete": False,
            "n_docs": 0,
            "n_tokens": 0,
            "shards": [],
        }

    def _remove_unlisted(self) -> None:
        """Remove what an interrupted write of this split left: shards the manifest never listed and the scratch
        files of shard and manifest writes whose process is gone. Any other entry is not ours and stays, named once
        in a warning: a data.out_dir pointed at a directory that holds the user's files must not eat them (it used
        to), nor be refused for them (readers open only the listed shards), and a live writer's scratch is its own."""
        listed = {e[k] for e in self.manifest["shards"] for k in ("bin", "idx")} | {MANIFEST}
        ours, foreign = [], []
        for f in sorted(self.dir.iterdir()):
            if f.name in listed:
                continue
            scratch = parse_scratch(f.name)
            if f.is_symlink() or not f.is_file() or not _OWN_NAME.match(scratch[0] if scratch else f.name):
                foreign.append(f.name)
            elif scratch is None or _writer_gone(scratch[1], scratch[2]):
                ours.append(f)
        new = [n for n in foreign if n not in self._named]
        if new and self.log is not None:
            self._named.update(new)
            shown = ", ".join(new[:3]) + (f" and {len(new) - 3} more" if len(new) > 3 else "")
            self.log(f"warning: {self.dir} holds {shown}, which `hybridtron prepare` did not write; left as "
                     f"{'they are' if len(new) > 1 else 'it is'} (prepare reads and removes only its own files)")
        for f in ours:
            f.unlink(missing_ok=True)

    def reset(self, inputs_digest: str) -> None:
        """Start the split over (its sources changed): an empty manifest first, then the old shards go."""
        self.manifest = self._new_manifest(inputs_digest)
        self._save()
        self._remove_unlisted()
        self._buf, self._buf_tokens = [], 0

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    @property
    def docs_done(self) -> int:
        """Documents already in committed shards; ``prepare`` skips that many on resume."""
        return int(self.manifest["n_docs"])

    def add(self, ids) -> None:
        """One document: an array of ids, or a list of arrays (its pieces, in order)."""
        self._buf.append(ids)
        self._buf_tokens += sum(len(p) for p in _parts(ids))
        if len(self._buf) == self.shard_docs or self._buf_tokens >= MAX_SHARD_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        entry = write_shard(self.dir, len(self.manifest["shards"]), self._buf, self.dtype)
        self._buf, self._buf_tokens = [], 0
        self.manifest["shards"].append(entry)
        self.manifest["n_docs"] += entry["n_docs"]
        self.manifest["n_tokens"] += entry["n_tokens"]
        self._save()

    def finish(self, source: dict | None = None) -> dict:
        """Write the last shard and mark the split complete; ``source`` (files and counts) goes in the manifest."""
        self._flush()
        if source is not None:
            self.manifest["source"] = source
        self.manifest["complete"] = True
        self._save()
        return self.manifest

    def save_source(self, source: dict, inputs_digest: str) -> None:
        """Record refreshed file stamps (a file touched without a change of content)."""
        self.manifest["source"] = source
        self.manifest["inputs_digest"] = inputs_digest
        self._save()

    def _save(self) -> None:
        write_bytes_atomic(self.dir / MANIFEST, json.dumps(self.manifest, indent=1).encode())
        fsync_dir(self.dir)


class SplitReader:
    """A verified, memory-mapped view of one split: the concatenation of its shards' documents."""

    def __init__(self, directory: Path, fingerprint: str | None = None, verify_checksums: bool = True):
        self.dir = Path(directory)
        redo = f"delete {self.dir} and re-run `hybridtron prepare`"
        m = read_manifest(self.dir)
        if m is None:
            raise ShardError(f"{self.dir / MANIFEST} is missing; run `hybridtron prepare` for this data.out_dir")
        if not m.get("complete"):
            raise ShardError(f"{self.dir} is incomplete (prepare was interrupted); re-run `hybridtron prepare`")
        if fingerprint is not None and m["tokenizer_fingerprint"] != fingerprint:
            raise ShardError(
                f"{self.dir} was tokenized with tokenizer {m['tokenizer_fingerprint'][:12]}, not the one in use "
                f"({fingerprint[:12]}); {redo}, or use the tokenizer it was made with"
            )
        self.dtype = np.dtype(m["dtype"])
        self.manifest = m
        self._tokens: list[np.ndarray] = []
        offsets = []
        base = 0
        verified = self._verified() if verify_checksums else {}
        fresh = {}
        for e in m["shards"]:
            for kind, expected in (("bin", e["n_tokens"] * self.dtype.itemsize), ("idx", (e["n_docs"] + 1) * 8)):
                f = self.dir / e[kind]
                if not f.is_file():
                    raise ShardError(f"shard file {f} is missing; {redo}")
                size = f.stat().st_size
                if size != expected:
                    raise ShardError(f"shard file {f} has {size} bytes, the manifest expects {expected}; {redo}")
                if verify_checksums:
                    st = f.stat()
                    stamp = [st.st_size, st.st_mtime_ns, st.st_ino, e[kind + "_blake2b"]]
                    if verified.get(e[kind]) != stamp:
                        if file_digest(f) != e[kind + "_blake2b"]:
                            raise ShardError(f"shard file {f} fails its checksum (corrupted on disk); {redo}")
                    fresh[e[kind]] = stamp
            idx = np.fromfile(self.dir / e["idx"], dtype=np.int64)
            if idx[0] != 0 or idx[-1] != e["n_tokens"] or np.any(np.diff(idx) <= 0):
                raise ShardError(f"shard index {self.dir / e['idx']} has inconsistent offsets; {redo}")
            n = e["n_tokens"]
            self._tokens.append(np.memmap(self.dir / e["bin"], dtype=self.dtype, mode="r", shape=(n,)))
            offsets.append(idx[:-1] + base)
            base += n
        if verify_checksums and fresh != verified:
            try:  # a read-only data directory just verifies again next time
                write_text_atomic(self.dir / VERIFIED, json.dumps(fresh))
            except OSError:
                pass
        self.n_tokens = base
        self.n_docs = int(m["n_docs"])
        # global token offset of every document start, plus the end; doc boundaries for doc_ids
        self.doc_starts = np.concatenate([*offsets, np.array([base], np.int64)])
        self._shard_starts = np.cumsum([0] + [len(t) for t in self._tokens])

    def _verified(self) -> dict:
        try:
            v = json.loads((self.dir / VERIFIED).read_text())
            return v if isinstance(v, dict) else {}
        except (OSError, ValueError, UnicodeDecodeError):
            return {}  # missing or torn: verify everything again

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's concatenated stream, across shard borders."""
        parts = []
        s = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        while start < stop:
            lo = start - self._shard_starts[s]
            take = min(stop - start, len(self._tokens[s]) - lo)
            parts.append(self._tokens[s][lo : lo + take])
            start += take
            s += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
