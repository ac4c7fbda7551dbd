"""Sources: resolve a ``SourceConfig`` to a sorted file list and stream its documents, checked, through HF ``datasets``.

One document is one record: a whole file for text sources, one line for jsonl, one row for parquet. A source at
a URL (``https://``, ``s3://``, ...) is listed, stamped and opened through remote.py and read by the same readers.

Our own readers (run as a ``datasets`` generator: streaming, or through an Arrow cache) decide what is a
document and what is a *bad record* (docs/data.md is the policy):

- ``binary_file``: a text/jsonl file with a NUL byte, a compression magic, or > 30% control bytes or invalid
  UTF-8 in its first 8 KiB; ``empty``: an empty text; ``missing_text``: a record without the text field (or
  null). These are skipped and counted, never a reason to stop under ``on_bad_record: skip``.
- *malformed*: ``invalid_utf8``, ``lone_surrogate`` (a JSON ``\\ud800`` escape), ``malformed_json``,
  ``not_string`` (a list, number, object as text), ``too_large`` (over ``data.max_record_mb``),
  ``unreadable_file``. Skipped and counted; above ``data.max_malformed_fraction`` of the records, prepare stops.

Bounded memory: a text file is read in 1 MiB chunks and a document longer than ``PIECE_CHARS`` is cut into
pieces of at most that many characters before the tokenizer, at places where the pre-tokenizer splits anyway
(see ``find_cut``), so the tokens are the same as for the whole text; shorter documents are one piece, as
before. jsonl lines and parquet cells are parsed whole, which ``max_record_mb`` bounds.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import io
import json
import os
import re
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hybridtron.configs.job import DataConfig, SourceConfig
from hybridtron.data_pipeline import remote
from hybridtron.data_pipeline.errors import (
    BadRecordError,
    DataError,
    DataNotFoundError,
    EmptySourceError,
    MissingColumnError,
    TooManyBadRecordsError,
    UnreadableFileError,
    one_line,
)

_EXT_FORMAT = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}

# Documents longer than this are encoded in pieces of at most this many characters: the tokenizer's working
# memory is ~40-170 bytes per character of the text it is given at once (a 50 MB line took 7-9 GB).
PIECE_CHARS = 1 << 18
READ_CHUNK = 1 << 20  # bytes read from a text file at a time
SNIFF_BYTES = 8192  # binary detection looks at this much of a file's start
BINARY_RATIO = 0.30  # share of control bytes / invalid UTF-8 in the sniffed bytes above which a file is binary
READER_VERSION = 2  # bump when what the readers emit changes: it keys the Arrow cache and the shard manifests

BENIGN = ("binary_file", "empty", "missing_text")
MALFORMED = ("invalid_utf8", "lone_surrogate", "malformed_json", "not_string", "too_large", "unreadable_file")
REASONS = {
    "binary_file": "binary files",
    "empty": "empty texts",
    "missing_text": "records without the text field (or null)",
    "invalid_utf8": "invalid UTF-8",
    "lone_surrogate": "lone surrogate escapes",
    "malformed_json": "malformed JSON",
    "not_string": "non-string texts",
    "too_large": "records over data.max_record_mb",
    "unreadable_file": "unreadable files",
}
N_EXAMPLES = 3  # places kept per reason for the summary and the manifest

# C0 controls other than \b \t \n \v \f \r and ESC (ANSI colours in logs), plus DEL
_CONTROL = bytes([*range(0, 8), *range(14, 27), *range(28, 32), 127])
_MAGIC = {
    b"\x1f\x8b": "gzip-compressed; decompress it first",
    b"\x28\xb5\x2f\xfd": "zstd-compressed; decompress it first",
    b"\xfd7zXZ\x00": "xz-compressed; decompress it first",
    b"PK\x03\x04": "a zip archive; extract it first",
    b"PAR1": "a Parquet file; give it a .parquet name or set format: parquet",
}
_SURROGATE = re.compile("[\ud800-\udfff]")
_LETTER_DIGIT = re.compile("[A-Za-z][0-9]|[0-9][A-Za-z]")


def offline_env() -> None:
    """Never reach for the Hub: sources are local and the machines may have no network."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def source_name(src: SourceConfig) -> str:
    if src.name:
        return src.name
    if src.path == "stdlib":
        return "stdlib"
    # the path without glob characters and extension, made filesystem-safe
    stem = Path(re.sub(r"[*?\[\]]", "", src.path).rstrip("/")).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "source"


