"""Progress lines of long data work: how much of a source is done, at what rate, and the time left.

    text: tokenizing 41% (1.23 of 3.00 GB), 12.4 MB/s, 2.81M tokens/s, 310,000 documents, about 2 min 23 s left

One line at most every ``every_s`` seconds (and none for work that ends sooner), through the same ``log`` as the
rest of prepare's lines, so they read as the trainer's do in a terminal, a SLURM log or a file. Rates are since
the start of this run (a resumed prepare's earlier work is not counted as fast work now).
"""

from __future__ import annotations

import time
from collections.abc import Callable

EVERY_S = 30.0


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


class Progress:
    def __init__(self, what: str, total_bytes: int, log: Callable[[str], object], every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.log, self.clock = what, max(int(total_bytes), 1), log, clock
        self.every = EVERY_S if every_s is None else every_s
        self.t0 = self.last = clock()
        self.bytes = self.docs = self.tokens = 0

    def add(self, nbytes: int = 0, docs: int = 0, tokens: int = 0) -> None:
        self.bytes += nbytes
        self.docs += docs
        self.tokens += tokens
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.log(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        dt = max(now - self.t0, 1e-9)
        rate = self.bytes / dt
        left = (self.total - self.bytes) / rate if rate > 0 else None
        return (f"{self.what} {min(self.bytes / self.total, 1):.0%} ({size(self.bytes)} of {size(self.total)}), "
                f"{rate / 1e6:.1f} MB/s, "
                + (f"{self.tokens / dt / 1e6:.2f}M tokens/s, " if self.tokens else "") + f"{self.docs:,} documents"
                + (f", about {duration(left)} left" if left is not None and self.bytes < self.total else ""))
