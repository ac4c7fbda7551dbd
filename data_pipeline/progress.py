"""Progress lines of long data work: how much of a source is done, at what rate, and the time left.

    text: tokenizing 41% (1.23 of 3.00 GB), 12.4 MB/s, 2.81M tokens/s, 310,000 documents, about 2 min 23 s left

One line at most every ``every_s`` seconds (and none for work that ends sooner), through the same ``log`` as the
rest of prepare's lines, so they read as the trainer's do in a SLURM log or a file. Where stderr is a terminal a
tqdm bar takes their place, as the trainer's (``train.progress_bar``) does: bytes, their rate and the time left,
with the documents and the documents/s and tokens/s after it. Rates are since the start of this run (a resumed
prepare's earlier work is not counted as fast work now).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

EVERY_S = 30.0
EVERY_ENV = "HYBRIDTRON_PROGRESS_EVERY_S"  # seconds between lines, where not a terminal (tests: 0, a line a step)
_POSTFIX_S = 0.5  # the bar's documents and rates are recomputed at most this often (add() runs per document)


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


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def bar_wanted() -> bool:
    """A bar where stderr is a terminal; lines in a log file or SLURM output, or where TQDM_DISABLE is set."""
    if os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


class Progress:
    def __init__(self, what: str, total_bytes: int, log: Callable[[str], object], every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, bar: bool | None = None):
        self.what, self.total, self.log, self.clock = what, max(int(total_bytes), 1), log, clock
        if every_s is None:
            every_s = float(os.environ.get(EVERY_ENV) or EVERY_S)
        self.every = every_s
        self.t0 = self.last = clock()
        self.bytes = self.docs = self.tokens = 0
        self.bar = None  # made at the first add(): the lines logged before the work starts come before it
        self.want_bar = bar_wanted() if bar is None else bar

    def add(self, nbytes: int = 0, docs: int = 0, tokens: int = 0) -> None:
        self.bytes += nbytes
        self.docs += docs
        self.tokens += tokens
        now = self.clock()
        if self.want_bar:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, desc=self.what, unit="B", unit_scale=True, unit_divisor=1000,
                                dynamic_ncols=True, file=sys.stderr)
            if now - self.last >= _POSTFIX_S:
                self.last = now
                self.bar.set_postfix_str(self.rates(now), refresh=False)
            if nbytes:
                self.bar.update(nbytes)  # tqdm redraws at most every 0.1 s
            return
        if now - self.last >= self.every:
            self.last = now
            self.log(self.line(now))

    def rates(self, now: float | None = None) -> str:
        """The bar's postfix: '310,000 docs, 3,100 docs/s, 2.81M tok/s'."""
        dt = max((self.clock() if now is None else now) - self.t0, 1e-9)
        return (f"{self.docs:,} docs, {self.docs / dt:,.0f} docs/s"
                + (f", {_si(self.tokens / dt)} tok/s" if self.tokens else ""))

    def close(self) -> None:
        """End the bar (its final counts and rates stay on the screen); nothing where lines are written."""
        if self.bar is not None:
            self.bar.set_postfix_str(self.rates(), refresh=False)
            self.bar.close()
            self.bar = None
        self.want_bar = False

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        dt = max(now - self.t0, 1e-9)
        rate = self.bytes / dt
        left = (self.total - self.bytes) / rate if rate > 0 else None
        return (f"{self.what} {min(self.bytes / self.total, 1):.0%} ({size(self.bytes)} of {size(self.total)}), "
                f"{rate / 1e6:.1f} MB/s, "
                + (f"{self.tokens / dt / 1e6:.2f}M tokens/s, " if self.tokens else "") + f"{self.docs:,} documents"
                + (f", about {duration(left)} left" if left is not None and self.bytes < self.total else ""))
