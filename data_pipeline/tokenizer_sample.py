"""The text a trained tokenizer (bpe, sentencepiece) learns from: a deterministic sample of about
``data.tokenizer.sample_mb`` MB spread over the whole corpus, read without reading the corpus.

Each source gets its weight's share of the budget (one big source cannot crowd out the rest). Its files are put in
an order drawn from a hash of (``data.seed``, the file's path relative to the source's files' common directory), so
the order is the same wherever the corpus is copied, and laid end to end; that span is cut into ``n`` equal strata
(``n`` about one per ``WINDOW_BYTES`` of budget) and the documents that start at the beginning of each stratum are
taken until the stratum's share of the budget is reached. So the sample is spread over many files, and through a
single huge jsonl or parquet file (a window starts mid-file: at the next line, or the row of that share of the
rows). A text file is one document: it is in the stratum where it starts. The last document of a window is cut
at the window's share; reading stops there, so the bytes read are the budget plus at most one piece per window,
whatever the corpus's size; only the file list and sizes are read for all files. A source smaller than its
share is read whole. Same config and same files: the same sample, so the same tokenizer bytes.

Bad records are skipped and counted in the source's report, or raised with ``data.on_bad_record: error``, as the
shard pass does (which also enforces ``data.max_malformed_fraction``). A document's pieces are passed on once it
ended well or filled its window (a file can turn out invalid halfway).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridtron.configs.job import DataConfig, SourceConfig
from hybridtron.data_pipeline import sources
from hybridtron.data_pipeline.sources import (
    PIECE_CHARS,
    READ_CHUNK,
    SNIFF_BYTES,
    SourceReport,
    _bad,
    _read_jsonl,
    _read_text,
    _record_rows,
    _skip_file,
    _text_of,
    binary_reason,
    file_stamp,
    resolve_files,
    source_name,
    split_pieces,
)

# Bump when what is sampled for the same config and files changes: it is part of the tokenizer's recipe
# (data_dir.tokenizer_recipe), so a directory holding a tokenizer of another sample is not taken for this one.
SAMPLE_VERSION = 1
WINDOW_BYTES = 1 << 20  # about this much of the budget per window (stratum); tests lower it
MAX_WINDOWS = 1024


def sample_budgets(cfg: DataConfig) -> list[int]:
    """Each source's share of ``sample_mb``, in UTF-8 bytes of text."""
    total_w = sum(s.weight for s in cfg.sources)
    return [int(cfg.tokenizer.sample_mb * 1e6 * s.weight / total_w) for s in cfg.sources]


def file_order(seed: int, files: list[Path]) -> list[int]:
    """Indices of ``files`` in the order drawn from (seed, path relative to their common directory)."""
    strs = [os.path.abspath(f) for f in files]
    root = os.path.dirname(strs[0]) if len(strs) == 1 else os.path.commonpath(strs)

    def key(i: int) -> bytes:
        rel = os.path.relpath(strs[i], root).encode("utf-8", "surrogateescape")
        return hashlib.blake2b(struct.pack("<q", seed) + rel, digest_size=16).digest()

    return sorted(range(len(files)), key=key)


def _is_url(path: object) -> bool:
    remote = getattr(sources, "remote", None)  # sources at URLs (remote.py), where this version has them
    return remote is not None and remote.is_url(path)


def _open(path: str):
    opener = getattr(sources, "open_source_file", None)
    return opener(path) if opener is not None else open(path, "rb")