def _stdlib_files() -> list[Path]:
    root = sysconfig.get_paths()["stdlib"]
    # prune while walking: site-packages usually sits inside stdlib and can be 20x larger than it
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in skip]
        files.extend(Path(d, n) for n in names if n.endswith(".py"))
    return sorted(f for f in files if f.is_file())


def _format_of(path: Path | str) -> str:
    suffix = remote.url_suffix(path) if remote.is_url(path) else path.suffix
    return _EXT_FORMAT.get(suffix.lower(), "text")


def resolve_files(src: SourceConfig) -> tuple[list[Path | str], str]:
    """(sorted files, format). Sorting makes document order, hence the split and shards, reproducible.
    A source at a URL (remote.py) gives its files as URL strings."""
    try:
        return _resolve_files(src)
    except OSError as e:  # an unreadable directory on the way
        if isinstance(e, DataError):
            raise
        where = one_line(e.filename or src.path)
        raise UnreadableFileError(f"cannot list source {src.path!r}: {where}: {e.strerror or e}; fix its permissions") from None


def _resolve_files(src: SourceConfig) -> tuple[list[Path | str], str]:
    if src.path == "stdlib":
        files, fmt = _stdlib_files(), "text"
    else:
        if remote.is_url(src.path):
            files, is_dir = remote.list_files(src.path)
        else:
            p = Path(src.path).expanduser()
            is_dir = p.is_dir()
            if p.is_file():
                files = [p]
            elif is_dir:
                files = sorted(f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.parts))
            else:
                files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if src.format != "auto" and src.format != "text" and is_dir:
            # a directory often holds a README beside the data; keep only files of the asked format
            files = [f for f in files if _format_of(f) == src.format]
        fmt = src.format
        if fmt == "auto" and files:
            found = sorted({_format_of(f) for f in files})
            if len(found) > 1:
                raise DataError(
                    f"source {src.path!r} mixes formats {found}; set format explicitly or point at one kind of file"
                )
            fmt = found[0]
    if src.max_files:
        files = files[: src.max_files]
    if not files:
        raise DataNotFoundError(
            f"source path {src.path!r} matches no files (format={src.format}); give an existing file, directory or glob"
        )
    return files, fmt


def file_stamp(f: Path | str) -> list:
    """[path, size, mtime_ns]: what the shard manifests record of each source file, with its content hash.
    A remote file's: [url, size, version] (remote.stamp), compared the same way."""
    if remote.is_url(f):
        return remote.stamp(f)
    try:
        st = f.stat()
    except OSError as e:
        raise UnreadableFileError(f"cannot read {one_line(f)}: {e.strerror}; fix it or remove it from the source") from None
    return [str(f), st.st_size, st.st_mtime_ns]


