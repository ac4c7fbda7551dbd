"""Durable, atomic file writes shared by shards, tokenizers, checkpoints, run files and the kernel tuner's cache.

Write to a temporary name in the same directory, fsync, ``os.replace`` onto the final name, then fsync
the directory so the rename itself survives a crash: a reader sees the old file or the new one, never
a torn one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> str:
    """Atomically replace ``path`` with ``data``; returns the blake2b-128 digest of ``data``."""
    return write_chunks_atomic(path, [data])


def write_chunks_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> str:
    """``write_bytes_atomic`` of the concatenation of ``chunks``, without ever holding it whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    h = hashlib.blake2b(digest_size=16)
    with open(tmp, "wb") as f:
        for c in chunks:
            h.update(c)
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return h.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())
