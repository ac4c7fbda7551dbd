"""Tokenizing a source's documents in order, a batch in flight: the one loop both a one-process prepare and each
worker of a parallel one (parts.py) run, so their tokens are the same."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hybridtron.data_pipeline.tokenizer import Tokenizer

# HF encode_batch parallelises over the texts of one call; batches of ~4 MB keep the cores busy (each batch ends
# with a tail where its longest pieces run alone) while bounding memory: the tokenizer holds ~100 bytes per token
# of the batch it encodes, and byte-level BPE makes at most one token per UTF-8 byte
_ENCODE_BYTES = 4_000_000
_MAX_OPS = 16384  # bookkeeping entries per batch (resume skips documents without encoding them)


def encode_documents(stream: Iterator, tok: Tokenizer, dtype: np.dtype, begin: Callable[[], object],
                     done: Callable[[object], None], drop: Callable[[object], None] = lambda doc: None) -> None:
    """Tokenize a SourceStream's documents in order: ``begin()`` at a document's first piece gives its record
    (``.parts``: a list the piece arrays are appended to, or None: not tokenized), ``done(doc)`` once all its pieces
    are encoded, ``drop(doc)`` when it turned out bad (it never reaches ``done``).

    Encoding runs on one worker thread (tokenizers and SentencePiece release the GIL and use every core
    themselves), so reading the next batch and writing the previous one's shards overlap with it. Two
    concurrent encode calls measured slower than one (Rayon already saturates the cores). Results are
    applied in submission order, so the output is identical to a serial run."""
    texts: list[str] = []
    ops: list[tuple[bool, object]] = []  # (True: the next encoded piece belongs to doc, False: doc has ended)
    nbytes = 0  # UTF-8 bytes of `texts`
    in_flight: deque[tuple[Future | None, list]] = deque()

    def apply_oldest() -> None:
        fut, batch_ops = in_flight.popleft()
        results = iter(fut.result() if fut is not None else ())
        for is_piece, doc in batch_ops:
            if is_piece:
                ids = next(results)
                if doc.parts is not None:
                    doc.parts.append(ids)
            else:
                done(doc)

    def submit() -> None:
        nonlocal texts, ops, nbytes
        if ops:
            in_flight.append((pool.submit(tok.encode_batch_arrays, texts, dtype) if texts else None, ops))
            texts, ops, nbytes = [], [], 0
        while len(in_flight) > 1:
            apply_oldest()

    cur = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        for ev in stream:
            if ev is None:  # the document in progress turned out bad: forget it
                if cur is not None:
                    drop(cur)
                    cur.parts = None
                    cur = None
                continue
            text, last = ev
            if cur is None:
                cur = begin()
            if cur.parts is not None:
                texts.append(text)
                ops.append((True, cur))
                nbytes += len(text) if text.isascii() else len(text.encode("utf-8"))
            if last:
                ops.append((False, cur))
                cur = None
            if nbytes >= _ENCODE_BYTES or len(ops) >= _MAX_OPS:
                submit()
        submit()
        while in_flight:
            apply_oldest()
