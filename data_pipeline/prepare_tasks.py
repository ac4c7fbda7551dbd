"""``hybridtron submit prepare``: the parts of parts.py, tokenized by SLURM tasks on several nodes, then merged.

Three stages, each an ordinary ``hybridtron prepare`` process (slurm/prepare.sbatch runs them):

1. **plan** (``prepare --stage plan``, one process, under the data directory's exclusive lock): the tokenizer
   (trained, or found), then each source's parts planned exactly as a one-machine prepare plans them
   (``SOURCE/.parts/plan.json``, the same bytes: the plan depends on the files and ``data.part_mb`` alone).
   A source whose shards are complete and current gets no plan.
2. **tasks** (``prepare --stage task --task K --tasks N``, N processes anywhere on the cluster): the parts of all
   sources are numbered in order (source, then part) and task K takes those whose number is K modulo N, so each
   task gets every N-th part of every source (sizes spread evenly, and a source's parts go to all the tasks).
   A part already complete is skipped, so a task run again (a resubmission, a requeue) does only what is
   missing. Tasks write side by side, so none takes the exclusive lock: each holds the shared tasks lock
   (data_lock.py), which a ``prepare`` or ``train`` that works there refuses, and the lock of each part it writes,
   so it may clean that part's scratch (its own earlier attempt's, or a dead writer's) and never another live
   task's. A task uses ``data.workers`` processes on its node (0: its cores).
3. **merge** (a plain ``prepare``, after every task ended however it ended): the normal prepare, which finds the
   plan, keeps every complete part, tokenizes any part a failed task left (on its one node), and merges the
   parts in file order through the same split draw and shard writer as one process: the shards and manifests are
   byte-identical to a one-process prepare's.

``data_status`` reads a data directory for ``hybridtron status DATA_DIR``: parts done, bytes and tokens, rates
since the first part started, the time left, and once merged the documents, tokens and shards.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import as_completed
from pathlib import Path

from hybridtron.atomic import new_dirs_removed_on_failure, reclaim_scratch
from hybridtron.configs.job import DataConfig
from hybridtron.data_pipeline.data_dir import data_dir
from hybridtron.data_pipeline.data_lock import UNLOCKED, hold_as_task, hold_data_dir, part_lock
from hybridtron.data_pipeline.errors import DataError
from hybridtron.data_pipeline.parts import (
    FILES,
    PARTS_DIR,
    PLAN,
    PartJob,
    _init_worker,
    _prepare_parts_dir,
    part_done,
    part_job,
    parts_plan,
    plan_source,
    threads_per_worker,
    tokenize_part,
    worker_pool,
    workers_for,
)
from hybridtron.data_pipeline.progress import duration, size

STAGES = ("plan", "task")


def task_parts(counts: list[int], task: int, tasks: int) -> list[tuple[int, int]]:
    """(source, part) pairs of task ``task`` of ``tasks``, where source s has ``counts[s]`` parts: the g-th part
    over all sources in order goes to task g % tasks."""
    if not 0 <= task < tasks:
        raise DataError(f"task {task} of {tasks}: a task number runs from 0 to {tasks - 1}")
    pairs = [(s, k) for s, n in enumerate(counts) for k in range(n)]
    return pairs[task::tasks]


def _source_inputs(cfg: DataConfig, i: int, resolved) -> tuple[list, str, str, list]:
    """(stamps, inputs digest, key, ranges) of source ``i`` now: what its plan is made of."""
    from hybridtron.data_pipeline.prepare import _inputs_digest, _source_key
    from hybridtron.data_pipeline.sources import file_stamp

    files, fmt = resolved
    stamps = [file_stamp(f) for f in files]
    ranges = plan_source(stamps, fmt, cfg.part_mb * 1e6)
    return stamps, _inputs_digest(stamps), _source_key(cfg, i, fmt), ranges


def plan_stage(cfg: DataConfig, log: Callable = print) -> dict:
    """Stage 1: the tokenizer and every unfinished source's plan. Returns {source: parts planned (0: complete)}."""
    from hybridtron.data_pipeline.prepare import (
        SPLITS,
        _compare_inputs,
        _set_threads,
        get_tokenizer,
        prepare_data,
        source_changed,
        source_names,
    )
    from hybridtron.data_pipeline.shards import read_manifest
    from hybridtron.data_pipeline.sources import resolve_files

    cfg.validate()
    if cfg.synthetic.task:  # generated rows: only a tokenizer, nothing to split
        prepare_data(cfg, log)
        return {}
    out = data_dir(cfg)
    with hold_data_dir(out), new_dirs_removed_on_failure(out):
        names = source_names(cfg)
        reclaim_scratch(out, out / "tokenizer", *[out / n / s for n in names for s in SPLITS], log=log)
        resolved = [resolve_files(src) for src in cfg.sources]
        out.mkdir(parents=True, exist_ok=True)
        _set_threads(cfg)
        get_tokenizer(cfg, out, log)
        planned: dict[str, int] = {}
        for i, name in enumerate(names):
            stamps, digest, key, ranges = _source_inputs(cfg, i, resolved[i])
            manifests = [read_manifest(out / name / s) or {} for s in SPLITS]
            if all(m.get("complete") for m in manifests):
                change, _ = _compare_inputs((manifests[0].get("source") or {}).get("files"), stamps)
                if change is None:
                    log(f"{name}: shards complete and current; nothing to tokenize")
                    planned[name] = 0
                    continue
                if cfg.on_source_change == "error":
                    raise source_changed(name, change, out)
            done = _prepare_parts_dir(out / name / PARTS_DIR, parts_plan(key, digest, cfg.part_mb, ranges), log,
                                      stamps)
            planned[name] = len(ranges)
            log(f"{name}: {len(ranges)} parts of <= {cfg.part_mb:g} MB ({size(sum(s[1] for s in stamps))} in "
                f"{len(stamps)} files), {len(done)} already done")
        log(f"planned {sum(planned.values())} parts in {out}; the tasks tokenize them, then the merge writes the "
            f"shards")
        return planned


