"""``prepare_data``: tokenizer + token shards for every source, resumable and idempotent.

Layout of ``out_dir``::

    tokenizer/                     tokenizer.json or tokenizer.model + tokenizer_meta.json
    {source}/{train,val}/          shard_NNNNN.bin/.idx + manifest.json (see shards.py)
    .hf_cache/                     HF datasets' Arrow cache, kept beside the data instead of in ~/.cache

Each document is stored as its tokens followed by EOS. The train/val split is per document, from a hash of
(seed, document index), so it is the same on every re-run and independent of sharding or streaming.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hybridtron.configs.job import DataConfig

from .atomic import write_text_atomic
from .errors import DataError
from .shards import SplitWriter, read_manifest, token_dtype
from .sources import iter_documents, resolve_files, source_name
from .tokenizer import Tokenizer, load_tokenizer, read_meta, train_bpe, train_sentencepiece

SPLITS = ("train", "val")
# HF encode_batch parallelises over the documents of one call; batches of ~4M characters keep the cores
# busy (each batch ends with a tail where its longest documents run alone) while bounding memory
_ENCODE_CHARS = 4_000_000


@dataclass
class PreparedData:
    out_dir: Path
    tokenizer: Tokenizer
    tokenizer_dir: Path
    sources: list[str]
    stats: dict = field(default_factory=dict)


def source_names(cfg: DataConfig) -> list[str]:
    names = [source_name(s) for s in cfg.sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DataError(f"data.sources have duplicate names {dup}; give each source a distinct `name`")
    return names


def _tokenizer_config(cfg: DataConfig) -> dict:
    t = cfg.tokenizer
    return {"kind": t.kind, "vocab_size": t.vocab_size if t.kind != "pretrained" else None, "path": t.path or None}


def _training_texts(cfg: DataConfig, cache: Path) -> Iterator[str]:
    """Each source contributes its weight's share of ``train_max_chars``, so one big source cannot crowd out the rest."""
    total_w = sum(s.weight for s in cfg.sources)
    for src in cfg.sources:
        budget = int(cfg.tokenizer.train_max_chars * src.weight / total_w)
        for batch in iter_documents(src, cfg.streaming, cache):
            for t in batch:
                if budget <= 0:
                    break
                yield t[:budget]
                budget -= len(t)
            if budget <= 0:
                break


def get_tokenizer(cfg: DataConfig, out: Path, log: Callable = print) -> Tokenizer:
    """Reuse ``out/tokenizer`` when present and made from the same config; otherwise train or load and save."""
    tdir = out / "tokenizer"
    want = _tokenizer_config(cfg)
    meta = read_meta(tdir)
    if meta is not None:
        if meta.get("config") != want:
            raise DataError(
                f"{tdir} holds a tokenizer made with {meta.get('config')}, but data.tokenizer asks for {want}; "
                f"use another data.out_dir or delete {out}"
            )
        return load_tokenizer(tdir)
    t = cfg.tokenizer
    if t.kind == "pretrained":
        tok = load_tokenizer(t.path)
    else:
        log(f"training {t.kind} tokenizer (vocab {t.vocab_size}, <= {t.train_max_chars:,} chars)")
        train = train_bpe if t.kind == "bpe" else train_sentencepiece
        tok = train(_training_texts(cfg, out / ".hf_cache"), t.vocab_size, t.train_max_chars)
    tok.save(tdir, config=want)
    return load_tokenizer(tdir)