def file_hash(f: str | Path, stop=None) -> str | None:
    """The blake2b of the file's bytes, as the manifests record it; None when ``stop()`` said to give up."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open_source_file(f) as fh:
            while chunk := fh.read(READ_CHUNK):
                if stop is not None and stop():
                    return None
                h.update(chunk)
    except Exception as e:
        if remote.is_url(f) and not isinstance(e, DataError):
            raise remote.remote_error(str(f), e) from None
        raise
    return h.hexdigest()


def open_source_file(path: str | Path):
    """A source file opened for binary reading: a local one with ``open``, a URL through fsspec (remote.py)."""
    return remote.open_file(path) if remote.is_url(path) else open(path, "rb")


# ---- cutting long texts ---------------------------------------------------------------------------------------
def find_cut(s: str, limit: int) -> int:
    """Where to end the first piece of ``s`` (longer than ``limit``): a position in (limit/2, limit].

    In order of preference, the last place in that window that is
    1. just after a newline between two non-space characters (``x\ny``),
    2. just before a space between two non-space characters (``x y``),
    3. between an ASCII letter and an ASCII digit (``a1`` / ``1a``),
    4. just before the last space of a whitespace run that a non-space follows (``x\n   y``),
    5. otherwise ``limit`` itself (none of these in 128 Ki characters: not prose or code).
    Byte-level BPE pre-tokenizers (GPT-2 and Llama-3 style regexes; the default ``bpe`` here) end a pre-token
    at 1-4 whatever surrounds them, and BPE never merges across pre-tokens, so encoding the pieces gives the
    same ids as encoding the whole text. SentencePiece words start at a space and ours never merge across a
    newline or a letter/digit change, so 1-3 are exact for it too (4 is not: it groups whitespace runs).
    Tested on the standard library, base64 and whitespace-heavy text; only a forced cut (5) can change the
    tokens next to it.
    """
    lo = limit // 2
    p = s.rfind("\n", lo, limit)
    while p > lo:
        if not s[p - 1].isspace() and not s[p + 1].isspace():
            return p + 1
        p = s.rfind("\n", lo, p)
    run_end = -1
    p = s.rfind(" ", lo, limit)
    while p > lo:
        if not s[p + 1].isspace():
            if not s[p - 1].isspace():
                return p
            run_end = max(run_end, p)
        p = s.rfind(" ", lo, p)
    m = _LETTER_DIGIT.search(s[lo:limit][::-1])  # the pair closest to the window's end
    if m is not None and limit - 1 - m.start() > lo:
        return limit - 1 - m.start()
    return run_end if run_end > lo else limit


def split_pieces(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``limit`` characters (one piece when it is no longer than that)."""
    start = 0
    while len(text) - start > limit:
        cut = start + find_cut(text[start : start + limit + 1], limit)
        yield text[start:cut]
        start = cut
    yield text[start:]


# ---- readers: rows of (text, end, event) ------------------------------------------------------------------------
def _piece(text: str, end: bool) -> dict:
    return {"text": text, "end": end, "event": ""}


def _bad(reason: str, where: str, detail: str, n: int = 1) -> dict:
    ev = {"bad": reason, "where": one_line(where), "detail": one_line(detail), "n": n}
    return {"text": "", "end": False, "event": json.dumps(ev)}


def _file_done(stamp: list, digest: str | None) -> dict:
    return {"text": "", "end": False, "event": json.dumps({"file": [*stamp, digest]})}


def _piece_done(lines: int) -> dict:
    """The end of a piece of a file (parts.py cuts big files), read to its end: the file is not done (no stamp,
    no digest: the parent hashes the whole file), and ``lines`` is how many lines the piece held."""
    return {"text": "", "end": False, "event": json.dumps({"piece_lines": lines})}


def piece_where(path: str, line: int, start: int) -> str:
    """A jsonl line's place in a piece that starts at byte ``start`` > 0 of its file: a worker cannot know the lines
    before it, so the number counts from the piece's start and the parent rebases it (``rebase_where``)."""
    return f"{path} line +{line} (from byte {start})"


def rebase_where(text: str, path: str, start: int, lines_before: int) -> str:
    """``text`` (a bad record's place, or a message that starts with it) with a piece's relative line number
    (``piece_where``) made the line number in the whole file."""
    head = f"{one_line(path)} line +"
    if not text.startswith(head):
        return text
    digits = text[len(head):].split(" ", 1)[0]
    tail = f" (from byte {start})"
    rest = text[len(head) + len(digits):]
    if not digits.isdigit() or not rest.startswith(tail):
        return text
    return f"{one_line(path)} line {lines_before + int(digits)}{rest[len(tail):]}"


def _skip_file(stamp: list, reason: str, where: str, detail: str, n: int = 1) -> tuple[dict, dict]:
    """A file given up on: its bad-record count, then its stamp without a digest (nothing of it was kept)."""
    return _bad(reason, where, detail, n), _file_done(stamp, None)


