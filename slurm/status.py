"""``hybridtron status RUN_DIR``: the SLURM jobs of a run and where the run stands.

The job ids come from ``RUN_DIR/slurm/jobs.jsonl`` (written by ``hybridtron submit``): every job of every
submission, oldest first, so a job that failed before a resubmission stays in the history; their state from
``squeue`` (which knows a finished job for the cluster's MinJobAge), else ``sacct`` (where accounting is on).
The run's own files say the rest: the last logged step and loss (``metrics.jsonl``, and the slow ranks its last
record names), the latest complete checkpoint, why the trainer last stopped (``last_stop.json``), and the restarts
after failures that the job script made (``restarts.jsonl``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from hybridtron.configs import ConfigError
from hybridtron.slurm.submit import JOBS_FILE
from hybridtron.train.checkpoint_names import latest_checkpoint
from hybridtron.train.run_dir import LAST_STOP, read_restarts

TAIL_BYTES = 1 << 16  # the end of metrics.jsonl holds the last steps; a long run's file is not read whole


def add_arguments(sp) -> None:
    sp.add_argument("run_dir", metavar="RUN_OR_DATA_DIR",
                    help="the run directory given to hybridtron submit, or a data directory (data.out_dir; or a "
                         "source's .parts): parts done, rates and time left, or that the data is ready")
    sp.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def read_jobs(run_dir: Path) -> list[dict]:
    return read_jobs_file(run_dir / "slurm" / JOBS_FILE)


def read_jobs_file(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    jobs = []
    for line in path.read_text().splitlines():
        try:
            jobs.append(json.loads(line))
        except ValueError:
            continue  # a torn line from an interrupted submit
    return jobs


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    from hybridtron.slurm.cluster import find_binary

    exe = find_binary(cmd[0])
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def query_job(job_id: str) -> dict:
    """{state, reason, elapsed, limit, nodes, restarts, exit_code, source}; state "UNKNOWN" with the reason when
    neither squeue nor sacct can say."""
    res = _run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T|%r|%M|%l|%N"])
    why = "squeue is not available here" if res is None else None
    if res is not None and res.returncode == 0 and res.stdout.strip():
        state, reason, elapsed, limit, nodes = (res.stdout.strip().splitlines()[0].split("|") + [""] * 5)[:5]
        info = {"state": state, "reason": reason, "elapsed": elapsed, "limit": limit, "nodes": nodes,
                "source": "squeue"}
        show = _run(["scontrol", "show", "job", "-o", str(job_id)])
        for item in (show.stdout.split() if show is not None and show.returncode == 0 else []):
            key, _, value = item.partition("=")
            if key in ("Restarts", "ExitCode"):
                info["restarts" if key == "Restarts" else "exit_code"] = value
        return info
    if res is not None and res.returncode != 0 and "invalid job id" not in res.stderr.lower():
        why = f"squeue failed: {' '.join(res.stderr.split())[:200]}"  # e.g. the controller is unreachable
    res = _run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State,ExitCode,Elapsed,Timelimit,NodeList"])
    if res is not None and res.returncode == 0 and res.stdout.strip():
        state, code, elapsed, limit, nodes = (res.stdout.strip().splitlines()[-1].split("|") + [""] * 5)[:5]
        return {"state": state, "exit_code": code, "elapsed": elapsed, "limit": limit, "nodes": nodes,
                "source": "sacct"}
    return {"state": "UNKNOWN", "source": None,
            "reason": why or "squeue no longer knows the job (it ended more than the cluster's MinJobAge ago) and "
                             "sacct has no record of it"}


def tail_metrics(run_dir: Path) -> tuple[dict | None, dict | None, dict | None]:
    """(the last metrics record, the last one with val_loss, the last one with the ranks' times: the latest window
    the straggler report judged) from the end of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None, None, None
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - TAIL_BYTES))
        lines = f.read().decode(errors="replace").splitlines()[1 if size > TAIL_BYTES else 0:]
    last = last_val = last_window = None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed write
        if not isinstance(rec, dict):
            continue
        last = last or rec
        last_val = last_val or (rec if "val_loss" in rec else None)
        last_window = last_window or (rec if "rank_times" in rec else None)
        if last_val and last_window:
            break
    return last, last_val, last_window


