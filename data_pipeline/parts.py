"""Tokenizing a source in parts, in worker processes, with the same shards out as one process writes.

A source's files (in their sorted order) are cut into **parts**: runs of consecutive whole files of about
``data.part_mb`` MB each. A file larger than that is cut into pieces of about that size, each a part: a jsonl
file at line starts (a piece [start, end) of bytes owns every line that starts in it; a boundary is found by
seeking to a nominal cut and skipping to the byte after the next newline), a parquet file at row-group boundaries
(runs of row groups by their compressed size, from the footer); text files (one document each) and ``.json``
arrays (parsed whole) stay whole. The plan depends on the files' bytes and ``part_mb`` only, never on the number of
workers, so a rerun with other workers keeps what is done.
``data.workers`` processes (started fresh, not forked: the parent's tokenizer threads and open files stay its own)
each tokenize one part at a time into ``SOURCE/.parts/part-NNNNN.{bin,idx,json}``: the documents' tokens without
EOS, their end offsets, and what the part read and skipped. Each file is written under a scratch name and renamed;
the ``.json``, last, marks the part complete, so a worker killed mid-part leaves only scratch that the next
prepare removes, and that part alone is done again.

The parent takes the parts **in file order** as they complete and feeds their documents to the same split and
shard writer a one-process prepare uses (prepare.py): a document's index, its train/val draw, the shard
boundaries and the manifest's counts are those of one pass over the files, so the shards are byte-identical
whatever the number of workers or parts. The parent's work is a copy of token arrays, about a thousand times
cheaper per byte than tokenizing. Once the source's splits are complete its ``.parts`` directory is removed (until
then it holds up to one copy of the source's tokens).

Bad records are counted per part and summed in order, so the report (counts, the first places per reason, the
files read) is one pass's; with ``on_bad_record: error`` the error raised is that of the first bad record in
file order. A piece that starts mid-file numbers its lines from its start (a worker never reads the bytes before
it) and counts them; the parent, which takes the pieces in order, adds the lines of the file's earlier pieces to
the places it reports. A file given up on in a piece (binary, unreadable) is given up on there, as one pass does:
its later pieces are dropped. A cut file's digest (the manifests' record of the file, for a touched file's check)
is the hash of the whole file, which the parent computes in a thread while the workers tokenize. A worker that
dies (kill -9, out of memory) ends the prepare with one line; the next run redoes only the parts that are not
complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridtron.atomic import write_file_atomic, write_text_atomic
from hybridtron.configs.job import DataConfig
from hybridtron.data_pipeline.errors import BadRecordError, DataError
from hybridtron.data_pipeline.progress import Progress
from hybridtron.data_pipeline.sources import (
    N_EXAMPLES,
    READ_CHUNK,
    SNIFF_BYTES,
    SourceReport,
    file_hash,
    open_source_file,
    rebase_where,
)

PARTS_DIR = ".parts"
PLAN = "plan.json"
FILES = "files.json"  # the source's [path, size, mtime] in plan order: what `hybridtron status` sizes the parts by
# seconds a worker sleeps after each part (tests: to kill a worker mid-prepare); never set by users
TEST_PART_DELAY = "HYBRIDTRON_TEST_PART_DELAY"


class WorkerDiedError(DataError):
    pass


def plan_parts(sizes: list[int], part_bytes: float) -> list[tuple[int, int]]:
    """Runs [start, end) of consecutive files, each about ``part_bytes`` (a file larger than that alone)."""
    parts: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > part_bytes:
            parts.append((start, i))
            start, acc = i, 0
        acc += size
    if sizes:
        parts.append((start, len(sizes)))
    return parts


def _next_line_start(fh, at: int, size: int) -> int:
    """The first line start at or after byte ``at`` > 0: the byte after the first newline at or after ``at - 1``."""
    fh.seek(at - 1)
    pos = at - 1
    while chunk := fh.read(READ_CHUNK):
        nl = chunk.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(chunk)
    return size


def _cut_jsonl(path, size: int, part_bytes: float) -> list[tuple[int, int, int]]:
    """[start, end) byte pieces of about ``part_bytes`` (ceil(size / part_bytes) even nominal cuts, each moved to
    the next line start; a line longer than a piece makes fewer pieces). One piece: do not cut."""
    n = math.ceil(size / part_bytes)
    bounds = [0]
    with open_source_file(path) as fh:
        head = fh.read(SNIFF_BYTES)
        if str(path).lower().endswith(".json") and head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
            return []  # a JSON array is parsed whole
        for k in range(1, n):
            at = k * size // n
            if at <= bounds[-1]:
                continue  # inside the line the previous boundary ends: no line starts before it
            b = _next_line_start(fh, at, size)
            if b >= size:
                break
            bounds.append(b)
    bounds.append(size)
    return [(a, b, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=False)] if len(bounds) > 2 else []


def _cut_parquet(path, size: int, part_bytes: float) -> list[tuple[int, int, int]]:
    """[first, end) row-group pieces, runs of row groups of about ``part_bytes`` compressed bytes; each piece's
    share of the file's bytes (for progress). A file whose footer cannot be read is not cut (its reader reports it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridtron.data_pipeline import remote

    try:
        if remote.is_url(path):
            with remote.open_file(path) as fh:
                meta = pq.ParquetFile(fh).metadata
        else:
            meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError):
        return []
    sizes = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        sizes.append(sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)))
    total = sum(sizes)
    runs = plan_parts(sizes, part_bytes)
    if len(runs) < 2 or total <= 0:
        return []
    cum = [0]
    for z in sizes:
        cum.append(cum[-1] + z)
    at = [size * cum[a] // total for a, _ in runs] + [size]
    return [(a, b, at[j + 1] - at[j]) for j, (a, b) in enumerate(runs)]


def plan_source(stamps: list, fmt: str, part_bytes: float) -> list[tuple]:
    """A source's parts: ``(a, b)`` for the run of whole files [a, b), or ``(a, a + 1, lo, hi, nbytes)`` for a piece
    of the big file a (bytes [lo, hi) of jsonl, row groups [lo, hi) of parquet; ``nbytes`` its share of the file).
    Sources whose files all fit in a part get the plan they always had."""
    parts: list[tuple] = []
    for a, b in plan_parts([s[1] for s in stamps], part_bytes):
        size = stamps[a][1]
        pieces = []
        if b == a + 1 and size > part_bytes and fmt in ("jsonl", "parquet"):
            pieces = (_cut_jsonl if fmt == "jsonl" else _cut_parquet)(stamps[a][0], size, part_bytes)
        parts.extend([(a, b, lo, hi, nb) for lo, hi, nb in pieces] or [(a, b)])
    return parts


def part_bytes(part, stamps: list) -> int:
    """The bytes of the source a part reads: its files', or its piece's share."""
    return part[4] if len(part) > 2 else sum(s[1] for s in stamps[part[0]:part[1]])


def workers_for(cfg: DataConfig, n_parts: int) -> int:
    """Processes to tokenize with: data.workers (0: the cores), never more than there are parts."""
    want = cfg.workers or os.cpu_count() or 1
    return max(1, min(want, n_parts))


def threads_per_worker(cfg: DataConfig, workers: int) -> int:
    """Tokenizer threads in each worker: data.num_workers, or the cores shared out."""
    return cfg.num_workers or max(1, (os.cpu_count() or 1) // workers)


@dataclass
class PartJob:
    cfg: DataConfig
    source_index: int
    name: str
    index: int
    stamps: list  # the part's files: [path, size, mtime] each
    fmt: str
    tokenizer_dir: str
    directory: str  # SOURCE/.parts
    cache_dir: str
    threads: int
    piece: list | None = None  # a cut file's piece: [lo, hi) (plan_source), None: the whole files
    nbytes: int | None = None  # the source's bytes the part reads (None: its files' sizes)


def part_job(cfg: DataConfig, i: int, name: str, k: int, part, stamps: list, fmt: str, tokenizer_dir, directory,
             cache_dir, threads: int) -> PartJob:
    """The job of part ``k`` (``part``: its plan entry) of source ``i``."""
    a, b = part[0], part[1]
    return PartJob(cfg, i, name, k, stamps[a:b], fmt, str(tokenizer_dir), str(directory), str(cache_dir), threads,
                   list(part[2:4]) if len(part) > 2 else None, part_bytes(part, stamps))


def _stem(directory: Path, index: int) -> Path:
    return Path(directory) / f"part-{index:05d}"


def part_done(directory: Path, index: int) -> dict | None:
    """The record of a complete part, or None."""
    stem = _stem(directory, index)
    try:
        rec = json.loads(stem.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    ok = stem.with_suffix(".bin").is_file() and stem.with_suffix(".idx").is_file()
    return rec if ok and stem.with_suffix(".bin").stat().st_size == rec["n_tokens"] * np.dtype(rec["dtype"]).itemsize \
        else None


_worker_tok: dict = {}


def _init_worker(threads: int) -> None:
    # before tokenizers first goes parallel in this process: Rayon reads it once
    os.environ["RAYON_NUM_THREADS"] = str(threads)


@contextmanager
def worker_pool(workers: int, threads: int) -> Iterator[ProcessPoolExecutor]:
    """``workers`` tokenizing processes of ``threads`` tokenizer threads each, started fresh (spawn, not fork: the
    parent's tokenizer threads and open files stay its own). On an error, a full disk or an interrupt they are killed
    at once, not after their parts."""
    import multiprocessing

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(threads,))
    try:
        yield pool
    except BaseException:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def tokenize_part(job: PartJob) -> dict:
    """In a worker: the part's documents into part-NNNNN.{bin,idx}, then its .json. Returns the record."""
    from hybridtron.data_pipeline.encode import encode_documents
    from hybridtron.data_pipeline.shards import token_dtype
    from hybridtron.data_pipeline.sources import SourceStream
    from hybridtron.data_pipeline.tokenizer import load_tokenizer

    tok = _worker_tok.get(job.tokenizer_dir)
    if tok is None:
        tok = _worker_tok[job.tokenizer_dir] = load_tokenizer(Path(job.tokenizer_dir))
    tok.num_threads = job.threads
    dtype = token_dtype(tok.vocab_size)
    stem = _stem(Path(job.directory), job.index)
    started = time.time()
    src = job.cfg.sources[job.source_index]
    stream = SourceStream(src, job.cfg, Path(job.cache_dir), resolved=([s[0] for s in job.stamps], job.fmt),
                          stamps=job.stamps, name=job.name, pieces=[job.piece] if job.piece is not None else None)
    ends: list[int] = []
    total = [0]

    def write(path: str) -> None:
        with open(path, "wb") as f:
            def done(doc) -> None:
                for p in doc.parts:
                    f.write(p.tobytes())
                    total[0] += len(p)
                ends.append(total[0])

            encode_documents(stream, tok, dtype, lambda: _PartDoc(), done)
            f.flush()
            os.fsync(f.fileno())

    write_file_atomic(stem.with_suffix(".bin"), write)
    write_file_atomic(stem.with_suffix(".idx"), lambda p: np.asarray(ends, dtype=np.int64).tofile(p))
    # bytes, started, finished: for `hybridtron status DATA_DIR` (rates and time left); never read by the merge
    rec = {"index": job.index, "n_docs": len(ends), "n_tokens": total[0], "dtype": dtype.name,
           "files": [s[0] for s in job.stamps], "report": stream.report.to_json(),
           "bytes": sum(s[1] for s in job.stamps) if job.nbytes is None else job.nbytes, "started": started,
           "finished": time.time()}
    if job.piece is not None:  # lines: the parent rebases the places of the file's next pieces by them
        rec.update(piece=job.piece, lines=stream.piece_lines)
    write_text_atomic(stem.with_suffix(".json"), json.dumps(rec))
    if delay := float(os.environ.get(TEST_PART_DELAY, "0") or 0):
        time.sleep(delay)
    return rec


class _PartDoc:
    """A document of a part: always tokenized (which split it lands in is the parent's draw)."""

    __slots__ = ("parts",)

    def __init__(self):
        self.parts: list | None = []


def merge_report(report: SourceReport, part: dict) -> None:
    """Add a part's counts to ``report`` as one pass over its files would have."""
    r = part["report"]
    report.documents += r["documents"]
    report.records += r["records"]
    report.skipped.update(r["skipped"])
    for reason, places in r["examples"].items():
        have = report.examples.setdefault(reason, [])
        have.extend(places[: N_EXAMPLES - len(have)])
    report.files.extend(r["files"])


def _prepare_parts_dir(directory: Path, plan: dict, log: Callable, stamps: list | None = None) -> dict[int, dict]:
    """Keep the parts of the same plan; anything else there (another plan, scratch of dead workers, part locks) goes.
    Returns the records of the complete parts, by index. Only under the data directory's exclusive lock, which no
    array task (prepare_tasks.py) holds beside: their scratch is live."""
    try:
        old = json.loads((directory / PLAN).read_text())
    except (OSError, ValueError):
        old = None
    if old != plan and directory.exists():
        if old is not None:
            log(f"{directory.parent.name}: its parts were planned from other files or settings; tokenizing again")
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomic(directory / PLAN, json.dumps(plan))
    if stamps is not None:
        write_text_atomic(directory / FILES, json.dumps([s[:3] for s in stamps]))
    done = {i: rec for i in range(len(plan["parts"])) if (rec := part_done(directory, i)) is not None}
    keep = {f"part-{i:05d}{ext}" for i in done for ext in (".bin", ".idx", ".json")}
    for f in directory.iterdir():
        if f.name not in (PLAN, FILES) and f.name not in keep:
            f.unlink()
    return done


def parts_plan(key: str, digest: str, part_mb: float, ranges: list[tuple[int, int]]) -> dict:
    """A source's plan.json: the same whoever plans it (a prepare, or `submit prepare`'s plan job)."""
    return {"key": key, "inputs_digest": digest, "part_mb": part_mb, "parts": [list(r) for r in ranges]}


class _Hasher:
    """The whole-file digests of the cut files, in a thread of the parent while the workers tokenize (a piece's
    worker reads only its bytes). A daemon thread that stops at ``stop()``: an interrupted prepare does not wait for
    a big file's hash."""

    def __init__(self, paths: list):
        self.paths, self.digests, self.stopped = paths, {}, False
        self.ready = {p: threading.Event() for p in paths}
        self.thread = threading.Thread(target=self._run, name="hash-cut-files", daemon=True)
        if paths:
            self.thread.start()

    def _run(self) -> None:
        for p in self.paths:
            try:
                self.digests[p] = file_hash(p, stop=lambda: self.stopped)
            except BaseException as e:  # handed to the merge, which raises it
                self.digests[p] = e
            finally:
                self.ready[p].set()

    def get(self, path):
        self.ready[path].wait()
        d = self.digests[path]
        if isinstance(d, BaseException):
            raise d
        return d

    def stop(self) -> None:
        self.stopped = True

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


class _CutFile:
    """The merge's state of a cut file: the lines of its pieces merged so far, and whether one gave up on it."""

    __slots__ = ("lines", "gone")

    def __init__(self):
        self.lines, self.gone = 0, False


def _rebase_report(rec: dict, path: str, start: int, lines_before: int) -> None:
    """A mid-file piece's places, numbered from its start, made the file's line numbers."""
    ex = rec["report"]["examples"]
    for reason, places in ex.items():
        ex[reason] = [rebase_where(w, path, start, lines_before) for w in places]


def part_documents(cfg: DataConfig, i: int, name: str, key: str, digest: str, stamps: list, fmt: str,
                   ranges: list[tuple], tokenizer_dir: Path, out: Path, report: SourceReport, log: Callable,
                   progress: Progress | None = None) -> Iterator[np.ndarray]:
    """Every document of source ``i`` (its tokens, without EOS) in file order, tokenized in parts by worker
    processes; ``report`` gets the parts' counts in order, ``progress`` each part's bytes once it is taken."""
    directory = out / name / PARTS_DIR
    plan = parts_plan(key, digest, cfg.part_mb, ranges)
    done = _prepare_parts_dir(directory, plan, log, stamps)
    workers = workers_for(cfg, len(ranges))
    threads = threads_per_worker(cfg, workers)
    todo = [k for k in range(len(ranges)) if k not in done]
    cut = sum(len(r) > 2 for r in ranges)
    log(f"{name}: {len(ranges)} parts of <= {cfg.part_mb:g} MB"
        + (f" ({cut} of them pieces of {len({r[0] for r in ranges if len(r) > 2})} big files)" if cut else "")
        + f", {len(done)} done; {workers} worker processes x {threads} tokenizer threads")
    hasher = _Hasher(list(dict.fromkeys(stamps[r[0]][0] for r in ranges if len(r) > 2)))
    files: dict[int, _CutFile] = {}
    futures: dict[int, Future] = {}
    with worker_pool(workers, threads) as pool, hasher:  # the hasher stops, then the workers
        for k in todo:
            futures[k] = pool.submit(tokenize_part, part_job(cfg, i, name, k, ranges[k], stamps, fmt, tokenizer_dir,
                                                             directory, out / ".hf_cache", threads))
        for k, part in enumerate(ranges):
            f = files.setdefault(part[0], _CutFile()) if len(part) > 2 else None
            path, lo = stamps[part[0]][0], part[2] if f is not None else 0
            if f is not None and f.gone:  # an earlier piece gave up on the file: one pass reads no further
                if k in futures:
                    futures[k].cancel()
                continue
            if k in futures:
                try:
                    rec = futures[k].result()
                except BrokenProcessPool:
                    raise WorkerDiedError(
                        f"a tokenizing worker of source {name!r} died (killed, or out of memory) in part {k} of "
                        f"{len(ranges)}; run prepare again: it keeps the "
                        f"{sum(part_done(directory, j) is not None for j in range(len(ranges)))} complete parts and "
                        f"tokenizes the rest"
                    ) from None
                except BadRecordError as e:  # on_bad_record=error: the place in the whole file
                    if lo > 0:
                        raise BadRecordError(rebase_where(str(e), path, lo, f.lines)) from None
                    raise
            else:
                rec = done[k]
            if f is not None:
                if lo > 0:
                    _rebase_report(rec, path, lo, f.lines)
                f.lines += rec.get("lines", 0)
                f.gone = bool(rec["report"]["files"])  # a piece's report names its file only when it gave up on it
            merge_report(report, rec)
            if f is not None and not f.gone and (k + 1 == len(ranges) or ranges[k + 1][0] != part[0]):
                report.files.append([*stamps[part[0]], hasher.get(path)])  # the file's last piece: read whole
            stem = _stem(directory, k)
            ends = np.fromfile(stem.with_suffix(".idx"), dtype=np.int64)
            tokens = np.memmap(stem.with_suffix(".bin"), dtype=rec["dtype"], mode="r") if rec["n_tokens"] else \
                np.empty(0, dtype=rec["dtype"])
            start = 0
            for end in ends.tolist():
                yield tokens[start:end]
                start = end
            if progress is not None:
                progress.add(part_bytes(part, stamps))


def remove_parts(out: Path, name: str) -> None:
    shutil.rmtree(out / name / PARTS_DIR, ignore_errors=True)