def binary_reason(head: bytes) -> str | None:
    """Why the first bytes of a file say it is not text, or None."""
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return what
    sample = head[:SNIFF_BYTES]
    if b"\0" in sample:
        return "NUL bytes in its first 8 KiB (binary, or UTF-16/32 text)"
    if not sample:
        return None
    # replacement characters (invalid UTF-8) plus control bytes; a multi-byte character cut by the sample's end is
    # not counted (final=False keeps it pending)
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(sample, final=False)
    odd = text.count("\ufffd") + len(sample) - len(sample.translate(None, _CONTROL))
    if odd > BINARY_RATIO * len(sample):
        return f"not text: {odd / len(sample):.0%} of its first 8 KiB are control bytes or invalid UTF-8"
    return None


def _check_unchanged(fh, stamp: list) -> None:
    if remote.is_url(stamp[0]):
        remote.check_unchanged(fh, stamp)
        return
    st = os.fstat(fh.fileno())
    if (st.st_size, st.st_mtime_ns) != (stamp[1], stamp[2]):
        raise UnreadableFileError(
            f"{one_line(stamp[0])} changed while prepare was reading it (size {stamp[1]} -> {st.st_size} bytes); "
            f"re-run `hybridtron prepare` once it is written"
        )


def _read_text(stamp: list, piece_chars: int, max_bytes: int) -> Iterator[dict]:
    """One document per file, streamed in pieces; universal newlines (as ``open()`` and datasets read text)."""
    path, size = stamp[0], stamp[1]
    if size == 0:
        yield _bad("empty", path, "empty file")
        yield _file_done(stamp, file_hash(path))
        return
    if size > max_bytes:
        yield from _skip_file(stamp, "too_large", path, f"{size:,} bytes, above data.max_record_mb={max_bytes >> 20}")
        return
    h = hashlib.blake2b(digest_size=16)
    with open_source_file(path) as fh:
        chunk = fh.read(READ_CHUNK)
        why = binary_reason(chunk)
        if why:
            yield from _skip_file(stamp, "binary_file", path, why)
            return
        utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        dec = io.IncrementalNewlineDecoder(utf8, translate=True)
        buf, offset, line = "", 0, 1
        while True:
            h.update(chunk)
            pending = len(utf8.getstate()[0])
            try:
                buf += dec.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                pos = offset - pending + e.start
                line_at = line + chunk[: max(0, e.start - pending)].count(b"\n")
                yield from _skip_file(stamp, "invalid_utf8", path,
                                      f"invalid UTF-8 at line {line_at} (byte {pos:,}): {e.reason}")
                return
            while len(buf) > piece_chars:
                cut = find_cut(buf[: piece_chars + 1], piece_chars)
                yield _piece(buf[:cut], False)
                buf = buf[cut:]
            if not chunk:
                break
            offset += len(chunk)
            line += chunk.count(b"\n")
            chunk = fh.read(READ_CHUNK)
        _check_unchanged(fh, stamp)
    yield _piece(buf, True)
    yield _file_done(stamp, h.hexdigest())


def _text_of(value, where: str, field_name: str, max_bytes: int) -> tuple[str | None, dict | None]:
    """(text, None) for a usable text value, else (None, bad-record row)."""
    if value is None:
        return None, _bad("missing_text", where, f"text field {field_name!r} is null")
    if not isinstance(value, str):
        kind = type(value).__name__
        return None, _bad("not_string", where, f"text field {field_name!r} holds a {kind}, not a string")
    if not value:
        return None, _bad("empty", where, "empty text")
    if len(value) > max_bytes // 4 and len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        return None, _bad("too_large", where, f"text of {len(value):,} characters, above data.max_record_mb")
    m = _SURROGATE.search(value)
    if m:
        return None, _bad(
            "lone_surrogate", where, f"text holds a lone surrogate \\u{ord(m.group()):04x} at character {m.start()}"
        )
    return value, None


def _record_rows(obj, where: str, field_name: str, piece_chars: int, max_bytes: int) -> Iterator[dict]:
    if not isinstance(obj, dict):
        yield _bad("malformed_json", where, f"a JSON {type(obj).__name__}, not an object")
        return
    if field_name not in obj:
        keys = ", ".join(list(obj)[:8])
        yield _bad("missing_text", where, f"no field {field_name!r} (fields: {keys})")
        return
    text, bad = _text_of(obj[field_name], where, field_name, max_bytes)
    if bad is not None:
        yield bad
        return
    pieces = split_pieces(text, piece_chars)
    prev = next(pieces)
    for p in pieces:
        yield _piece(prev, False)
        prev = p
    yield _piece(prev, True)


