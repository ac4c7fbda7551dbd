"""``hybridtron submit``: validate a run, render its sbatch script from a template, submit it with ``sbatch``.

Everything that can be judged on the login node is judged before anything is written or submitted: the config
(with its overrides), its parallel layout against nodes x processes per node, a resumed run directory's model
and data, whether another process trains into it (its lock), the data sources, the time limit against the
warning, and (through ``sinfo``) the partition and its node count. What only SLURM can judge (an account, a QOS, GPUs it does not have) comes back as ``sbatch``'s
own reason, in one line.

The job trains the config exactly as validated: it is written to ``RUN_DIR/slurm/submit-<stamp>.yaml`` and the
script points at that copy. The template (``slurm/template.sbatch``) is plain bash with ``{{ name }}``
placeholders; ``--template`` takes a user's own copy.
"""

from __future__ import annotations

import copy
import glob
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridtron.configs import ConfigError

TEMPLATE = Path(__file__).with_name("template.sbatch")
PREPARE_TEMPLATE = Path(__file__).with_name("prepare.sbatch")  # `submit prepare`: data_pipeline/prepare_tasks.py
PREPARE_DIR = ".slurm"  # DATA_DIR/.slurm: `submit prepare`'s scripts, configs, logs and jobs.jsonl
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
JOBS_FILE = "jobs.jsonl"  # RUN_DIR/slurm/jobs.jsonl: one line per submitted job, read by `hybridtron status`
DEFAULT_WARNING_S = 300
DEFAULT_MAX_RESTARTS = 3
SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class SlurmError(ConfigError):
    """SLURM refused or could not be asked (exit code 2, one line): its own reason, and what to do."""


# ---- arguments ----------------------------------------------------------------------------------
def add_arguments(sp) -> None:
    """``hybridtron submit``'s options (``--config``, ``--run-dir`` and the dotted overrides come from the CLI)."""
    g = sp.add_argument_group("allocation")
    g.add_argument("--nodes", type=int, default=1, help="nodes (one torchrun each; default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8; 0: a CPU job on gloo)")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="training processes per node (default: --gpus-per-node, or 1 for a CPU job)")
    g.add_argument("--cpus-per-node", type=int, default=None, help="CPUs per node (sbatch --cpus-per-task)")
    g.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    g.add_argument("--time", default=None, metavar="[D-]HH:MM:SS", help="time limit (default: the partition's)")
    g.add_argument("--account", default=None)
    g.add_argument("--qos", default=None)
    g.add_argument("--constraint", default=None, help="node features, e.g. 'h100&ib'")
    g.add_argument("--exclusive", action="store_true", help="whole nodes, shared with no other job")
    g.add_argument("--job-name", default=None, help="default: hx-<run directory name>")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="--OPT=VALUE",
                   help="one more #SBATCH line, e.g. --sbatch-arg=--mem=0 (repeat)")
    g.add_argument("--container-image", default=None, help="run each node's torchrun in this image (pyxis/enroot)")
    g.add_argument("--container-mounts", default=None, help="pyxis --container-mounts, e.g. /lustre:/lustre")
    g = sp.add_argument_group("time limit, preemption, chains")
    g.add_argument("--warning-seconds", type=int, default=DEFAULT_WARNING_S,
                   help=f"SIGUSR1 this long before the time limit: checkpoint, then requeue (default "
                        f"{DEFAULT_WARNING_S}; at least one step plus one checkpoint)")
    g.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="N",
                   help=f"after a failure (a process or node killed, a hang) train again from the latest checkpoint "
                        f"in the same allocation, at most N times per job (default {DEFAULT_MAX_RESTARTS}; 0: never)")
    g.add_argument("--chain", type=int, default=1, metavar="N",
                   help="submit N jobs, each starting when the previous one ends (afterany), each resuming the run")
    g.add_argument("--dependency", default=None, help="sbatch --dependency of the (first) job, e.g. afterok:123")
    g = sp.add_argument_group("submit prepare (tokenize across nodes; docs/data.md)")
    g.add_argument("--array", type=int, default=None, metavar="N",
                   help="`submit prepare`: N array tasks of one node each (default: one job of --nodes nodes, a task "
                        "on each)")
    g = sp.add_argument_group("script")
    g.add_argument("--template", default=None, help=f"your own sbatch template (default {TEMPLATE})")
    g.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    g.add_argument("--show-template", action="store_true", help="print the template (to copy and own) and exit")