def collect(run_dir: Path) -> dict:
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise ConfigError(f"no run directory {run_dir}; give the --run-dir that hybridtron submit printed (or a data "
                          f"directory, data.out_dir, for how its preparation stands)")
    jobs = read_jobs(run_dir)  # the run's history: every submission's jobs (a --chain is one submission)
    scripts = list(dict.fromkeys(j.get("script") for j in jobs))
    out: dict = {"run_dir": str(run_dir), "jobs": [], "submissions": len(scripts)}
    for j in jobs:
        out["jobs"].append({"job_id": j["job_id"], "submission": scripts.index(j.get("script")) + 1,
                            "submitted": j.get("submitted"), **query_job(j["job_id"])})
    last, last_val, window = tail_metrics(run_dir)
    max_steps = None
    try:  # a missing or damaged config.yaml leaves the total out; the rest still shows
        max_steps = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train", {}).get("max_steps")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        pass
    out["step"] = last.get("step") if last else None
    out["max_steps"] = max_steps
    out["loss"] = last.get("loss") if last else None
    out["val_loss"] = last_val.get("val_loss") if last_val else None
    out["val_step"] = last_val.get("step") if last_val else None
    # the slow ranks of the latest window the straggler report judged (train/watchdog.py): none there, none now
    slow = window.get("stragglers") if window else None
    out["stragglers"] = [s for s in slow if isinstance(s, dict)] if isinstance(slow, list) else []
    out["stragglers_step"] = window.get("step") if window else None
    out["restarts"] = read_restarts(run_dir)
    latest = latest_checkpoint(run_dir)
    out["checkpoint"] = str(latest) if latest else None
    try:
        out["last_stop"] = json.loads((run_dir / LAST_STOP).read_text())
    except (OSError, ValueError):
        out["last_stop"] = None
    logs = sorted((run_dir / "logs").glob("job-*"), key=lambda p: p.stat().st_mtime) if (run_dir / "logs").is_dir() else []
    ids = {j["job_id"] for j in out["jobs"]}
    out["logs"] = [str(p) for p in logs if not ids or p.name.split(".")[0].removeprefix("job-") in ids]
    return out


def _job_line(j: dict) -> str:
    text = j["state"]
    if j.get("state") == "PENDING" and j.get("reason"):
        text += f" ({j['reason']})"
    if j.get("elapsed") and j.get("state") != "PENDING":
        text += f", ran {j['elapsed']}" + (f" of {j['limit']}" if j.get("limit") else "")
    if j.get("nodes") and j.get("state") != "PENDING":
        text += f" on {j['nodes']}"
    if j.get("restarts") not in (None, "0"):
        text += f", requeued {j['restarts']}x"
    if j.get("exit_code") not in (None, "0:0") and j.get("state") not in ("PENDING", "RUNNING"):
        text += f", exit {j['exit_code']}"
    if j.get("state") == "UNKNOWN":
        text += f" ({j.get('reason')})"
    return text


def _straggler(x: dict) -> str:
    """One slow rank of metrics.jsonl's "stragglers" (train/watchdog.py): how much slower than the median rank, its
    busy seconds per step (step time less waiting for the others) against the median's, and its time not running."""
    def num(v, fmt=".3f") -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "?"

    slower = x.get("slower")
    return (f"rank {x.get('rank')} ({x.get('host')}) "
            + (f"{num(100 * slower, '.0f')}% slower: " if isinstance(slower, (int, float)) else "")
            + f"busy {num(x.get('busy_s'))} s/step against a median of {num(x.get('median_busy_s'))}, not running "
            f"{num(x.get('stall_s'))}")