def _read_jsonl(stamp: list, field_name: str, piece_chars: int, max_bytes: int,
                piece: list | None = None) -> Iterator[dict]:
    """One document per line; blank lines are not records. A ``.json`` file holding one array: one per element.
    ``piece`` [start, end): only the lines that start in those bytes (start and end are line starts, parts.py)."""
    path = stamp[0]
    start, end = piece or (0, None)
    h = hashlib.blake2b(digest_size=16)
    with open_source_file(path) as fh:
        head = fh.read(SNIFF_BYTES)
        why = binary_reason(head)
        if why:
            if start == 0:
                yield from _skip_file(stamp, "binary_file", path, why)
            else:  # the file's first piece reports it; the parent drops the file's later pieces
                yield _file_done(stamp, None)
            return
        fh.seek(start)
        if piece is None and head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[") and path.lower().endswith(".json"):
            yield from _read_json_array(fh, stamp, field_name, piece_chars, max_bytes)
            return
        n, pos = 0, start
        while (end is None or pos < end) and (raw := fh.readline(max_bytes + 1)):
            n += 1
            pos += len(raw)
            if piece is None:
                h.update(raw)
            where = f"{path} line {n}" if start == 0 else piece_where(path, n, start)
            if len(raw) > max_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while rest := fh.readline(READ_CHUNK):  # skip the rest of the line in bounded reads
                    if piece is None:
                        h.update(rest)
                    size += len(rest)
                    if rest.endswith(b"\n"):
                        break
                pos += size - len(raw)
                yield _bad("too_large", where, f"a line of {size:,} bytes, above data.max_record_mb={max_bytes >> 20}")
                continue
            if n == 1 and start == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte order mark
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield _bad("invalid_utf8", where, f"invalid UTF-8 at byte {e.start} of the line: {e.reason}")
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:
                msg = f"{e.msg} (column {e.colno})" if isinstance(e, json.JSONDecodeError) else str(e)[:200]
                yield _bad("malformed_json", where, f"not valid JSON: {msg}")
                continue
            yield from _record_rows(obj, where, field_name, piece_chars, max_bytes)
        _check_unchanged(fh, stamp)
    yield _piece_done(n) if piece is not None else _file_done(stamp, h.hexdigest())


def _read_json_array(fh, stamp: list, field_name: str, piece_chars: int, max_bytes: int) -> Iterator[dict]:
    path = stamp[0]
    if stamp[1] > max_bytes:
        # an array is parsed whole: bound it like any record
        yield from _skip_file(stamp, "too_large", path,
                              f"a JSON array of {stamp[1]:,} bytes, above data.max_record_mb; write it as jsonl")
        return
    raw = fh.read()
    _check_unchanged(fh, stamp)
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    try:
        arr = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        yield _bad("invalid_utf8", path, f"invalid UTF-8 at byte {e.start}: {e.reason}")
        yield _file_done(stamp, digest)
        return
    except (ValueError, RecursionError) as e:
        where = f"{path} line {e.lineno}" if isinstance(e, json.JSONDecodeError) else path
        yield _bad("malformed_json", where, f"not valid JSON: {getattr(e, 'msg', str(e)[:200])}")
        yield _file_done(stamp, digest)
        return
    del raw
    if not isinstance(arr, list):
        yield _bad("malformed_json", path, f"a JSON {type(arr).__name__}, not an array or one object per line")
    else:
        for i, obj in enumerate(arr):
            yield from _record_rows(obj, f"{path} element {i}", field_name, piece_chars, max_bytes)
    yield _file_done(stamp, digest)


def _read_parquet(stamp: list, field_name: str, piece_chars: int, max_bytes: int,
                  piece: list | None = None) -> Iterator[dict]:
    """One document per row of the text column, read 64 rows at a time; ``piece`` [first, end): only those row
    groups (parts.py)."""
    if remote.is_url(stamp[0]):  # pyarrow reads the fsspec file object (ranged reads of the footer and columns)
        with remote.open_file(stamp[0]) as fh:
            yield from _parquet_rows(stamp, fh, field_name, piece_chars, max_bytes, piece)
    else:
        yield from _parquet_rows(stamp, None, field_name, piece_chars, max_bytes, piece)


def _parquet_rows(stamp: list, fh, field_name: str, piece_chars: int, max_bytes: int,
                  piece: list | None = None) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = stamp[0]
    try:
        pf = pq.ParquetFile(path if fh is None else fh, buffer_size=READ_CHUNK)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        if fh is not None and not isinstance(e, pa.ArrowException):
            raise  # a network failure: _read_files stops with it rather than skip the file
        yield from _skip_file(stamp, "unreadable_file", path, f"not a readable Parquet file ({str(e)[:200]})")
        return
    n_rows = pf.metadata.num_rows
    if field_name not in schema.names:
        yield from _skip_file(stamp, "missing_text", path,
                              f"no column {field_name!r} (columns: {', '.join(schema.names[:8])})", n_rows)
        return
    t = schema.field(field_name).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    as_bytes = pa.types.is_binary(t) or pa.types.is_large_binary(t)
    if not (as_bytes or pa.types.is_string(t) or pa.types.is_large_string(t)):
        if n_rows:
            yield _bad("not_string", f"{path} row 0", f"column {field_name!r} holds {t}, not strings", n_rows)
        yield _file_done(stamp, None)
        return
    groups = range(*piece) if piece is not None else None
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece[0])) if piece is not None else 0
    try:
        for batch in pf.iter_batches(batch_size=64, columns=[field_name], row_groups=groups):
            col = batch.column(0)
            if pa.types.is_dictionary(col.type):
                col = col.dictionary_decode()
            sizes = pc.binary_length(col).to_pylist()
            # whole-batch conversion unless a value is too large to copy into Python
            values = col.to_pylist() if max((z or 0 for z in sizes), default=0) <= max_bytes else None
            for i, size in enumerate(sizes):
                where = f"{path} row {row + i}"
                if size is not None and size > max_bytes:
                    yield _bad("too_large", where, f"a value of {size:,} bytes, above data.max_record_mb")
                    continue
                value = values[i] if values is not None else col[i].as_py()
                if as_bytes and value is not None:
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError as e:
                        yield _bad("invalid_utf8", where, f"invalid UTF-8 at byte {e.start}: {e.reason}")
                        continue
                text, bad = _text_of(value, where, field_name, max_bytes)
                if bad is not None:
                    yield bad
                    continue
                pieces = list(split_pieces(text, piece_chars)) if len(text) > piece_chars else [text]
                for j, p in enumerate(pieces):
                    yield _piece(p, j == len(pieces) - 1)
            row += len(sizes)
    except (pa.ArrowException, OSError) as e:
        if fh is not None and not isinstance(e, pa.ArrowException):
            raise
        yield from _skip_file(stamp, "unreadable_file", f"{path} row {row}", f"cannot read further ({str(e)[:200]})")
        return
    if fh is not None:
        _check_unchanged(fh, stamp)
    else:
        with open(path, "rb") as fh:
            _check_unchanged(fh, stamp)
    yield _piece_done(0) if piece is not None else _file_done(stamp, file_hash(path))