# ---- validation ---------------------------------------------------------------------------------
def parse_time(value: str) -> int | None:
    """A SLURM time limit in seconds: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``;
    None for no limit (``0``, ``UNLIMITED``, ``INFINITE``)."""
    text = value.strip()
    if text.upper() in ("0", "UNLIMITED", "INFINITE"):
        return None
    m = SLURM_TIME.match(text)
    if not m:
        raise ConfigError(f"--time {value!r} is not a SLURM time limit; write HH:MM:SS, D-HH:MM:SS or minutes "
                          f"(e.g. 24:00:00, 2-00:00:00, 90)")
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # HH:MM:SS
        return a * 3600 + b * 60 + c
    return a * 60 + (b or 0)  # MM[:SS]


def check_numbers(args) -> int:
    """The allocation's numbers; returns the processes per node."""
    for name in ("nodes", "chain"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be at least 1")
    if args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} must be 0 (a CPU job) or more")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (args.gpus_per_node or 1)
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc} must be at least 1")
    if args.gpus_per_node and nproc != args.gpus_per_node:
        raise ConfigError(f"--nproc-per-node {nproc} with --gpus-per-node {args.gpus_per_node}: each training process "
                          f"drives one GPU; make them equal (or leave --nproc-per-node out)")
    if args.cpus_per_node is not None and args.cpus_per_node < nproc:
        raise ConfigError(f"--cpus-per-node {args.cpus_per_node} is fewer than the {nproc} processes per node; "
                          f"give each at least one CPU")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be 0 (no restart after a failure) or more")
    if args.warning_seconds < 1:
        raise ConfigError(f"--warning-seconds {args.warning_seconds} must be positive (time for one step and a "
                          f"checkpoint before the time limit)")
    if args.time is not None:
        limit = parse_time(args.time)
        if limit is not None and args.warning_seconds >= limit:
            raise ConfigError(f"--warning-seconds {args.warning_seconds} is not shorter than --time {args.time} "
                              f"({limit} s): the job would be told to stop as it starts; lengthen --time or shorten "
                              f"the warning")
    return nproc


def check_layout(cfg, nodes: int, nproc: int, gpus_per_node: int) -> int:
    """The config's parallel layout on nodes x nproc processes (ConfigError naming both), returns dp."""
    from hybridtron.train.parallel.layout import target_layout

    p = cfg.parallel
    world, others = nodes * nproc, p.tp * p.pp * p.cp
    if (p.dp == -1 and world % others) or (p.dp != -1 and p.dp * others != world):
        need = f"a multiple of {others}" if p.dp == -1 else str(p.dp * others)
        raise ConfigError(f"--nodes {nodes} x {nproc} processes per node = {world} processes, but the layout "
                          f"parallel.dp={p.dp} x tp={p.tp} x pp={p.pp} x cp={p.cp} needs {need}; change --nodes / "
                          f"--gpus-per-node or the parallel section")
    if p.tp > nproc:
        raise ConfigError(f"parallel.tp={p.tp} spans more than one node ({nproc} processes per node): tensor "
                          f"parallel ranks exchange activations every layer and must share a node; lower tp")
    if gpus_per_node == 0 and p.backend == "nccl":
        raise ConfigError("parallel.backend=nccl needs GPUs, but --gpus-per-node is 0 (a CPU job); use "
                          "parallel.backend=gloo or auto, or ask for GPUs")
    return target_layout(cfg, world).dp  # every layout and kernel rule, for the cluster's devices


def check_sources(cfg) -> None:
    """Every data source names something that exists (relative to this directory, the job's too)."""
    for src in cfg.data.sources:
        if src.path == "stdlib" or "://" in src.path:  # a URL: prepare checks it before any work (remote.py)
            continue
        p = Path(src.path).expanduser()
        if not p.exists() and not glob.glob(str(p), recursive=True):
            raise ConfigError(f"data source {src.path!r} matches no file or directory (from {Path.cwd()}, the job's "
                              f"working directory too); fix data.sources, or submit from the directory it is relative to")