def _clear_part(directory: Path, k: int) -> None:
    """What an earlier attempt at part ``k`` left (its scratch, a .bin/.idx without the .json): only under that
    part's lock, so never a live writer's."""
    stem = f"part-{k:05d}"
    for f in directory.iterdir():
        if f.name.startswith(f".{stem}.") or f.name in (f"{stem}.bin", f"{stem}.idx", f"{stem}.json"):
            f.unlink(missing_ok=True)


def task_stage(cfg: DataConfig, task: int, tasks: int, log: Callable = print) -> int:
    """Stage 2: tokenize task ``task``'s parts of ``tasks``; returns how many it tokenized."""
    from hybridtron.data_pipeline.prepare import source_names
    from hybridtron.data_pipeline.sources import resolve_files

    cfg.validate()
    if tasks < 1:
        raise DataError(f"--tasks {tasks} must be at least 1")
    task_parts([], task, tasks)  # the task number's range
    if cfg.synthetic.task:
        return 0
    out = data_dir(cfg)
    if not (out / "tokenizer").is_dir():
        raise DataError(f"{out} holds no tokenizer: the plan stage (`hybridtron prepare --stage plan`, the first job "
                        f"of `hybridtron submit prepare`) has not run there, or failed (its log says why); submit again")
    names = source_names(cfg)
    with hold_as_task(out):
        counts, inputs = [], []
        for i, name in enumerate(names):
            try:
                plan = json.loads((out / name / PARTS_DIR / PLAN).read_text())
            except (OSError, ValueError):
                counts.append(0)  # complete (no plan), or merged already
                inputs.append(None)
                continue
            resolved = resolve_files(cfg.sources[i])
            stamps, digest, key, ranges = _source_inputs(cfg, i, resolved)
            if parts_plan(key, digest, cfg.part_mb, ranges) != plan:
                raise DataError(f"source {name!r}: its files or settings changed since the plan stage planned its parts "
                                f"in {out / name / PARTS_DIR}; submit again (its plan job plans them anew)")
            counts.append(len(ranges))
            inputs.append((stamps, resolved[1], ranges))
        mine = task_parts(counts, task, tasks)
        locks: list[int] = []
        jobs: list[PartJob] = []
        done = busy = 0
        try:
            for i, k in mine:
                directory = out / names[i] / PARTS_DIR
                if part_done(directory, k) is not None:
                    done += 1
                    continue
                fd = part_lock(directory / f"part-{k:05d}.lock")
                if fd is None:  # another live task (of another submission) writes it
                    busy += 1
                    continue
                if fd != UNLOCKED:
                    locks.append(fd)
                if part_done(directory, k) is not None:  # finished by that other task as we took the lock
                    done += 1
                    continue
                _clear_part(directory, k)
                stamps, fmt, ranges = inputs[i]
                jobs.append(part_job(cfg, i, names[i], k, ranges[k], stamps, fmt, out / "tokenizer", directory,
                                    str(out / ".hf_cache"), 1))
            workers, threads = _task_processes(cfg, len(jobs))
            for j in jobs:
                j.threads = threads
            log(f"task {task} of {tasks} on {socket.gethostname()} (pid {os.getpid()}): {len(mine)} of "
                f"{sum(counts)} parts are this task's, {done} already done"
                + (f", {busy} being written by another task" if busy else "")
                + f"; tokenizing {len(jobs)} with {workers} worker processes x {threads} tokenizer threads")
            _run_jobs(jobs, workers, threads, task, tasks, log)
        finally:
            for fd in locks:
                os.close(fd)
    return len(jobs)


