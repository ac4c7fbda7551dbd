"""Hang and straggler watch: every rank says where it is, a hang costs minutes and names the ranks, a slow rank is
named without being stopped.

Each training process marks its phase as it goes (``phase("forward")``: an attribute store, no I/O) and times the
step collectives it runs itself (``waiting()``). A thread per process then

- publishes, every ``interval`` seconds, this rank's step, phase and a heartbeat into the rendezvous store (a key
  per rank: no collective, and readable while every collective is stuck);
- once the first step is done (compile and kernel tuning are not watched), and this rank's phase has not changed
  for ``train.hang_timeout_s``, compares every rank's entry with a reading taken when it had stood still for a
  quarter of that. If any rank moved on meanwhile, this one is merely waiting for a slow but alive rank, and keeps
  waiting. If none did, it is a hang: the ranks whose heartbeat stopped (a stopped or dead process) or that are
  behind (a lower step or phase: stuck in a data read, a file system) are named with their hosts in one line, this
  process's Python stacks and torch's flight recorder of the last collectives go to ``RUN_DIR/hang/``, the first
  rank to report writes ``last_stop.json``, and the process
  exits with ``HANG_EXIT`` (6), which the SLURM job script restarts from the latest checkpoint.

After the first step the process groups' timeout also drops from 30 minutes to ``hang_timeout_s`` plus
``PG_MARGIN_S``: the margin lets the watch, which can say who is missing, speak before the collective library does.

Stragglers: per log interval each rank sums its step time split into data (its own batches), waiting (the step
collectives it runs itself: loss and token all-reduces, the stop agreement, the gradient norm) and compute (the
rest: forward, backward and the optimizer, with the collectives inside the model), plus the time the process was
not running at all (stopped, or starved of CPU: the watch thread's sleeps overrun). A rank that waits less is the one
the others wait for: its busy time (step time less waiting) exceeds the median's by ``train.straggler_margin``, or
it was not running for more than that share of its step time, and rank 0 names it. The numbers travel through the
same store (a key per rank, written at log steps), so no collective is added to any step.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from hybridtron.train.launcher_watch import tell_launcher

HANG_EXIT = 6  # the training processes' exit code after a hang: the job script restarts from the latest checkpoint
PG_MARGIN_S = 60  # the process groups' timeout is hang_timeout_s plus this (the watch names the ranks first)
STORE_TIMEOUT_S = 10  # a store read or write that takes longer: the store's host is gone; the watch says so
HANG_DIR = "hang"
MIN_WINDOW_S = 5.0  # stragglers are judged over windows of at least this much step time (log steps permitting)

_watch: Watch | None = None


def phase(name: str) -> None:
    """Mark that this process entered ``name`` (data, forward, backward, optimizer, checkpoint, eval, ...)."""
    w = _watch
    if w is not None:
        w.enter(name)


@contextlib.contextmanager
def waiting():
    """Time a collective this process runs itself: the time other ranks keep it waiting there."""
    w = _watch
    if w is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        w.wait_s += time.perf_counter() - t0


def _interval(timeout_s: float) -> float:
    return min(5.0, max(0.2, timeout_s / 10))


def _store_client(prefix: str):
    """A connection of its own to the rendezvous store (the main thread keeps using its own), or None."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        base = c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        base = base.clone()
    base.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return dist.PrefixStore(prefix, base)