def check_resume(cfg, run_dir: Path) -> None:
    """A run directory that already holds a run continues only with its model and data (as the job would check
    after its queue wait): the same check, now."""
    from hybridtron.train.run_dir import check_resume_compatible, read_saved_config

    saved = read_saved_config(run_dir)
    if saved is None:
        return
    probe = copy.deepcopy(cfg)
    if not probe.model.vocab_size:  # derived from the tokenizer at the start of training; compare the run's
        probe.model.vocab_size = (saved.get("model") or {}).get("vocab_size", 0)
    check_resume_compatible(probe, run_dir)


def check_run_lock(run_dir: Path, dependency: str | None, dry_run: bool, note) -> None:
    """A run directory another process trains into is refused now, not after the queue wait when the job starts
    (and is refused by the lock at once). A job that waits for another (``--dependency``, the holder's job say)
    may start after the holder ends, and a dry run submits nothing: for those a note says it."""
    from hybridtron.train.run_lock import probe_holder

    holder = probe_holder(run_dir)
    if holder is None:
        return
    job = re.search(r"SLURM job (\S+)", holder)
    busy = f"--run-dir {run_dir} is in use by another training process ({holder})"
    if dependency or dry_run:
        note(f"note: {busy}; " + (f"the job waits for --dependency {dependency}, and is refused when it starts if "
                                  f"that process still trains" if dependency else "without --dry-run this submission would be refused"))
        return
    raise ConfigError(f"{busy}; wait for it to end or stop it, submit with --dependency "
                      f"afterany:{job[1] if job else 'JOB'} to start after it, or choose another --run-dir")


def check_path(path: Path, what: str) -> None:
    if re.search(r"\s|%", str(path)):
        raise ConfigError(f"{what} {str(path)!r} holds a space or '%', which #SBATCH lines cannot carry (SLURM reads "
                          f"'%' as a pattern); choose a path without them")


def slurm_binary(name: str) -> str:
    from hybridtron.slurm.cluster import find_binary

    path = find_binary(name)
    if path is None:
        raise SlurmError(f"{name} not found: submit from a SLURM login node (or put SLURM's bin directory on PATH); "
                         f"--dry-run prints the script without SLURM")
    return path