def format_status(s: dict) -> str:
    rows = [("run", s["run_dir"])]
    if not s["jobs"]:
        rows.append(("job", f"none submitted from here (no slurm/{JOBS_FILE}); hybridtron submit --run-dir "
                            f"{s['run_dir']} ..."))
    for j in s["jobs"]:
        when = f"submission {j['submission']} of {s['submissions']}" + (f", {j['submitted']}" if j.get("submitted")
                                                                          else "")
        rows.append((f"job {j['job_id']}", _job_line(j) + (f" ({when})" if s.get("submissions", 1) > 1 else "")))
    if s["step"] is None:
        rows.append(("progress", "no step logged yet"))
    else:
        text = f"step {s['step']}" + (f" of {s['max_steps']}" if s["max_steps"] else "")
        text += f", loss {s['loss']:.4f}" if isinstance(s["loss"], float) else ""
        if s["val_loss"] is not None:
            text += f", val_loss {s['val_loss']:.4f} at step {s['val_step']}"
        rows.append(("progress", text))
    if s.get("stragglers"):
        rows.append(("stragglers", f"over the window to step {s['stragglers_step']}: " + "; ".join(_straggler(x) for x in s["stragglers"])))
    rows.append(("checkpoint", s["checkpoint"] or "none yet"))
    if s.get("restarts"):
        r = s["restarts"][-1]
        jobs = {str(x.get("job_id")) for x in s["restarts"]}
        rows.append(("restarts", f"{len(s['restarts'])} after failures" + (f" in {len(jobs)} jobs" if len(jobs) > 1
                                                                           else "")
                     + f"; last: job {r.get('job_id')} restart {r.get('restart')} of {r.get('max_restarts')} at "
                       f"{r.get('time')}, {r.get('reason')} (exit {r.get('exit_code')}), from step "
                       f"{r.get('from_step')}"))
    if s["last_stop"]:
        stop = s["last_stop"]
        rows.append(("last stop", f"step {stop.get('step')} ({stop.get('stopped_by')})"))
    for i, log in enumerate(s["logs"] or ["none yet"]):
        rows.append(("logs" if i == 0 else "", log))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def collect_data(path: Path) -> dict:
    """A data directory's preparation (data_pipeline/prepare_tasks.py) and the jobs `submit prepare` made for it."""
    from hybridtron.data_pipeline.prepare_tasks import data_status
    from hybridtron.slurm.submit import PREPARE_DIR

    s = data_status(path)
    jobs = read_jobs_file(Path(s["data_dir"]) / PREPARE_DIR / JOBS_FILE)
    s["jobs"] = [{"job_id": j["job_id"], "stage": j.get("stage"), **query_job(j["job_id"])} for j in jobs[-3:]]
    for j in s["jobs"]:
        j["line"] = _job_line(j)
        if j.get("stage") == "tasks":  # an array: its tasks' states, counted (squeue shows the first task alone)
            res = _run(["squeue", "-h", "-t", "all", "-r", "-j", str(j["job_id"]), "-o", "%T"])
            states = res.stdout.split() if res is not None and res.returncode == 0 else []
            if states:
                count = {st: states.count(st) for st in dict.fromkeys(states)}
                j["tasks"] = count
                j["line"] = f"{len(states)} tasks: " + ", ".join(f"{n} {st}" for st, n in count.items())
    return s


def cmd_status(args) -> int:
    from hybridtron.data_pipeline.prepare_tasks import format_data_status, is_data_dir

    if is_data_dir(Path(args.run_dir)):
        s = collect_data(Path(args.run_dir))
        print(json.dumps(s) if args.json else format_data_status(s))
        return 0
    s = collect(Path(args.run_dir))
    print(json.dumps(s) if args.json else format_status(s))
    return 0