def node_cores() -> int:
    """The cores this task may use: SLURM's CPUs per task where it says, else this process's CPU affinity (a node
    shared with other jobs has more cores than are this task's)."""
    try:
        return max(1, int(os.environ.get("SLURM_CPUS_PER_TASK", "")))
    except ValueError:
        pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _task_processes(cfg: DataConfig, n_jobs: int) -> tuple[int, int]:
    """(worker processes, tokenizer threads each) of a task: data.workers and data.num_workers where set, else the
    task's cores (node_cores) shared out."""
    if cfg.workers:
        workers = workers_for(cfg, n_jobs)
    else:
        workers = max(1, min(node_cores(), n_jobs))
    threads = cfg.num_workers or (threads_per_worker(cfg, workers) if cfg.workers else max(1, node_cores() // workers))
    return workers, threads


def _run_jobs(jobs: list[PartJob], workers: int, threads: int, task: int, tasks: int, log: Callable) -> None:
    if not jobs:
        return
    total = sum(j.nbytes for j in jobs)
    t0 = time.monotonic()
    got = {"bytes": 0, "tokens": 0, "parts": 0}

    def report(rec: dict) -> None:
        got["parts"] += 1
        got["bytes"] += rec["bytes"]
        got["tokens"] += rec["n_tokens"]
        el = max(time.monotonic() - t0, 1e-9)
        rate = got["bytes"] / el
        left = (total - got["bytes"]) / rate if rate > 0 else 0
        log(f"task {task} of {tasks}: part {rec['index']} of {rec['source']} done; {got['parts']} of {len(jobs)} "
            f"parts, {size(got['bytes'])} of {size(total)}, {rate / 1e6:.2f} MB/s, {got['tokens'] / el:,.0f} "
            f"tokens/s" + (f", about {duration(left)} left" if got["parts"] < len(jobs) else ""))

    if workers == 1:  # in this process: no pool to start, and a kill of the task is a kill of the tokenizing
        _init_worker(threads)
        for j in jobs:
            report({**tokenize_part(j), "source": j.name})
        return
    with worker_pool(workers, threads) as pool:
        futures = {pool.submit(tokenize_part, j): j for j in jobs}
        for f in as_completed(futures):
            report({**f.result(), "source": futures[f].name})


# ---- hybridtron status DATA_DIR -----------------------------------------------------------------
def is_data_dir(path: Path) -> bool:
    """Whether ``path`` looks like a prepared-data directory (or a source's .parts) rather than a run directory."""
    path = Path(path)
    if path.name == PARTS_DIR:
        return True
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file() or (path / "slurm").is_dir():
        return False
    return (path / "tokenizer").is_dir() or any(path.glob(f"*/{PARTS_DIR}/{PLAN}")) or \
        any(path.glob("*/train/manifest.json"))


def data_status(path: Path, now: float | None = None) -> dict:
    """Where a data directory's preparation stands (see the module's docstring)."""
    from hybridtron.configs import ConfigError
    from hybridtron.data_pipeline.shards import read_manifest

    path = Path(path).resolve()
    if path.name == PARTS_DIR:
        path = path.parent.parent
    if not path.is_dir():
        raise ConfigError(f"no data directory {path}; give the data.out_dir that `hybridtron prepare` (or `submit "
                          f"prepare`) printed")
    now = time.time() if now is None else now
    sources = []
    for d in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "tokenizer"):
        manifests = [read_manifest(d / s) for s in ("train", "val")]
        plan_path = d / PARTS_DIR / PLAN
        if all(m and m.get("complete") for m in manifests) and not plan_path.is_file():
            sources.append({"name": d.name, "state": "ready",
                            "docs": sum(m["n_docs"] for m in manifests), "tokens": sum(m["n_tokens"] for m in manifests),
                            "train_docs": manifests[0]["n_docs"], "val_docs": manifests[1]["n_docs"],
                            "shards": sum(len(m["shards"]) for m in manifests)})
        elif plan_path.is_file():
            try:
                plan = json.loads(plan_path.read_text())
                stamps = json.loads((d / PARTS_DIR / FILES).read_text())
            except (OSError, ValueError):
                plan, stamps = {"parts": []}, []
            recs = [part_done(d / PARTS_DIR, k) for k in range(len(plan["parts"]))]
            done = [r for r in recs if r is not None]
            sources.append({
                "name": d.name, "state": "parts", "parts": len(recs), "parts_done": len(done),
                "bytes": sum(s[1] for s in stamps), "bytes_done": sum(r.get("bytes", 0) for r in done),
                "tokens_done": sum(r["n_tokens"] for r in done),
                "started": min((r["started"] for r in done if "started" in r), default=None),
                "finished": max((r["finished"] for r in done if "finished" in r), default=None),
                "shards_docs": sum(m["n_docs"] for m in manifests if m)})
        elif any(manifests):
            sources.append({"name": d.name, "state": "writing", "docs": sum(m["n_docs"] for m in manifests if m),
                            "tokens": sum(m["n_tokens"] for m in manifests if m)})
    if not sources and not (path / "tokenizer").is_dir():
        raise ConfigError(f"{path} holds no prepared data, parts or tokenizer; run `hybridtron prepare` (or `hybridtron "
                          f"submit prepare`) for it, or give the data directory that one printed")
    s: dict = {"data_dir": str(path), "sources": sources, "tokenizer": (path / "tokenizer").is_dir()}
    parts = [x for x in sources if x["state"] == "parts"]
    if parts:
        tot = {k: sum(x[k] for x in parts) for k in ("parts", "parts_done", "bytes", "bytes_done", "tokens_done")}
        starts = [x["started"] for x in parts if x["started"] is not None]
        ends = [x["finished"] for x in parts if x["finished"] is not None]
        all_done = tot["parts_done"] == tot["parts"]
        elapsed = ((max(ends) if all_done else now) - min(starts)) if starts else 0.0
        tot["elapsed_s"] = elapsed
        tot["mb_s"] = tot["bytes_done"] / elapsed / 1e6 if elapsed > 0 else None
        tot["tokens_s"] = tot["tokens_done"] / elapsed if elapsed > 0 else None
        rate = tot["bytes_done"] / elapsed if elapsed > 0 else 0
        tot["eta_s"] = 0.0 if all_done else ((tot["bytes"] - tot["bytes_done"]) / rate if rate > 0 else None)
        s["parts"] = tot
    s["ready"] = bool(sources) and all(x["state"] == "ready" for x in sources)
    return s


def format_data_status(s: dict) -> str:
    rows = [("data", s["data_dir"])]
    for j in s.get("jobs", []):
        rows.append((f"job {j['job_id']}", f"{j.get('stage', '')}: {j.get('line', j.get('state'))}"))
    for x in s["sources"]:
        if x["state"] == "ready":
            text = (f"ready: {x['docs']:,} documents ({x['train_docs']:,} train, {x['val_docs']:,} val), "
                    f"{x['tokens']:,} tokens, {x['shards']} shards")
        elif x["state"] == "parts":
            text = (f"parts {x['parts_done']} of {x['parts']} done, {size(x['bytes_done'])} of {size(x['bytes'])}, "
                    f"{x['tokens_done']:,} tokens")
        else:
            text = f"writing shards (one process): {x['docs']:,} documents, {x['tokens']:,} tokens so far"
        rows.append((x["name"], text))
    p = s.get("parts")
    if p:
        text = f"{p['parts_done']} of {p['parts']} parts, {size(p['bytes_done'])} of {size(p['bytes'])}"
        if p["mb_s"] is not None:
            text += (f", {size(p['mb_s'] * 1e6)}/s, {p['tokens_s']:,.0f} tokens/s over {duration(p['elapsed_s'])}")
        if p["parts_done"] == p["parts"]:
            text += "; all parts done: the merge writes the shards (or run `hybridtron prepare` to merge)"
        elif p["eta_s"] is not None:
            text += f", about {duration(p['eta_s'])} left"
        else:
            text += "; no part done yet"
        rows.append(("progress", text))
    if s["ready"]:
        docs = sum(x["docs"] for x in s["sources"])
        toks = sum(x["tokens"] for x in s["sources"])
        shards = sum(x["shards"] for x in s["sources"])
        rows.append(("state", f"ready: {docs:,} documents, {toks:,} tokens, {shards} shards; train reads it"))
    elif not s["sources"]:
        rows.append(("state", "a tokenizer, no shards (a synthetic task's data, or a prepare that stopped early)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