def check_partition(partition: str | None, nodes: int, note=print) -> None:
    """The partition exists and has at least ``nodes`` nodes, by ``sinfo``; when sinfo cannot answer the check
    is skipped and ``note`` says so (sbatch then judges the request alone)."""
    from hybridtron.slurm.cluster import find_binary

    what = (f"--partition {partition!r}" if partition else "the default partition") + f" and --nodes {nodes}"
    sinfo = find_binary("sinfo")
    if sinfo is None:
        note(f"note: SLURM's sinfo is not installed here, so {what} were not checked against the cluster")
        return
    try:
        res = subprocess.run([sinfo, "-h", "-o", "%P %D"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        note(f"note: sinfo did not answer ({type(e).__name__}), so {what} were not checked against the cluster")
        return
    if res.returncode != 0:  # sbatch will say what is wrong
        note(f"note: sinfo failed ({(res.stderr.strip().splitlines() or ['no message'])[-1][:160]}), so {what} "
             f"were not checked against the cluster")
        return
    sizes: dict[str, int] = {}
    default = None
    for line in res.stdout.split("\n"):
        if len(line.split()) != 2:
            continue
        name, count = line.split()
        if name.endswith("*"):
            name = default = name[:-1]
        sizes[name] = sizes.get(name, 0) + int(count) if count.isdigit() else sizes.get(name, 0)
    if not sizes:
        return
    if partition is not None and partition not in sizes:
        raise SlurmError(f"--partition {partition!r} does not exist on this cluster; its partitions: "
                         f"{', '.join(sorted(sizes))} (sinfo)")
    name = partition or default
    if name is not None and nodes > sizes[name]:
        raise SlurmError(f"--nodes {nodes} is more than partition {name!r} has ({sizes[name]} nodes, sinfo); ask "
                         f"for at most {sizes[name]} or choose another --partition")


# ---- rendering ----------------------------------------------------------------------------------
@dataclass
class Job:
    """Everything the template needs, resolved and validated."""

    run_dir: Path
    config_path: Path
    script_path: Path
    log_dir: Path
    values: dict[str, str] = field(default_factory=dict)


def render(template: str, values: dict[str, str], source: str = "the template") -> str:
    """Replace every ``{{ name }}``; a name the values do not have is an error naming it and the known ones."""
    unknown = sorted({m.group(1) for m in PLACEHOLDER.finditer(template)} - set(values))
    if unknown:
        raise ConfigError(f"{source} uses {', '.join('{{ ' + u + ' }}' for u in unknown)}, which hybridtron does not "
                          f"fill; the placeholders are: {', '.join(sorted(values))}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def sbatch_options(args) -> list[str]:
    opts = []
    for flag, value in (("partition", args.partition), ("time", args.time), ("account", args.account),
                        ("qos", args.qos), ("constraint", args.constraint)):
        if value:
            opts.append(f"--{flag}={value}")
    if args.gpus_per_node:
        opts.append(f"--gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_node:
        opts.append(f"--cpus-per-task={args.cpus_per_node}")
    if args.exclusive:
        opts.append("--exclusive")
    for extra in args.sbatch_arg:
        if not extra.startswith("-"):
            raise ConfigError(f"--sbatch-arg {extra!r} is not an sbatch option; write it as --sbatch-arg=--mem=0")
        opts.append(extra)
    return opts


def torchrun_path(container: bool) -> str:
    if container:
        return "torchrun"  # the image's
    beside = Path(sys.executable).parent / "torchrun"  # the environment this command runs in (shared with the nodes)
    found = str(beside) if beside.is_file() else shutil.which("torchrun")
    if not found:
        raise ConfigError(f"torchrun not found beside {sys.executable} nor on PATH; install torch in this environment")
    return found


def build_job(args) -> tuple[Job, str, str]:
    """Validate everything and render: (job, script text, config YAML)."""
    from hybridtron.train.run_dir import check_run_paths, resolve_data_dir, resolve_job

    nproc = check_numbers(args)
    cfg, run_dir = resolve_job(args)  # the config and its overrides, validated
    resolve_data_dir(cfg, run_dir)  # the job's config names its data directory (relative to the working directory)
    run_dir = run_dir.resolve()
    check_path(run_dir, "--run-dir")
    check_run_paths(cfg, run_dir)  # a run or data directory the job could not write: said here, not in the job log
    check_path(Path.cwd(), "the working directory")
    dp = check_layout(cfg, args.nodes, nproc, args.gpus_per_node)
    # a user's DeepSpeed JSON the job cannot honour: refused now, not when the job starts
    from hybridtron.train.parallel.deepspeed_engine import check_config

    check_config(cfg, dp, "cuda" if args.gpus_per_node else "cpu")
    check_sources(cfg)
    check_resume(cfg, run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    job = Job(run_dir, run_dir / "slurm" / f"submit-{stamp}.yaml", run_dir / "slurm" / f"submit-{stamp}.sbatch",
              run_dir / "logs")
    template_path = Path(args.template) if args.template else TEMPLATE
    try:
        template = template_path.read_text()
    except OSError as e:
        raise ConfigError(f"--template {template_path}: {e.strerror or e}; give a readable file") from None
    container = bool(args.container_image)
    srun = []
    if container:
        srun += [f"--container-image={args.container_image}", f"--container-workdir={Path.cwd()}"]
        if args.container_mounts:
            srun.append(f"--container-mounts={args.container_mounts}")
    values = {
        "template": str(template_path.resolve()),
        "command": command_line(args),
        "resubmit_q": shlex.quote(command_line(args, resubmit=True)),
        "job_name": args.job_name or f"hx-{run_dir.name}",
        "nodes": str(args.nodes),
        "nproc_per_node": str(nproc),
        "max_steps": str(cfg.train.max_steps),
        "sbatch_options": "\n".join(f"#SBATCH {o}" for o in sbatch_options(args)) or "#",
        "workdir": str(Path.cwd()),
        "log_dir": str(job.log_dir),
        "log_dir_q": shlex.quote(str(job.log_dir)),
        "run_dir_q": shlex.quote(str(run_dir)),
        "config_q": shlex.quote(str(job.config_path)),
        "torchrun_q": shlex.quote(torchrun_path(container)),
        "srun_options": "".join(shlex.quote(o) + " " for o in srun),
        "warning_seconds": str(args.warning_seconds),
        "max_restarts": str(args.max_restarts),
    }
    job.values = values
    return job, render(template, values, str(template_path)), cfg.to_yaml()


# ---- submission ---------------------------------------------------------------------------------
def sbatch(script: Path, dependency: str | None) -> str:
    cmd = [slurm_binary("sbatch"), "--parsable"] + ([f"--dependency={dependency}"] if dependency else []) + [str(script)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise SlurmError("sbatch did not answer within 120 s (slurmctld down or unreachable?); check `sinfo`, then "
                         "submit again") from None
    if res.returncode != 0:
        why = " ".join(ln.strip() for ln in (res.stderr or res.stdout).strip().splitlines()) or f"exit {res.returncode}"
        raise SlurmError(f"sbatch refused the job: {why}; the script is {script}")
    return res.stdout.strip().split(";")[0]


def submit(args, out=print) -> list[str]:
    """Validate, render, and (unless --dry-run) write the script and config into the run directory and sbatch
    it ``--chain`` times; returns the job ids."""
    job, script, config_yaml = build_job(args)
    check_run_lock(job.run_dir, args.dependency, args.dry_run,
                   note=lambda msg: print(f"hybridtron submit: {msg}", file=sys.stderr))
    if args.dry_run:
        out(script)
        # stdout: the script alone; the note on stderr, as our line
        check_partition(args.partition, args.nodes, note=lambda msg: print(f"hybridtron submit: {msg}", file=sys.stderr))
        return []
    slurm_binary("sbatch")
    check_partition(args.partition, args.nodes, note=out)
    for d in (job.script_path.parent, job.log_dir):
        d.mkdir(parents=True, exist_ok=True)
    job.config_path.write_text(config_yaml)
    job.script_path.write_text(script)
    job.script_path.chmod(0o755)
    ids: list[str] = []
    for i in range(args.chain):
        dep = args.dependency if i == 0 else f"afterany:{ids[-1]}"
        ids.append(sbatch(job.script_path, dep))
        with open(job.script_path.parent / JOBS_FILE, "a") as f:
            f.write(json.dumps({"job_id": ids[-1], "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "script": str(job.script_path), "config": str(job.config_path),
                                "nodes": args.nodes, "nproc_per_node": int(job.values["nproc_per_node"]),
                                "dependency": dep, "chain": [i + 1, args.chain]}) + "\n")
    out(f"submitted job{'s' if len(ids) > 1 else ''} {', '.join(ids)}"
        + (" (each starts when the previous one ends)" if len(ids) > 1 else ""))
    out(f"run directory: {job.run_dir}")
    out(f"script:        {job.script_path}")
    out(f"job log:       {job.log_dir}/job-{ids[0]}.out")
    out(f"node logs:     {job.log_dir}/job-{ids[0]}.<attempt>.node<N>.log")
    out(f"status:        hybridtron status {job.run_dir}")
    return ids


def command_line(args, resubmit: bool = False) -> str:
    """The ``hybridtron submit`` command these arguments came from; ``resubmit``: the one that continues the run
    (absolute run directory, from the same working directory, without chain or dependency)."""
    prepare = getattr(args, "what", "train") == "prepare"
    parts = ["hybridtron", "submit"] + (["prepare"] if prepare else [])
    skip = {"chain", "dependency"} if resubmit else set()
    if prepare:  # a CPU job; --nodes 1 with --array
        skip |= {"gpus_per_node", "warning_seconds", "max_restarts"} | ({"nodes"} if args.nodes == 1 else set())
    defaults = {"warning_seconds": DEFAULT_WARNING_S, "chain": 1, "max_restarts": DEFAULT_MAX_RESTARTS}
    for dest in ("config", "run_dir", "nodes", "gpus_per_node", "nproc_per_node", "cpus_per_node", "partition", "time",
                 "account", "qos", "constraint", "job_name", "container_image", "container_mounts", "warning_seconds",
                 "max_restarts", "chain", "dependency", "template", "array"):
        value = getattr(args, dest, None)
        if value is not None and dest not in skip and defaults.get(dest) != value:
            if dest == "run_dir" and resubmit:
                value = Path(value).resolve()
            parts += [f"--{dest.replace('_', '-')}", str(value)]
    parts += ["--exclusive"] * bool(args.exclusive) + [f"--sbatch-arg={a}" for a in args.sbatch_arg]
    line = " ".join(shlex.quote(p) for p in parts + list(args.overrides))
    return f"cd {shlex.quote(str(Path.cwd()))} && {line}" if resubmit else line


def cmd_submit(args) -> int:
    prepare = getattr(args, "what", "train") == "prepare"
    if args.show_template:
        print((PREPARE_TEMPLATE if prepare else TEMPLATE).read_text(), end="")
        return 0
    if prepare:
        submit_prepare(args)
        return 0
    if args.array is not None:
        raise ConfigError("--array is for `hybridtron submit prepare` (tokenizing across nodes); a training job takes "
                          "--nodes")
    submit(args)
    return 0


# ---- submit prepare -----------------------------------------------------------------------------
def _prepare_checks(args) -> None:
    if args.array is not None and args.array < 1:
        raise ConfigError(f"--array {args.array} must be at least 1 (the number of tasks)")
    if args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes} must be at least 1")
    if args.array is not None and args.nodes != 1:
        raise ConfigError(f"--array {args.array} with --nodes {args.nodes}: each array task is one node; give one of "
                          f"them (--array N: N tasks as nodes free up; --nodes N: one job, a task on each node)")
    for name, default in (("chain", 1), ("container_image", None), ("nproc_per_node", None)):
        if getattr(args, name) != default:
            raise ConfigError(f"--{name.replace('_', '-')} is for training jobs; `submit prepare` takes --array or "
                              f"--nodes, --cpus-per-node and the allocation options")
    if args.cpus_per_node is not None and args.cpus_per_node < 1:
        raise ConfigError(f"--cpus-per-node {args.cpus_per_node} must be at least 1")
    if args.time is not None:
        parse_time(args.time)


def build_prepare_job(args) -> tuple[Path, Path, Path, str, str, list[list[str]]]:
    """Validate and render `submit prepare`: (data dir, config path, script path, script, config YAML, the sbatch
    argument lists of its stages, a stage's job id written as {plan} / {tasks})."""
    from hybridtron.data_pipeline.data_lock import LOCK_FILE
    from hybridtron.train.run_dir import check_output_dir, resolve_data_dir, resolve_job

    _prepare_checks(args)
    cfg, run_dir = resolve_job(args)
    resolve_data_dir(cfg, run_dir)
    out = Path(cfg.data.out_dir).expanduser().resolve()
    cfg.data.out_dir = str(out)  # the jobs may start in another working directory's view: absolute
    check_path(out, "data.out_dir")
    check_output_dir(out, f"data.out_dir={out}")
    check_path(Path.cwd(), "the working directory")
    check_sources(cfg)
    from hybridtron.dir_lock import probe_holder

    holder = probe_holder(out / LOCK_FILE)
    if holder is not None and not (args.dependency or args.dry_run):
        raise ConfigError(f"data.out_dir={out} is being written by another process ({holder}); wait for it to end, "
                          f"or submit with --dependency afterany:JOB to start after it")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sdir = out / PREPARE_DIR
    config_path, script_path, log_dir = sdir / f"prepare-{stamp}.yaml", sdir / f"prepare-{stamp}.sbatch", sdir / "logs"
    template_path = Path(args.template) if args.template else PREPARE_TEMPLATE
    try:
        template = template_path.read_text()
    except OSError as e:
        raise ConfigError(f"--template {template_path}: {e.strerror or e}; give a readable file") from None
    opts = copy.copy(args)
    opts.gpus_per_node = 0  # tokenizing uses CPUs
    values = {
        "template": str(template_path.resolve()),
        "command": command_line(args),
        "job_name": args.job_name or f"hx-prepare-{out.name}",
        "nodes": str(args.nodes),
        "sbatch_options": "\n".join(f"#SBATCH {o}" for o in sbatch_options(opts)) or "#",
        "workdir": str(Path.cwd()),
        "log_dir": str(log_dir),
        "log_dir_q": shlex.quote(str(log_dir)),
        "config_q": shlex.quote(str(config_path)),
        "python_q": shlex.quote(sys.executable),
    }
    dep = [f"--dependency={args.dependency}"] if args.dependency else []
    if args.array is None:  # one job: plan, a task per node, merge
        stages = [[*dep, str(script_path), "all"]]
    else:
        n = args.array
        stages = [
            [*dep, "--nodes=1", f"--output={log_dir}/prepare-%j.plan.out", str(script_path), "plan"],
            # a failed plan cancels what waits for it (kill-on-invalid-dep) instead of leaving it pending forever
            ["--dependency=afterok:{plan}", "--kill-on-invalid-dep=yes", "--nodes=1", f"--array=0-{n - 1}",
             f"--output={log_dir}/prepare-%A.task%a.out", str(script_path), "task"],
            # after every task however it ended: the merge finishes the parts of a task that failed
            ["--dependency=afterok:{plan},afterany:{tasks}", "--kill-on-invalid-dep=yes", "--nodes=1",
             f"--output={log_dir}/prepare-%j.merge.out", str(script_path), "merge"],
        ]
    return out, config_path, script_path, render(template, values, str(template_path)), cfg.to_yaml(), stages


def _shown(arg: str) -> str:
    """An sbatch argument as a shell line writes it, an earlier stage's job id as its variable."""
    return f'"{arg.replace("{", "$").replace("}", "")}"' if "{" in arg else shlex.quote(arg)


def submit_prepare(args, out=print) -> list[str]:
    data, config_path, script_path, script, config_yaml, stages = build_prepare_job(args)
    names = ["job"] if len(stages) == 1 else ["plan", "tasks", "merge"]
    if args.dry_run:
        out(script + "\n# submitted with:" + "".join(
            f"\n# {name}=$(sbatch --parsable {' '.join(_shown(a) for a in argv)})"
            for name, argv in zip(names, stages, strict=True)))
        check_partition(args.partition, args.nodes,
                        note=lambda msg: print(f"hybridtron submit: {msg}", file=sys.stderr))
        return []
    sbatch_bin = slurm_binary("sbatch")
    check_partition(args.partition, args.nodes, note=out)
    (data / PREPARE_DIR / "logs").mkdir(parents=True, exist_ok=True)
    config_path.write_text(config_yaml)
    script_path.write_text(script)
    script_path.chmod(0o755)
    ids: dict[str, str] = {}
    for name, argv in zip(names, stages, strict=True):
        argv = [a.format(**ids) if "{" in a else a for a in argv]
        try:
            res = subprocess.run([sbatch_bin, "--parsable", *argv], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise SlurmError("sbatch did not answer within 120 s (slurmctld down or unreachable?); check `sinfo`, "
                             "then submit again") from None
        if res.returncode != 0:
            why = " ".join(ln.strip() for ln in (res.stderr or res.stdout).strip().splitlines()) or \
                f"exit {res.returncode}"
            done = f" (submitted before it: {', '.join(f'{k} {v}' for k, v in ids.items())}; scancel them)" if ids \
                else ""
            raise SlurmError(f"sbatch refused the {name} job: {why}; the script is {script_path}{done}")
        ids[name] = res.stdout.strip().split(";")[0]
        with open(data / PREPARE_DIR / JOBS_FILE, "a") as f:
            f.write(json.dumps({"job_id": ids[name], "stage": name, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "script": str(script_path), "config": str(config_path),
                                "array": args.array, "nodes": args.nodes}) + "\n")
    if len(ids) == 1:
        out(f"submitted job {ids['job']} (plan, one task on each of {args.nodes} nodes, merge)")
    else:
        out(f"submitted jobs: plan {ids['plan']}, tasks {ids['tasks']} (array of {args.array}), merge {ids['merge']}")
    out(f"data directory: {data}")
    out(f"script:         {script_path}")
    out(f"logs:           {data / PREPARE_DIR / 'logs'}/prepare-<job>*.out")
    out(f"status:         hybridtron status {data}")
    return list(ids.values())