class Watch:
    """One process's watch (see the module docstring). ``store`` None: one process, only its own progress."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int = 0, world: int = 1, store=None, *,
                 margin: float = 0.2, checkpoint_dir=None, last_stop: Path | None = None, err=None):
        self.timeout_s, self.run_dir, self.rank, self.world = timeout_s, Path(run_dir), rank, world
        self.store, self.margin = store, margin
        self.checkpoint_dir = checkpoint_dir  # a callable giving the latest checkpoint's name, for the line
        self.last_stop = last_stop  # where the first rank to report says why training stopped (None: nowhere)
        self.err = err or sys.stderr
        self.host = socket.gethostname()
        self.interval = _interval(timeout_s)
        self.confirm = 2 * self.interval + 0.5
        self.step, self.name, self.count = 0, "start", 0  # count: phases entered in this step
        self.since = time.monotonic()
        self.armed = False
        self.beat = 0
        self._lock = threading.Lock()  # one store connection, two threads (the watch, rank 0's straggler read)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # running totals of this process's steps, for the straggler report
        self.steps = 0
        self.step_s = self.data_s = self.wait_s = self.stall_s = 0.0
        self._step_t0 = None
        self._data_t0 = None
        self._published: dict | None = None  # this rank's totals at the last log step, and at the one before
        self._previous: dict | None = None
        self._window_base: list[dict] | None = None  # rank 0: every rank's totals when the window began

    # ---- called by the training thread ---------------------------------------------------------------------
    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if self._data_t0 is not None:  # leaving data
            self.data_s += now - self._data_t0
            self._data_t0 = None
        if name == "data":
            self._data_t0 = now
        self.name = name
        self.count += 1
        self.since = time.monotonic()

    def step_begin(self, step: int) -> None:
        self.step, self.count = step, 0
        self._step_t0 = time.perf_counter()
        self.enter("data")

    def step_end(self) -> None:
        if self._step_t0 is not None:
            self.step_s += time.perf_counter() - self._step_t0
            self.steps += 1
            self._step_t0 = None
        self.enter("between steps")

    def arm(self, groups=()) -> None:
        """Watch from now on, and lower ``groups``' timeout to hang_timeout_s + PG_MARGIN_S."""
        from torch.distributed import distributed_c10d as c10d

        for g in groups:
            with contextlib.suppress(Exception):  # a backend without a settable timeout keeps its own
                c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout_s + PG_MARGIN_S), g)
        self.since = time.monotonic()
        self.armed = True

    def start(self) -> Watch:
        global _watch
        _watch = self
        self._thread = threading.Thread(target=self._run, name="hybridtron-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        global _watch
        if _watch is self:
            _watch = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STORE_TIMEOUT_S + self.interval)

    # ---- stragglers --------------------------------------------------------------------------------------------
    def _totals(self, upto: int) -> dict:
        return {"upto": upto, "rank": self.rank, "host": self.host, "steps": self.steps, "step_s": self.step_s,
                "data_s": self.data_s, "wait_s": self.wait_s, "stall_s": self.stall_s}

    def publish_times(self, upto: int) -> None:
        """At a log step: this rank's running totals where rank 0 reads them. The previous log step's stay beside
        them, for a rank 0 that reads while a faster rank has already written the next."""
        cur = self._totals(upto)
        blob = json.dumps({"cur": cur, "prev": self._published})
        self._previous, self._published = self._published, cur
        if self.store is not None:
            with self._lock, contextlib.suppress(Exception):  # the numbers are a report: never stop training
                self.store.set(f"times/{self.rank}", blob)

    def rank_times(self, upto: int) -> tuple[int, list[dict]] | None:
        """Rank 0, at a log step: every rank's seconds per step (data, compute, waiting, not running, busy) since
        the last window, judged through log step ``upto`` (the previous log step: every rank has written it by
        now), once the window holds MIN_WINDOW_S of step time; else None. Returns (first step, times)."""
        if self.store is None or self.world == 1:
            return None
        base = self._window_base
        own = self._previous  # this rank's totals at ``upto``: a window too short is known without the store
        if base is not None and own is not None and own["upto"] == upto and \
                own["step_s"] - base[self.rank]["step_s"] < MIN_WINDOW_S:
            return None
        try:
            with self._lock:
                raw = self.store.multi_get([f"times/{r}" for r in range(self.world)])
            seen = [json.loads(bytes(b).decode()) for b in raw]
        except Exception:
            return None
        now = []
        for entry in seen:
            match = [t for t in (entry.get("cur"), entry.get("prev")) if t and t.get("upto") == upto]
            if not match:
                return None
            now.append(match[0])
        if base is None or len(base) != len(now):
            self._window_base = now
            return None
        if now[self.rank]["step_s"] - base[self.rank]["step_s"] < MIN_WINDOW_S:
            return None
        self._window_base = now
        out = []
        for a, b in zip(base, now, strict=True):
            n = max(b["steps"] - a["steps"], 1)
            t = {k: (b[k] - a[k]) / n for k in ("step_s", "data_s", "wait_s", "stall_s")}
            t["compute_s"] = max(t["step_s"] - t["data_s"] - t["wait_s"], 0.0)
            t["busy_s"] = t["step_s"] - t["wait_s"]
            out.append({"rank": b["rank"], "host": b["host"], **{k: round(v, 4) for k, v in t.items()}})
        return base[0]["upto"] + 1, out

    # ---- the watch thread ------------------------------------------------------------------------------------
    def _entry(self) -> dict:
        return {"step": self.step, "count": self.count, "phase": self.name, "beat": self.beat, "host": self.host,
                "pid": os.getpid()}

    def _publish(self) -> None:
        if self.store is None:
            return
        with self._lock, contextlib.suppress(Exception):
            self.store.set(f"progress/{self.rank}", json.dumps(self._entry()))

    def _read_all(self) -> list[dict | None] | str:
        try:
            with self._lock:
                raw = self.store.multi_get([f"progress/{r}" for r in range(self.world)])
        except Exception as e:  # the store's host (the launcher of the first node) is gone or stuck
            return f"the rendezvous store did not answer ({type(e).__name__})"
        out = []
        for blob in raw:
            try:
                out.append(json.loads(bytes(blob).decode()))
            except (ValueError, TypeError):
                out.append(None)
        return out

    def _run(self) -> None:
        tick = min(self.interval, 0.1)  # short sleeps: their overrun is time this process was not running
        last_publish = 0.0
        pending = None  # (when, first reading, this rank's place then): a hang being confirmed
        while not self._stop.is_set():
            t0 = time.monotonic()
            if self._stop.wait(tick):
                return
            now = time.monotonic()
            if now - t0 - tick > 0.05:
                self.stall_s += now - t0 - tick
            if now - last_publish >= self.interval:  # on while a hang is confirmed: the others read it too
                self.beat += 1
                self._publish()
                last_publish = now
            mine = (self.step, self.count)
            stalled = now - self.since
            if not self.armed or stalled <= self.timeout_s / 4:
                pending = None
            elif self.store is None or self.world == 1:
                if stalled > self.timeout_s:
                    self._report(stalled, [], "")
            elif pending is None or pending[2] != mine:
                # the first reading, three quarters of the timeout before the decision: a rank that moves at
                # least that often is seen moving, and a heartbeat that stops over that long is a frozen process
                pending = (now, self._read_all(), mine)
            elif stalled > self.timeout_s and now - pending[0] >= self.confirm:
                self._decide(stalled, pending[1])
                pending = None

    def _decide(self, stalled: float, first) -> None:
        """This rank has not moved for hang_timeout_s: a hang, unless some rank is still moving."""
        second = first if isinstance(first, str) else self._read_all()
        if isinstance(second, str):
            self._report(stalled, [], f"; {second}, so the other ranks could not be asked")
        late, moving = diagnose(first, second)
        if moving:
            self.since = time.monotonic()  # a slow but alive rank: wait for it another full timeout
            return
        self._report(stalled, late, "")

    def _report(self, stalled: float, late: list[tuple[int, str]], note: str) -> None:
        hang_dir = self.run_dir / HANG_DIR
        files = []
        with contextlib.suppress(OSError):
            hang_dir.mkdir(parents=True, exist_ok=True)
            stacks = hang_dir / f"stacks-rank{self.rank}.txt"
            with open(stacks, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
            files.append(f"Python stacks {stacks}")
            if (trace := _flight_recorder()) is not None:
                path = hang_dir / f"flight-recorder-rank{self.rank}.json"
                path.write_text(trace)
                files.append(f"the last collectives (flight recorder) {path}")
        who = ("; ".join(f"rank {r} ({why})" for r, why in late) + " did not arrive") if late else \
            ("no rank is behind: every rank waits in the same place (a collective that does not match, or one "
             "stuck inside the communication library)" if self.world > 1 else "")
        latest = self.checkpoint_dir() if self.checkpoint_dir else None
        line = (f"[hybridtron rank {self.rank}/{self.world} {self.host}] hang: no progress for {stalled:.0f} s in "
                f"{self.name} at step {self.step} (train.hang_timeout_s={self.timeout_s:g})"
                + (f"; {who}" if who else "") + note
                + (f"; {', '.join(files)}" if files else "")
                + f"; exiting with code {HANG_EXIT} so that the job restarts from the latest checkpoint"
                + (f" ({latest})" if latest else " (none yet)"))
        print(line, file=self.err, flush=True)
        tell_launcher(line)  # torchrun's summary of the failed workers then ends with this line, not a docs link
        if self.last_stop is not None and self._first_to_report():
            with contextlib.suppress(OSError):
                from hybridtron.atomic import write_text_atomic

                write_text_atomic(self.last_stop, json.dumps({
                    "stopped_by": "hang", "step": self.step, "phase": self.name, "reported_by": self.rank,
                    "late_ranks": [r for r, _ in late], "late": [why for _, why in late], "checkpoint": latest,
                    "exit_code": HANG_EXIT}) + "\n")
        os._exit(HANG_EXIT)

    def _first_to_report(self) -> bool:
        if self.store is None:
            return True
        try:
            with self._lock:
                return int(self.store.add("hang_reports", 1)) == 1
        except Exception:
            return self.rank == 0


def diagnose(first: list[dict | None], second: list[dict | None]) -> tuple[list[tuple[int, str]], bool]:
    """From two readings of every rank's entry: (the late ranks with a reason each, whether any rank moved)."""
    late, moving = [], False
    keys = [(e["step"], e["count"]) for e in second if e is not None]
    front = max(keys) if keys else None
    for r, (a, b) in enumerate(zip(first, second, strict=True)):
        if b is None:
            late.append((r, "never reported: it did not start or cannot reach the store"))
            continue
        if a is not None and (a["step"], a["count"]) != (b["step"], b["count"]):
            moving = True
        if a is not None and a["beat"] == b["beat"]:  # its entry is as old as its last heartbeat
            late.append((r, f"host {b['host']}, last seen in {b['phase']} at step {b['step']}, not responding: "
                            f"stopped, dead or frozen"))
        elif (b["step"], b["count"]) < front:
            late.append((r, f"host {b['host']}, in {b['phase']} at step {b['step']}, behind the others"))
    return late, moving


def _excess(times: list[dict]) -> list[float]:
    """How much slower than the median rank each rank is, as a share: its busy time (step time less its waits for
    the others) over the median's, or its time not running over the median's in shares of its step time,
    whichever is larger. The second sees a rank the others wait for inside the model's own collectives (DDP's
    gradient all-reduce in the backward, FSDP's gathers), where no wait of theirs is timed."""
    busy = statistics.median(t["busy_s"] for t in times)
    stall = statistics.median(t["stall_s"] for t in times)
    return [max(t["busy_s"] / busy - 1 if busy > 0 else 0.0, (t["stall_s"] - stall) / max(t["step_s"], 1e-9))
            for t in times]


def find_stragglers(times: list[dict], margin: float) -> list[dict]:
    """The ranks more than ``margin`` slower than the median rank (``_excess``), each with its split, how much
    slower, and the median busy time."""
    if margin <= 0 or len(times) < 2:
        return []
    busy = statistics.median(t["busy_s"] for t in times)
    return [t | {"slower": round(x, 3), "median_busy_s": round(busy, 4)}
            for t, x in zip(times, _excess(times), strict=True) if x > margin]


def split_summary(times: list[dict]) -> dict:
    """For metrics.jsonl: the median rank's seconds per step by part, and the slowest rank's (``_excess``)."""
    parts = ("step_s", "busy_s", "data_s", "compute_s", "wait_s", "stall_s")
    excess = _excess(times)
    i = max(range(len(times)), key=excess.__getitem__)
    slowest = times[i]
    return {"median": {k: round(statistics.median(t[k] for t in times), 4) for k in parts},
            "slowest": {"rank": slowest["rank"], "host": slowest["host"], "slower": round(excess[i], 3),
                        **{k: slowest[k] for k in parts}}}


def straggler_line(found: list[dict], first: int, last: int) -> str:
    parts = [f"rank {s['rank']} ({s['host']}) {100 * s['slower']:.0f}% slower than the median rank: per step "
             f"{s['step_s']:.3f} s of which data {s['data_s']:.3f}, compute {s['compute_s']:.3f}, waiting for others "
             f"{s['wait_s']:.3f}, not running {s['stall_s']:.3f} (median busy {s['median_busy_s']:.3f})"
             for s in found]
    return f"straggler{'s' if len(found) > 1 else ''} over steps {first}-{last}: " + "; ".join(parts)


def _flight_recorder() -> str | None:
    """torch's flight recorder (each group's last collectives: op, sizes, sequence number, state) as JSON, or None
    when it recorded nothing (no process group, or its buffer is off)."""
    try:
        import torch

        out = torch._C._distributed_c10d._dump_fr_trace_json(True, False)  # collectives included, not only active
        text = out if isinstance(out, str) else bytes(out).decode()
        return text if json.loads(text).get("entries") else None
    except Exception:
        return None


def flight_recorder_env(run_dir: Path) -> None:
    """Keep torch's flight recorder of each group's last collectives (NCCL and gloo alike), dumped into
    ``RUN_DIR/hang/`` by a reporting rank, and on NCCL by torch itself at a collective timeout. Read by torch when
    the process group is created; a value the user set wins."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(run_dir).resolve() / HANG_DIR / "nccl_trace_rank_"))


def watch_for(cfg, run_dir: Path, mesh, checkpoint_dir=None, last_stop: Path | None = None) -> Watch | None:
    """This process's watch for a run (None with ``train.hang_timeout_s: 0``), started; ``last_stop``: the run's
    last_stop.json, which the first rank to report a hang writes."""
    t = cfg.train
    if t.hang_timeout_s <= 0:
        return None
    store = None
    if mesh.distributed:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = _store_client(f"hybridtron/watch/{run}/{restart}/")
    return Watch(t.hang_timeout_s, run_dir, mesh.rank, mesh.world_size, store, margin=t.straggler_margin,
                 checkpoint_dir=checkpoint_dir, last_stop=last_stop).start()


def training_groups(mesh) -> list:
    """The process groups the training collectives run in (not the asynchronous checkpoint writes' own group,
    whose writes may take longer than a step)."""
    from torch.distributed import distributed_c10d as c10d

    if not mesh.distributed:
        return []
    return [g for g in list(c10d._world.pg_map) if g is not mesh.checkpoint_group]