def is_val(seed: int, doc_index: int, val_fraction: float) -> bool:
    h = hashlib.blake2b(struct.pack("<qq", seed, doc_index), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


def _assign_splits(batches: Iterator[list[str]], seed: int, val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, text) per document. The last document is held back one step so that it can fill a split that
    no document drew: train is never empty, and val is non-empty whenever there are >= 2 documents, without
    knowing the count upfront (streaming)."""
    prev: str | None = None
    n = n_val = 0
    for batch in batches:
        for text in batch:
            if prev is not None:
                split = "val" if is_val(seed, n - 1, val_fraction) else "train"
                n_val += split == "val"
                yield split, prev
            prev = text
            n += 1
    if prev is not None:
        if n_val == n - 1:  # no train document yet
            last = "train"
        elif n_val == 0:
            last = "val"
        else:
            last = "val" if is_val(seed, n - 1, val_fraction) else "train"
        yield last, prev


def _source_key(cfg: DataConfig, i: int, files: list[Path], fmt: str) -> str:
    s = cfg.sources[i]
    # what fixes the content of the shards; not `streaming` or `num_workers`, which must not change the result
    desc = {
        "files": [str(f) for f in files],
        "format": fmt,
        "text_field": s.text_field,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "shard_docs": cfg.shard_docs,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _prepare_source(cfg: DataConfig, i: int, name: str, tok: Tokenizer, out: Path, log: Callable) -> None:
    src = cfg.sources[i]
    files, fmt = resolve_files(src)
    key = _source_key(cfg, i, files, fmt)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(out / name / s, dtype, tok.fingerprint, key, cfg.shard_docs) for s in SPLITS}
    if all(w.complete for w in writers.values()):
        return
    skip = {s: w.docs_done for s, w in writers.items()}
    if any(skip.values()):
        log(f"{name}: resuming after {skip['train']} train / {skip['val']} val documents already in shards")
    log(f"{name}: tokenizing {len(files)} files ({fmt}) from {src.path}")
    seen = dict.fromkeys(SPLITS, 0)
    pending: dict[str, list[str]] = {s: [] for s in SPLITS}
    chars = dict.fromkeys(SPLITS, 0)
    eos = tok.eos_id
    # Encoding runs on one worker thread (tokenizers and SentencePiece release the GIL and use every core
    # themselves), so reading the next batch and writing the previous one's shards overlap with it. Two
    # concurrent encode calls measured slower than one (Rayon already saturates the cores). Results are
    # written in submission order, so the shards are identical to a serial run.
    in_flight: deque[tuple[str, Future]] = deque()

    def write_oldest() -> None:
        split, fut = in_flight.popleft()
        for ids in fut.result():
            doc = np.empty(len(ids) + 1, dtype=dtype)
            doc[:-1] = ids
            doc[-1] = eos
            writers[split].add(doc)

    def submit(split: str) -> None:
        if pending[split]:
            in_flight.append((split, pool.submit(tok.encode_batch, pending[split])))
            pending[split] = []
            chars[split] = 0
        while len(in_flight) > 1:
            write_oldest()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        docs = iter_documents(src, cfg.streaming, out / ".hf_cache", resolved=(files, fmt))
        for split, text in _assign_splits(docs, cfg.seed, cfg.val_fraction):
            seen[split] += 1
            if seen[split] <= skip[split]:
                continue  # already in a committed shard: reading is cheap, tokenizing is what we avoid
            pending[split].append(text)
            chars[split] += len(text)
            if chars[split] >= _ENCODE_CHARS:
                submit(split)
        for s in SPLITS:
            submit(s)
        while in_flight:
            write_oldest()
    for s in SPLITS:
        writers[s].finish()


def _stats(out: Path, names: list[str]) -> dict:
    stats: dict = {s: {"docs": 0, "tokens": 0} for s in SPLITS}
    stats["by_source"] = {}
    for name in names:
        per = {}
        for s in SPLITS:
            m = read_manifest(out / name / s) or {"n_docs": 0, "n_tokens": 0}
            per[s] = {"docs": m["n_docs"], "tokens": m["n_tokens"]}
            stats[s]["docs"] += m["n_docs"]
            stats[s]["tokens"] += m["n_tokens"]
        stats["by_source"][name] = per
    return stats


def _set_threads(cfg: DataConfig) -> None:
    n = cfg.num_workers or os.cpu_count() or 1
    # Rayon reads this once, when tokenizers first goes parallel in this process; an explicit user setting wins.
    os.environ.setdefault("RAYON_NUM_THREADS", str(n))
    # We never fork while tokenizing (SentencePiece uses threads too), so the tokenizers fork hazard does not
    # arise here; we leave TOKENIZERS_PARALLELISM to the user rather than flip it process-wide.


def prepare_data(cfg: DataConfig, log: Callable = print) -> PreparedData:
    """Train/load the tokenizer and write shards for every source. A re-run only finishes what is missing."""
    cfg.validate()
    _set_threads(cfg)
    out = Path(cfg.out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    names = source_names(cfg)
    tok = get_tokenizer(cfg, out, log)
    tok.num_threads = cfg.num_workers or tok.num_threads
    for i, name in enumerate(names):
        _prepare_source(cfg, i, name, tok, out, log)
    stats = _stats(out, names)
    write_text_atomic(out / "prepare_config.json", json.dumps(asdict(cfg), indent=2))
    log(
        f"prepared {out}: train {stats['train']['docs']} docs / {stats['train']['tokens']:,} tokens, "
        f"val {stats['val']['docs']} docs / {stats['val']['tokens']:,} tokens"
    )
    return PreparedData(out, tok, out / "tokenizer", names, stats)