def _read_files(
    files: list[str], stamps: list[list], fmt: str, text_field: str, piece_chars: int, max_bytes: int, version: int,
    pieces: list | None = None,
) -> Iterator[dict]:
    """The generator behind the dataset; ``files``, ``stamps`` and ``pieces`` are parallel lists (datasets shards
    them). ``stamps`` and ``version`` are arguments so that they key datasets' Arrow cache. A piece is None (the
    whole file) or the part of a cut file to read (parts.py): [start, end) bytes of jsonl, row groups of parquet."""
    for j, stamp in enumerate(stamps):
        path = stamp[0]
        piece = pieces[j] if pieces is not None else None
        try:
            if fmt == "text":
                yield from _read_text(stamp, piece_chars, max_bytes)
            elif fmt == "jsonl":
                yield from _read_jsonl(stamp, text_field, piece_chars, max_bytes, piece)
            else:
                yield from _read_parquet(stamp, text_field, piece_chars, max_bytes, piece)
        except DataError:
            raise
        except Exception as e:
            if remote.is_url(path):  # unreachable, gone, denied: stop naming it, never skip it as a bad record
                raise remote.remote_error(path, e) from None
            if not isinstance(e, OSError):
                raise
            # permission denied, a file removed since the listing, a read error
            yield from _skip_file(stamp, "unreadable_file", path, f"cannot read it: {e.strerror or e}")