def _jsonl_from(stamp: list, offset: int, field_name: str, piece_chars: int, max_bytes: int) -> Iterator[tuple]:
    """(byte position of the record, row) for the records of a jsonl file whose line starts at or after
    ``offset``: a window starting mid-file begins at the next line."""
    path = stamp[0]
    with _open(path) as fh:
        fh.seek(max(offset - 1, 0))
        # is it binary: the bytes where this window reads (a window of a big file never reads its start)
        why = binary_reason(fh.read(SNIFF_BYTES))
        if why:
            for row in _skip_file(stamp, "binary_file", path, why):
                yield 0, row
            return
        fh.seek(max(offset - 1, 0))
        if offset > 0:  # the rest of the line that holds byte offset - 1 (bounded reads)
            while (rest := fh.readline(READ_CHUNK)) and not rest.endswith(b"\n"):
                pass
        while True:
            pos = fh.tell()
            raw = fh.readline(max_bytes + 1)
            if not raw:
                return
            where = f"{path} byte {pos}"
            if len(raw) > max_bytes and not raw.endswith(b"\n"):
                while (rest := fh.readline(READ_CHUNK)) and not rest.endswith(b"\n"):
                    pass
                yield pos, _bad("too_large", where, f"a line over data.max_record_mb={max_bytes >> 20}")
                continue
            if pos == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield pos, _bad("invalid_utf8", where, f"invalid UTF-8 at byte {e.start} of the line: {e.reason}")
                continue
            except (ValueError, RecursionError) as e:
                yield pos, _bad("malformed_json", where, f"not valid JSON: {getattr(e, 'msg', str(e)[:200])}")
                continue
            for row in _record_rows(obj, where, field_name, piece_chars, max_bytes):
                yield pos, row


