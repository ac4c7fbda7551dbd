"""``prepare_data``: tokenizer + token shards for every source, resumable, idempotent and checked.

Layout of ``out_dir``::

    tokenizer/                     tokenizer.json or tokenizer.model + tokenizer_meta.json
    {source}/{train,val}/          shard_NNNNN.bin/.idx + manifest.json (see shards.py)
    .hf_cache/                     HF datasets' Arrow cache, kept beside the data instead of in ~/.cache

Each document is stored as its tokens followed by EOS. The train/val split is per document, from a hash of
(seed, document index), so it is the same on every re-run and independent of sharding or streaming.

Bad records (binary files, invalid UTF-8, malformed jsonl lines, non-string or empty texts, ...) are skipped
and counted, or stop prepare, as ``data.on_bad_record`` and ``data.max_malformed_fraction`` say (sources.py);
the counts and the first few places go to the log and to each split's manifest. A complete split is reused
only while its source files have the paths, sizes and mtimes (or, for a touched file, the content hash)
recorded in its manifest; otherwise ``data.on_source_change`` says whether to stop or rebuild.

Memory does not grow with a document's length: documents arrive in pieces of at most ``PIECE_CHARS``
characters (text files are read 1 MiB at a time), pieces are encoded in batches of about ``encode._ENCODE_BYTES``
UTF-8 bytes with one batch in flight, and token ids wait in memory only until their shard (at most
``shard_docs`` documents or ``MAX_SHARD_TOKENS`` tokens) is written; ``max_record_mb`` bounds one record.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hybridtron.atomic import new_dirs_removed_on_failure, reclaim_scratch, write_text_atomic
from hybridtron.configs.job import DataConfig
from hybridtron.data_pipeline.data_dir import data_dir, describe_recipe, tokenizer_recipe
from hybridtron.data_pipeline.data_lock import hold_data_dir
from hybridtron.data_pipeline.encode import encode_documents
from hybridtron.data_pipeline.errors import DataError, EmptySourceError, SourceChangedError, one_line
from hybridtron.data_pipeline.parts import PARTS_DIR, PLAN, part_documents, plan_source, remove_parts
from hybridtron.data_pipeline.progress import Progress
from hybridtron.data_pipeline.shards import MAX_SHARD_TOKENS, SplitWriter, read_manifest, token_dtype
from hybridtron.data_pipeline.sources import (
    PIECE_CHARS,
    READER_VERSION,
    REASONS,
    SourceReport,
    SourceStream,
    file_hash,
    file_stamp,
    resolve_files,
    source_name,
)
from hybridtron.data_pipeline.tokenizer import Tokenizer, load_tokenizer, read_meta, train_bpe, train_sentencepiece

SPLITS = ("train", "val")


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


def _training_texts(cfg: DataConfig, reports: list, log: Callable) -> Iterator[str]:
    """A deterministic sample of about ``data.tokenizer.sample_mb`` MB spread over the whole corpus, each source
    its weight's share (tokenizer_sample.py: it reads about that much whatever the corpus's size), with a progress
    line every 30 s and one when it is read."""
    import time

    from hybridtron.data_pipeline.progress import duration, size
    from hybridtron.data_pipeline.tokenizer_sample import sample_texts

    t0 = time.monotonic()
    samples: list = []
    progress = Progress("tokenizer: sampling", cfg.tokenizer.sample_mb * 1e6, log)
    try:
        yield from sample_texts(cfg, reports, lambda n: progress.add(n, docs=1), samples)
    finally:
        progress.close()
    corpus = sum(s.starts[-1] for s in samples)
    files = sum(len(s.stamps) for s in samples)
    log(f"tokenizer: sampled {size(progress.bytes)} of {size(corpus)} ({progress.docs:,} documents from "
        f"{sum(len(s.files_read) for s in samples):,} of {files:,} files) in {duration(time.monotonic() - t0)}")


class _Guarded:
    """Keeps what a text iterator raised: SentencePiece's trainer re-raises it as a RuntimeError, and an empty
    corpus is otherwise reported as one (a reader that could not start read nothing: the real cause, not "no
    records")."""

    def __init__(self, texts: Iterator[str]):
        self.texts, self.error, self.chars = texts, None, 0

    def __iter__(self) -> Iterator[str]:
        try:
            for t in self.texts:
                self.chars += len(t)
                yield t
        except Exception as e:
            self.error = e
            raise


def _holds_tokenizer(tdir: Path, recipe: dict, fingerprint: str | None) -> bool:
    """Whether ``tdir`` holds the tokenizer ``recipe`` asks for (False: none yet). One made from anything else is
    refused, never replaced: it may be what another corpus's shards or a run's checkpoints were made with. A
    tokenizer whose content is known before it is made (pretrained, synthetic: ``fingerprint``) is compared by
    content; a trained one by its recipe."""
    meta = read_meta(tdir)
    if meta is None:
        return False
    had = meta.get("config") or {}
    if fingerprint is not None:
        same = meta.get("fingerprint") == fingerprint
    elif "sources" not in had:  # written by a version that recorded only kind, vocab_size and path, and compared those
        same = (had.get("kind"), had.get("vocab_size")) == (recipe["kind"], recipe["vocab_size"])
    else:
        same = had == recipe
    if not same:
        raise DataError(
            f"{tdir} holds a tokenizer made from {describe_recipe(had)}, but this config asks for one made from "
            f"{describe_recipe(recipe)}; leave data.out_dir unset (each corpus gets a directory of its own), choose "
            f"another data.out_dir, or delete {tdir.parent}"
        )
    return True


def get_tokenizer(cfg: DataConfig, out: Path, log: Callable = print) -> Tokenizer:
    """Reuse ``out/tokenizer`` when it was made for this config; otherwise train or load it and save it there."""
    tdir = out / "tokenizer"
    want = tokenizer_recipe(cfg)
    if _holds_tokenizer(tdir, want, want.get("sha256")):
        return load_tokenizer(tdir)
    t = cfg.tokenizer
    if t.kind == "pretrained":
        tok = load_tokenizer(t.path)
    else:
        import sys
        import time

        from hybridtron.data_pipeline.progress import duration

        if t.train_max_chars:  # only a directory whose tokenizer an older version trained so is read with it
            raise DataError(
                f"data.tokenizer.train_max_chars={t.train_max_chars} (train on the corpus's first characters) is "
                f"replaced by data.tokenizer.sample_mb (a sample spread over the whole corpus) and {tdir} holds no "
                f"tokenizer made so: set data.tokenizer.train_max_chars=0 and data.tokenizer.sample_mb="
                f"{t.train_max_chars / 1e6:g} to train one"
            )
        log(f"training {t.kind} tokenizer (vocab {t.vocab_size}) on a sample of {t.sample_mb:g} MB spread over the "
            f"corpus (data.tokenizer.sample_mb)")
        train = train_bpe if t.kind == "bpe" else train_sentencepiece
        reports: list = []
        texts = _Guarded(_training_texts(cfg, reports, log))
        t0 = time.monotonic()
        try:
            # tokenizers' own progress bars only on a terminal: a log file or SLURM output keeps the lines above
            tok = train(texts, t.vocab_size, show_progress=sys.stderr.isatty()) if t.kind == "bpe" else \
                train(texts, t.vocab_size)
        except Exception:
            if texts.error is not None:
                raise texts.error from None
            if texts.chars:
                raise
            tok = None  # SentencePiece refuses an empty corpus: reported below
        if texts.chars == 0:
            what = "; ".join(f"{r.source}: {r.summary() or 'no records'}" for r in reports)
            raise EmptySourceError(
                f"no text to train the tokenizer on: no source yields a document ({what}); point data.sources at "
                f"text files, or at jsonl/parquet records with a text field"
            )
        log(f"trained {t.kind} tokenizer (vocab {tok.vocab_size}) on {texts.chars / 1e6:.1f}M characters in "
            f"{duration(time.monotonic() - t0)} (sampling and training)")
    tok.save(tdir, config=want)
    return load_tokenizer(tdir)


def is_val(seed: int, doc_index: int, val_fraction: float) -> bool:
    h = hashlib.blake2b(struct.pack("<qq", seed, doc_index), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


def _source_key(cfg: DataConfig, i: int, fmt: str) -> str:
    s = cfg.sources[i]
    # how the shards are made from the files (the files themselves: inputs_digest and the manifest's `source`);
    # not `streaming` or `num_workers`, which must not change the result
    desc = {
        "format": fmt,
        "text_field": s.text_field,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "shard_docs": cfg.shard_docs,
        "shard_max_tokens": MAX_SHARD_TOKENS,
        "max_record_mb": cfg.max_record_mb,
        "piece_chars": PIECE_CHARS,
        "reader": READER_VERSION,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _inputs_digest(stamps: list[list]) -> str:
    return hashlib.blake2b(json.dumps(stamps).encode(), digest_size=16).hexdigest()


def _compare_inputs(recorded: list | None, stamps: list[list]) -> tuple[str | None, list | None]:
    """(what changed, None), or (None, refreshed records when files were only touched, else None)."""
    if recorded is None:
        return "its manifest records no source files", None
    rec = {r[0]: r for r in recorded}
    cur = {s[0]: s for s in stamps}
    for paths, what in (([p for p in cur if p not in rec], "added"), ([p for p in rec if p not in cur], "removed")):
        if paths:
            more = f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""
            return f"file {one_line(paths[0])} was {what}{more}", None
    refreshed, touched = [], False
    for path, size, mtime in stamps:
        old = rec[path]
        if old[1] != size:
            return f"file {one_line(path)} changed (size {old[1]:,} -> {size:,} bytes)", None
        if old[2] != mtime:
            if old[3] is None or file_hash(path) != old[3]:
                return f"file {one_line(path)} changed (same size, new mtime, content differs or was not hashed)", None
            touched = True  # touched, or rewritten with the same bytes
        refreshed.append([path, size, mtime, old[3]])
    return None, (refreshed if touched else None)


class _Doc:
    __slots__ = ("split", "parts")

    def __init__(self, split: str, skip: bool):
        self.split = split
        self.parts: list[np.ndarray] | None = None if skip else []


class _Sink:
    """Finished documents, in stream order, into the split writers. The last document is held back one step
    so that it can fill a split that no document drew: train is never empty, and val is non-empty whenever
    there are >= 2 documents, without knowing the count upfront (streaming). Documents already in committed
    shards (a resumed run) are counted, not written."""

    def __init__(self, writers: dict[str, SplitWriter], skip: dict[str, int], eos: int, dtype: np.dtype):
        self.writers, self.skip = writers, skip
        self.eos = np.array([eos], dtype=dtype)
        self.held: _Doc | None = None
        self.n = self.n_val = 0
        self.seen = dict.fromkeys(SPLITS, 0)

    def add(self, doc: _Doc) -> None:
        if self.held is not None:
            self._write(self.held, self.held.split)
        self.held = doc

    def close(self) -> None:
        doc, self.held = self.held, None
        if doc is None:
            return
        if self.n_val == self.n:  # no train document yet
            split = "train"
        elif self.n_val == 0:
            split = "val"
        else:
            split = doc.split
        self._write(doc, split)

    def _write(self, doc: _Doc, split: str) -> None:
        self.n += 1
        self.n_val += split == "val"
        self.seen[split] += 1
        if self.seen[split] <= self.skip[split]:
            return  # already in a committed shard
        if doc.parts is None:  # cannot happen: a skipped document is never the one moved to the other split
            raise RuntimeError(f"document {self.n - 1} was skipped as committed but is not in {split}'s shards")
        self.writers[split].add([*doc.parts, self.eos])


def source_changed(name: str, change: str, out: Path) -> SourceChangedError:
    return SourceChangedError(
        f"source {name!r}: {change} since its shards in {out / name} were prepared; restore it, or set "
        f"data.on_source_change=rebuild to re-tokenize this source (the tokenizer is kept; a resumed run "
        f"then reads other data), or use another data.out_dir"
    )


def _prepare_source(cfg: DataConfig, i: int, name: str, tok: Tokenizer, out: Path, log: Callable,
                    resolved: tuple[list[Path], str]) -> dict:
    """Shards for source ``i`` (or none, when complete and current) from its ``resolved`` files and format;
    returns its manifest's ``source`` record."""
    src = cfg.sources[i]
    files, fmt = resolved
    stamps = [file_stamp(f) for f in files]
    digest = _inputs_digest(stamps)
    key = _source_key(cfg, i, fmt)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(out / name / s, dtype, tok.fingerprint, key, cfg.shard_docs, digest, log=log)
               for s in SPLITS}
    if all(w.complete for w in writers.values()):
        recorded = writers["train"].manifest.get("source") or {}
        change, refreshed = _compare_inputs(recorded.get("files"), stamps)
        if change is None:
            if refreshed is not None:
                for w in writers.values():
                    w.save_source({**recorded, "files": refreshed}, digest)
            return recorded
        if cfg.on_source_change == "error":
            raise source_changed(name, change, out)
        log(f"{name}: {change}; rebuilding its shards (data.on_source_change=rebuild)")
        for w in writers.values():
            w.reset(digest)
    elif any(w.manifest.get("inputs_digest") != digest for w in writers.values()):
        log(f"{name}: source files changed since the interrupted prepare; starting this source over")
        for w in writers.values():
            w.reset(digest)
    skip = {s: w.docs_done for s, w in writers.items()}
    if any(skip.values()):
        log(f"{name}: resuming after {skip['train']} train / {skip['val']} val documents already in shards")
    sink = _Sink(writers, skip, tok.eos_id, dtype)
    n = 0
    by_hash = dict.fromkeys(SPLITS, 0)

    def begin() -> _Doc:
        nonlocal n
        split = "val" if is_val(cfg.seed, n, cfg.val_fraction) else "train"
        by_hash[split] += 1
        n += 1
        # the k-th document drawn for a split that already holds >= k is in a committed shard: reading it is
        # cheap, tokenizing is what we avoid
        return _Doc(split, skip=by_hash[split] <= skip[split])

    def drop(doc: _Doc) -> None:  # the document in progress turned out bad: its index is reused
        nonlocal n
        by_hash[doc.split] -= 1
        n -= 1

    log(f"{name}: tokenizing {len(files)} files ({fmt}) from {src.path}")
    progress = Progress(f"{name}: tokenizing", sum(s[1] for s in stamps), log)
    # parts.py, with more than one worker and more than one part; also with one worker where parts were planned (a
    # `submit prepare` job's plan, an interrupted parallel prepare): the complete ones are kept, and the shards are
    # the same bytes either way. One worker plans nothing (planning cuts big files: seeks and reads of their footers)
    planned = (out / name / PARTS_DIR / PLAN).is_file()
    ranges = plan_source(stamps, fmt, cfg.part_mb * 1e6) if planned or (cfg.workers or os.cpu_count() or 1) > 1 \
        else []
    try:
        if len(ranges) > 1 or planned:
            report = SourceReport(name, cfg.on_bad_record)
            for ids in part_documents(cfg, i, name, key, digest, stamps, fmt, ranges, out / "tokenizer", out, report,
                                      log, progress):
                doc = begin()
                if doc.parts is not None:
                    doc.parts.append(ids)
                sink.add(doc)
                progress.add(docs=1, tokens=len(ids))
        else:
            stream = SourceStream(src, cfg, out / ".hf_cache", resolved=(files, fmt), stamps=stamps, name=name)
            counted = [0]  # files of the stream's report already counted as read

            def done(doc: _Doc) -> None:
                sink.add(doc)
                read = stream.report.files
                progress.add(sum(f[1] for f in read[counted[0]:]), 1, sum(len(p) for p in doc.parts or ()))
                counted[0] = len(read)

            encode_documents(stream, tok, dtype, begin, done, drop)
            report = stream.report
    finally:
        progress.close()  # the bar, where there is one, ends before the lines below
    sink.close()
    report.check(cfg)  # too many malformed records, or no document: stop before marking anything complete
    source = report.to_json()
    for s in SPLITS:
        writers[s].finish(source)
    remove_parts(out, name)
    n_val = writers["val"].manifest["n_docs"]
    log(
        f"{name}: {report.documents:,} documents ({report.documents - n_val:,} train, {n_val:,} val) from "
        f"{len(files)} files" + (f"; {report.summary()}" if report.summary() else "")
    )
    return source


def _stats(out: Path, names: list[str]) -> dict:
    stats: dict = {s: {"docs": 0, "tokens": 0} for s in SPLITS}
    stats["by_source"] = {}
    stats["skipped"] = Counter()
    for name in names:
        per: dict = {}
        for s in SPLITS:
            m = read_manifest(out / name / s) or {"n_docs": 0, "n_tokens": 0}
            per[s] = {"docs": m["n_docs"], "tokens": m["n_tokens"]}
            stats[s]["docs"] += m["n_docs"]
            stats[s]["tokens"] += m["n_tokens"]
            if s == "train":
                per["skipped"] = dict((m.get("source") or {}).get("skipped", {}))
                stats["skipped"].update(per["skipped"])
        stats["by_source"][name] = per
    stats["skipped"] = dict(stats["skipped"])
    return stats


def _set_threads(cfg: DataConfig) -> None:
    n = cfg.num_workers or os.cpu_count() or 1
    # Rayon reads this once, when tokenizers first goes parallel in this process; an explicit user setting wins.
    os.environ.setdefault("RAYON_NUM_THREADS", str(n))
    # We never fork while tokenizing (SentencePiece uses threads too), so the tokenizers fork hazard does not
    # arise here; we leave TOKENIZERS_PARALLELISM to the user rather than flip it process-wide.


def prepare_synthetic(cfg: DataConfig, log: Callable = print) -> PreparedData:
    """The prepare step of a synthetic task: a word-level tokenizer of its symbols in data.out_dir/tokenizer (rows
    are generated when read, so there are no shards). Idempotent."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from hybridtron.data_pipeline.synthetic import task_symbols

    symbols = task_symbols(cfg.synthetic)
    out = data_dir(cfg)
    tok_dir = out / "tokenizer"
    hf = HFTokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<pad>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer("hf", hf.to_str().encode("utf-8"))
    if not _holds_tokenizer(tok_dir, tokenizer_recipe(cfg), tok.fingerprint):
        tok.save(tok_dir, tokenizer_recipe(cfg))
        log(f"synthetic task {cfg.synthetic.task}: {len(symbols)} symbols, tokenizer in {tok_dir}")
    tok = load_tokenizer(tok_dir)
    return PreparedData(out_dir=out, tokenizer=tok, tokenizer_dir=tok_dir, sources=[f"synthetic:{cfg.synthetic.task}"],
                        stats={"task": cfg.synthetic.task, "symbols": len(symbols)})


def prepare_data(cfg: DataConfig, log: Callable = print) -> PreparedData:
    """Train/load the tokenizer and write shards for every source. A re-run only finishes what is missing."""
    cfg.validate()
    out = data_dir(cfg)
    with hold_data_dir(out), new_dirs_removed_on_failure(out):  # one writer; bad input leaves no empty directory
        return _prepare(cfg, out, log)


def _prepare(cfg: DataConfig, out: Path, log: Callable) -> PreparedData:
    # a prepare killed midway left the temporary file of the write it was in: tokenizer, shard, manifest
    splits = [] if cfg.synthetic.task else [out / name / s for name in source_names(cfg) for s in SPLITS]
    reclaim_scratch(out, out / "tokenizer", *splits, log=log)
    if cfg.synthetic.task:  # a generated task: only its tokenizer (data_pipeline/synthetic.py)
        return prepare_synthetic(cfg, log)
    _set_threads(cfg)
    names = source_names(cfg)
    resolved = [resolve_files(src) for src in cfg.sources]  # a source that matches no file: said before any work
    out.mkdir(parents=True, exist_ok=True)
    tok = get_tokenizer(cfg, out, log)
    tok.num_threads = cfg.num_workers or tok.num_threads
    for i, name in enumerate(names):
        _prepare_source(cfg, i, name, tok, out, log, resolved[i])
    stats = _stats(out, names)
    write_text_atomic(out / "prepare_config.json", json.dumps(asdict(cfg), indent=2))
    for name, per in stats["by_source"].items():
        if per["val"]["docs"] == 0:
            log(
                f"warning: {name} has no validation document ({per['train']['docs']} in all): the train/val split is "
                f"per document (a text file is one), so add documents, e.g. several files or jsonl records"
            )
    skipped = ", ".join(f"{REASONS[r]}: {n}" for r, n in stats["skipped"].items())
    log(
        f"prepared {out}: train {stats['train']['docs']} docs / {stats['train']['tokens']:,} tokens, "
        f"val {stats['val']['docs']} docs / {stats['val']['tokens']:,} tokens"
        + (f"; skipped {skipped} (places: each source's train/manifest.json)" if skipped else "")
    )
    return PreparedData(out, tok, out / "tokenizer", names, stats)