# ---- the report ---------------------------------------------------------------------------------------------------
@dataclass
class SourceReport:
    """What a pass over a source kept and skipped; it goes to the prepare summary and the shard manifests."""

    source: str
    on_bad_record: str = "skip"
    documents: int = 0
    records: int = 0  # documents + skipped records
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    files: list = field(default_factory=list)  # [path, size, mtime_ns, blake2b or None] per file read

    def add_bad(self, reason: str, where: str, detail: str, n: int = 1) -> None:
        if self.on_bad_record == "error" and reason != "empty":
            raise BadRecordError(
                f"{where}: {detail} ({REASONS[reason]}, source {self.source!r}); fix or remove it, or set "
                f"data.on_bad_record=skip to skip such records with a count"
            )
        self.skipped[reason] += n
        self.records += n
        ex = self.examples.setdefault(reason, [])
        if len(ex) < N_EXAMPLES:
            ex.append(f"{where}: {detail}")

    @property
    def malformed(self) -> int:
        return sum(self.skipped[r] for r in MALFORMED)

    def check(self, cfg: DataConfig) -> None:
        """Stop on damage: too many malformed records, or no document at all."""
        bad = self.malformed
        if bad and bad > cfg.max_malformed_fraction * self.records:
            reasons = ", ".join(f"{REASONS[r]}: {self.skipped[r]}" for r in MALFORMED if self.skipped[r])
            first = "; ".join(e for r in MALFORMED for e in self.examples.get(r, [])[:2])
            raise TooManyBadRecordsError(
                f"source {self.source!r}: {bad} of {self.records} records are malformed ({reasons}), above "
                f"data.max_malformed_fraction={cfg.max_malformed_fraction:g}; first: {first}. Fix or remove them, "
                f"or raise data.max_malformed_fraction to skip them"
            )
        if self.documents == 0:
            if self.skipped["missing_text"]:
                raise MissingColumnError(
                    f"source {self.source!r} has no record with a text field: {self.examples['missing_text'][0]}; "
                    f"set text_field to the field that holds the text"
                )
            raise EmptySourceError(
                f"source {self.source!r} holds no document to train on ({self.summary() or 'no records'}); "
                f"point it at text files, or at jsonl/parquet with a text field"
            )

    def summary(self) -> str:
        """'skipped binary files: 3 (a.png: ..., ...), empty texts: 2 (...)' or ''."""
        parts = []
        for r in (*BENIGN, *MALFORMED):
            if self.skipped[r]:
                places = "; ".join(self.examples.get(r, []))
                more = ", ..." if self.skipped[r] > len(self.examples.get(r, [])) else ""
                parts.append(f"{REASONS[r]}: {self.skipped[r]} ({places}{more})")
        return ("skipped " + ", ".join(parts)) if parts else ""

    def to_json(self) -> dict:
        return {
            "documents": self.documents,
            "records": self.records,
            "skipped": {r: self.skipped[r] for r in (*BENIGN, *MALFORMED) if self.skipped[r]},
            "examples": {r: v for r, v in self.examples.items() if v},
            "files": self.files,
        }


