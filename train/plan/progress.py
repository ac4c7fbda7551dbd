"""A progress line on stderr for a plan that takes a while: nothing for one that ends within ``after`` seconds."""

from __future__ import annotations

import sys
import threading
import time

# Held while the progress line is printed, and by ``workers.Workers`` while it forks a child: no child starts with
# stderr's lock taken by this thread.
PRINTING = threading.Lock()


class Progress:
    """``note(what)`` says what the plan does now; from ``after`` seconds on, a background thread writes each new
    ``what`` to ``stream`` (stderr: stdout holds the plan's tables or JSON alone), so a plan that finishes sooner
    prints nothing extra. A context manager."""

    def __init__(self, after: float = 3.0, stream=None, prefix: str = "hybridtron plan: "):
        self.after, self.stream, self.prefix = after, stream, prefix
        self._what: str | None = None
        self._said: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plan-progress", daemon=True)

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def note(self, what: str) -> None:
        self._what = what

    def _run(self) -> None:
        if self._stop.wait(self.after):
            return
        while True:
            what = self._what
            if what is not None and what != self._said:
                stream = self.stream or sys.stderr
                with PRINTING:
                    print(f"{self.prefix}{what} ({time.monotonic() - self._start:.0f} s)", file=stream, flush=True)
                self._said = what
            if self._stop.wait(0.2):
                return
