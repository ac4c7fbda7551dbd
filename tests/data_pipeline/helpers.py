"""Independent readers for tests: they parse the shard files with numpy, not with the code under test."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np


def stdlib_texts(n: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, sub, names in os.walk(root):
        sub[:] = [s for s in sub if s not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(d, f) for f in names if f.endswith(".py")]
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in sorted(files)[:n]]
    return [t for t in texts if t]


def split_docs(split_dir: Path) -> list[np.ndarray]:
    """Every document (with its trailing EOS) of a split, in order."""
    m = json.loads((Path(split_dir) / "manifest.json").read_text())
    docs = []
    for e in m["shards"]:
        tokens = np.fromfile(Path(split_dir) / e["bin"], dtype=m["dtype"])
        off = np.fromfile(Path(split_dir) / e["idx"], dtype=np.int64)
        docs += [tokens[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]
    return docs


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Relative path -> content of every file, except the datasets cache, the prepare config echo and the
    readers' cache of verified checksums (inode and mtime stamps, not data)."""
    root = Path(root)
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".hf_cache" not in p.parts and p.name not in ("prepare_config.json", ".verified.json")
    }