def _parquet_from(stamp: list, offset: int, field_name: str, piece_chars: int, max_bytes: int) -> Iterator[tuple]:
    """(position, row) for the rows of a parquet file from the row group holding ``offset``'s share of its rows
    on; a row's position is its share of the rows times the file's size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, size = stamp[0], max(stamp[1], 1)
    try:
        pf = pq.ParquetFile(_open(path) if _is_url(path) else path, buffer_size=READ_CHUNK)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        for row in _skip_file(stamp, "unreadable_file", path, f"not a readable Parquet file ({str(e)[:200]})"):
            yield 0, row
        return
    meta = pf.metadata
    n_rows = max(meta.num_rows, 1)
    if field_name not in schema.names:
        for row in _skip_file(stamp, "missing_text", path, f"no column {field_name!r}", meta.num_rows):
            yield 0, row
        return
    starts = [0]
    for g in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(g).num_rows)
    first = min(bisect.bisect_right(starts, offset * n_rows // size) - 1, meta.num_row_groups)
    row = starts[first]
    try:
        for batch in pf.iter_batches(batch_size=64, columns=[field_name], row_groups=range(first, meta.num_row_groups)):
            col = batch.column(0)
            if pa.types.is_dictionary(col.type):
                col = col.dictionary_decode()
            for value in col.to_pylist():
                where, pos = f"{path} row {row}", row * size // n_rows
                row += 1
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError as e:
                        yield pos, _bad("invalid_utf8", where, f"invalid UTF-8 at byte {e.start}: {e.reason}")
                        continue
                text, bad = _text_of(value, where, field_name, max_bytes)
                if bad is not None:
                    yield pos, bad
                    continue
                pieces = list(split_pieces(text, piece_chars)) if len(text) > piece_chars else [text]
                for j, p in enumerate(pieces):
                    yield pos, {"text": p, "end": j == len(pieces) - 1, "event": ""}
    except (pa.ArrowException, OSError) as e:
        for r in _skip_file(stamp, "unreadable_file", f"{path} row {row}", f"cannot read further ({str(e)[:200]})"):
            yield row * size // n_rows, r


def _records(stamp: list, offset: int, fmt: str, field_name: str, piece_chars: int, max_bytes: int) -> Iterator[tuple]:
    path = stamp[0]
    try:
        if fmt == "text" or (fmt == "jsonl" and path.lower().endswith(".json")):
            # one document (a .json array is parsed whole, as the shard pass does): it belongs to the window
            # where the file starts
            if offset == 0:
                reader = _read_text if fmt == "text" else _read_jsonl
                args = (field_name,) if fmt == "jsonl" else ()
                for row in reader(stamp, *args, piece_chars, max_bytes):
                    yield 0, row
        elif fmt == "jsonl":
            yield from _jsonl_from(stamp, offset, field_name, piece_chars, max_bytes)
        else:
            yield from _parquet_from(stamp, offset, field_name, piece_chars, max_bytes)
    except OSError as e:
        if _is_url(path):  # a network failure stops prepare naming the URL (sources.py), never skipped
            raise
        for row in _skip_file(stamp, "unreadable_file", path, f"cannot read it: {e.strerror or e}"):
            yield 0, row


class SourceSample:
    """The sampled documents of one source, as text pieces; ``report`` counts what was read and skipped."""

    def __init__(self, src: SourceConfig, cfg: DataConfig, budget: int, resolved: tuple[list[Path], str] | None = None,
                 on_bytes: Callable[[int], object] | None = None):
        self.src, self.cfg, self.budget = src, cfg, budget
        files, self.fmt = resolved or resolve_files(src)
        stamps = [file_stamp(f) for f in files]
        self.stamps = [stamps[i] for i in file_order(cfg.seed, files)]
        self.starts = [0]
        for s in self.stamps:
            self.starts.append(self.starts[-1] + s[1])
        self.report = SourceReport(source_name(src), cfg.on_bad_record)
        self.on_bytes = on_bytes or (lambda n: None)
        self.bytes = self.docs = 0
        self.files_read: set[str] = set()

    def windows(self) -> list[tuple[int, int, int]]:
        """(first byte, end byte, budget) of each window over the files laid end to end."""
        total = self.starts[-1]
        if total <= self.budget:
            return [(0, total + 1, self.budget)]  # every file, empty ones too
        n = max(1, min(MAX_WINDOWS, round(self.budget / WINDOW_BYTES)))
        cuts = [total * k // n for k in range(n + 1)]
        return [(cuts[k], cuts[k + 1], self.budget * (k + 1) // n - self.budget * k // n) for k in range(n)]

    def __iter__(self) -> Iterator[str]:
        for start, end, quota in self.windows():
            yield from self._window(start, end, quota)

    def _window(self, start: int, end: int, quota: int) -> Iterator[str]:
        """The documents that start in [start, end) of the files laid end to end, up to ``quota`` bytes."""
        report, max_bytes = self.report, self.cfg.max_record_mb << 20
        first = bisect.bisect_left(self.starts, start)  # from the first file (empty ones too) starting at `start`,
        if first == len(self.starts) or self.starts[first] != start:  # else from the file holding it
            first -= 1
        taken = 0
        for i in range(first, len(self.stamps)):
            if self.starts[i] >= end or taken >= quota:
                return
            stamp = self.stamps[i]
            offset = start - self.starts[i] if i == first else 0
            doc: list[str] = []
            size = 0
            records = _records(stamp, offset, self.fmt, self.src.text_field, PIECE_CHARS, max_bytes)
            try:
                for pos, row in records:
                    if row["event"]:
                        e = json.loads(row["event"])
                        if "bad" in e:  # the document in progress (if any) turned out bad
                            doc, size = [], 0
                            report.add_bad(e["bad"], e["where"], e["detail"], e["n"])
                        continue
                    if not doc and self.starts[i] + pos >= end:
                        return  # the next window's documents
                    text = row["text"]
                    n = len(text.encode("utf-8", "surrogatepass"))
                    room = quota - taken - size
                    if n >= room:  # the window is full: this document ends here, and reading too
                        if n > room:
                            text = text.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")
                        doc.append(text)
                        yield from self._emit(stamp, doc, size + room)
                        return
                    doc.append(text)
                    size += n
                    if row["end"]:
                        taken += size
                        yield from self._emit(stamp, doc, size)
                        doc, size = [], 0
            finally:
                records.close()

    def _emit(self, stamp: list, doc: list[str], size: int) -> Iterator[str]:
        self.docs += 1
        self.report.documents += 1
        self.report.records += 1
        self.bytes += size
        self.files_read.add(stamp[0])
        self.on_bytes(size)
        yield from doc


def sample_texts(cfg: DataConfig, reports: list, on_bytes: Callable[[int], object] | None = None,
                 samples: list | None = None) -> Iterator[str]:
    """The tokenizer's training text: every source's sample in turn (``reports`` gets each source's report,
    ``samples`` each ``SourceSample``)."""
    for src, budget in zip(cfg.sources, sample_budgets(cfg), strict=True):
        sample = SourceSample(src, cfg, budget, on_bytes=on_bytes)
        reports.append(sample.report)
        if samples is not None:
            samples.append(sample)
        yield from sample