# ---- the stream ----------------------------------------------------------------------------------------------------
class SourceStream:
    """Iterate a source's documents as pieces: ``(text, last)`` with ``last`` True on a document's final piece,
    or ``None``, which drops the pieces of the document in progress (it turned out bad, e.g. invalid UTF-8 in a
    file's second megabyte). Bad records are counted in ``report`` (or raised, with ``on_bad_record: error``)."""

    def __init__(
        self,
        src: SourceConfig,
        cfg: DataConfig,
        cache_dir: Path,
        resolved: tuple[list[Path | str], str] | None = None,
        stamps: list[list] | None = None,
        name: str = "",
        piece_chars: int | None = None,
        pieces: list | None = None,
    ):
        self.src, self.cfg, self.cache_dir = src, cfg, Path(cache_dir)
        self.pieces = pieces  # per file, None or the piece of it to read (parts.py); None: every file whole
        self.piece_lines = 0  # lines the pieces read (a jsonl piece's; parts.py rebases the next piece's places)
        self.files, self.fmt = resolved or resolve_files(src)
        self.stamps = stamps if stamps is not None else [file_stamp(f) for f in self.files]
        self.piece_chars = piece_chars or PIECE_CHARS  # read at call time: tests lower it
        self.report = SourceReport(name or source_name(src), cfg.on_bad_record)

    def _dataset(self):
        try:
            import datasets
        except ImportError as e:  # a dependency, but a bare machine (a lent GPU's image) may lack it
            raise DataError(f"reading data sources needs the 'datasets' package, which does not import here ({e}); "
                            f"install hybridtron's dependencies (pip install 'datasets>=2.19')") from None

        offline_env()
        datasets.utils.logging.disable_progress_bar()
        gen_kwargs = {
            "files": [s[0] for s in self.stamps],
            "stamps": self.stamps,  # sizes and mtimes key the Arrow cache: an edited file is read again
            "fmt": self.fmt,
            "text_field": self.src.text_field,
            "piece_chars": self.piece_chars,
            "max_bytes": self.cfg.max_record_mb << 20,
            "version": READER_VERSION,
        }
        if self.pieces is not None:  # only then: the whole files' Arrow cache keeps its key
            gen_kwargs["pieces"] = self.pieces
        if self.cfg.streaming:
            return datasets.IterableDataset.from_generator(_read_files, gen_kwargs=gen_kwargs)
        features = datasets.Features(
            {"text": datasets.Value("string"), "end": datasets.Value("bool"), "event": datasets.Value("string")}
        )
        # writer_batch_size bounds the rows (pieces of <= PIECE_CHARS) datasets holds before writing them
        return datasets.Dataset.from_generator(
            _read_files, features=features, gen_kwargs=gen_kwargs, cache_dir=str(self.cache_dir), writer_batch_size=64
        )

    def __iter__(self) -> Iterator[tuple[str, bool] | None]:
        try:
            from datasets.exceptions import DatasetGenerationError
        except ImportError:
            self._dataset()  # raises the one line that names the missing package
            raise

        report = self.report
        in_doc = False
        try:
            for row in self._dataset():
                ev = row["event"]
                if not ev:
                    in_doc = not row["end"]
                    report.documents += row["end"]
                    report.records += row["end"]
                    yield row["text"], row["end"]
                    continue
                e = json.loads(ev)
                if "piece_lines" in e:
                    self.piece_lines += e["piece_lines"]
                    continue
                if "file" in e:
                    report.files.append(e["file"])
                    continue
                if in_doc:
                    in_doc = False
                    yield None
                report.add_bad(e["bad"], e["where"], e["detail"], e["n"])
        except DatasetGenerationError as e:
            # non-streaming: datasets wraps what our reader raised while it built the Arrow cache
            cause = e.__cause__ or e.__context__
            if isinstance(cause, DataError):
                raise cause from None
            raise


def iter_documents(
    src: SourceConfig,
    streaming: bool,
    cache_dir: Path,
    batch_size: int = 256,
    resolved: tuple[list[Path | str], str] | None = None,
) -> Iterator[list[str]]:
    """Batches of whole document texts in file order, bad records skipped. Joins pieces: for tests and tools;
    ``prepare`` consumes ``SourceStream`` to keep memory bounded."""
    cfg = DataConfig(sources=[src], streaming=streaming)
    batch: list[str] = []
    parts: list[str] = []
    for ev in SourceStream(src, cfg, cache_dir, resolved=resolved):
        if ev is None:
            parts = []
            continue
        parts.append(ev[0])
        if ev[1]:
            batch.append("".join(parts))
            parts = []
            if len(batch) == batch_size:
                yield batch
                batch = []
    if batch:
        yield batch
