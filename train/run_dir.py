"""A run directory and the config it holds: which config a command runs with, and whether a run directory
may continue with it (the same model, the same data, the same tokenizer).

Every command that reads or writes a run directory resolves it here; the SLURM submitter uses the same checks
before it submits anything. Nothing here imports torch: the command line resolves and checks a config with it
before any heavy import.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from hybridtron.configs import ConfigError, JobConfig, load_config, parse_overrides
from hybridtron.configs.base import from_dict
from hybridtron.data_pipeline import load_tokenizer
from hybridtron.data_pipeline.data_dir import data_dir, default_data_dir, resolve_out_dir
from hybridtron.train.checkpoint_names import latest_checkpoint
from hybridtron.train.run_lock import LOCK_FILE
from hybridtron.train.watchdog import HANG_DIR

DEFAULT_PRESET = "tiny"

# Why the last `train` stopped ({"stopped_by", "step", "max_steps", "checkpoint"}), written by rank 0 when it stops
# cleanly: the SLURM job script requeues a run that a signal stopped, never a finished or crashed one.
LAST_STOP = "last_stop.json"
# A stop the SLURM job script asked for before the training processes could take a signal (the time-limit warning
# arrived while they were still starting, ignoring it): its content names the signal; train stops after its first
# step as if the signal had come then. The job script removes it at the start and end of every attempt.
STOP_REQUEST = "stop_request"
# One JSON line per restart of the training after a failure, appended by the SLURM job script (slurm/template.sbatch):
# {"time", "job_id", "attempt", "restart", "max_restarts", "exit_code", "reason", "from_step", "last_step", ...}.
RESTARTS = "restarts.jsonl"


# What a run directory holds (besides checkpoints' own layout), with the kind each must be where it exists.
RUN_DIR_ENTRIES = {"checkpoints": "dir", "tensorboard": "dir", "config.yaml": "file", "metrics.jsonl": "file",
                   LAST_STOP: "file", STOP_REQUEST: "file", LOCK_FILE: "file", RESTARTS: "file", HANG_DIR: "dir"}


def read_restarts(run_dir: Path, job_id: str | None = None) -> list[dict]:
    """The restarts recorded in ``RUN_DIR/restarts.jsonl``, oldest first; ``job_id``: those of that job only."""
    try:
        text = (Path(run_dir) / RESTARTS).read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line: the job was killed while writing it
        if isinstance(rec, dict) and (job_id is None or str(rec.get("job_id")) == str(job_id)):
            out.append(rec)
    return out


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError inside names ``path``: a buffered write, an fsync or an atomic write's temporary file fails
    naming no file or another one, and the CLI's one line (exit 4 for a full disk) must say which file it was."""
    try:
        yield
    except OSError as e:
        if e.errno is None:  # raised without an errno: nothing to say about it but its own message
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def check_output_dir(path: Path | str, what: str, *, empty: bool = False, entries: dict[str, str] | None = None
                     ) -> None:
    """A directory the command will create or write into (``what`` names it for the user, e.g. ``--run-dir
    runs/x``) can be: it is, or can be made, a directory this process may write to. Every way it cannot (an
    existing file, a path under a file, a dangling link, no permission, a read-only file system, a name too long,
    not empty where ``empty``) is a ConfigError naming the path and what to do, before any data is prepared.
    ``entries``: names inside it that must be a "dir" or a "file" where they exist."""
    raw = os.fspath(path)
    fix = "choose another path"
    if "\0" in raw:
        raise ConfigError(f"{what}: the path contains a NUL byte; {fix}")
    longest = max((len(os.fsencode(part)) for part in Path(raw).parts), default=0)
    if longest > 255 or len(os.fsencode(os.path.abspath(raw))) >= 4096:
        raise ConfigError(f"{what}: the path or one of its names is too long for the file system (names up to 255 "
                          f"bytes, paths up to 4095); {fix}")
    p = Path(os.path.abspath(raw))
    if os.path.lexists(p):
        _check_is_dir(p, what, fix, own=True)
        _check_writable(p, what, fix)
        try:
            names = os.listdir(p)
        except OSError as e:
            raise ConfigError(f"{what} cannot be read ({_why(e)}); fix its permissions or {fix}") from None
        if empty and names:
            raise ConfigError(f"{what} exists and is not empty; choose a new directory (nothing was written)")
        for name, kind in (entries or {}).items():
            q = p / name
            if not os.path.lexists(q):
                continue
            if not (os.path.isdir(q) if kind == "dir" else os.path.isfile(q)):
                raise ConfigError(f"{what}: {q} should be a {'directory' if kind == 'dir' else 'file'} but is "
                                  f"{_kind(q)}; move it away or {fix}")
            if kind == "dir":
                _check_writable(q, f"{what}: {q}", fix)
        return
    up = p.parent
    while not os.path.lexists(up) and up != up.parent:
        up = up.parent
    _check_is_dir(up, what, fix, own=False)
    _check_writable(up, what, fix, creating=p)


def _kind(p: Path) -> str:
    try:
        mode = os.lstat(p).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "a symbolic link to " + (os.readlink(p) + (" (which does not exist)" if not p.exists() else ""))
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a directory"


def _check_is_dir(p: Path, what: str, fix: str, own: bool) -> None:
    if os.path.isdir(p):
        return
    if own:
        raise ConfigError(f"{what} is {_kind(p)}, not a directory; {fix} (or move it away)")
    raise ConfigError(f"{what} cannot be created: {p} is {_kind(p)}, not a directory; {fix}")


def _check_writable(d: Path, what: str, fix: str, creating: Path | None = None) -> None:
    """Create and remove a file in ``d``: the only test that holds for root, ACLs and read-only mounts alike."""
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".hybridtron-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = f"{what} cannot be created in {d}" if creating is not None else f"{what} is not writable"
        extra = "free space there or " if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix its permissions or "
        raise ConfigError(f"{where} ({_why(e)}); {extra}{fix}") from None


def _why(e: OSError) -> str:
    return (e.strerror or type(e).__name__).lower()


def check_run_paths(cfg: JobConfig, run_dir: Path) -> None:
    """The run directory and the prepared-data directory of a ``train`` can be written, before any data is
    prepared."""
    check_output_dir(run_dir, f"--run-dir {run_dir}", entries=RUN_DIR_ENTRIES)
    out = data_dir(cfg.data)
    check_output_dir(out, f"data.out_dir={out}")


def default_run_dir(config: str | None) -> Path:
    return Path("runs") / Path(config or DEFAULT_PRESET).stem


def resolve_job(args) -> tuple[JobConfig, Path]:
    """The run's config: --config (or the run dir's saved config when resuming, or the tiny preset) + overrides."""
    overrides = parse_overrides(args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    saved = run_dir / "config.yaml"
    resuming = args.config is None and saved.is_file()
    if not resuming:
        return load_config(args.config or DEFAULT_PRESET, overrides), run_dir
    read_saved_config(run_dir)  # a damaged one is named as the run's, with the way to restore it
    cfg = load_config(str(saved), overrides)
    own = load_config(str(saved)).data
    if cfg.data.out_dir == own.out_dir == str(default_data_dir(own)):
        # The run's directory was chosen for its corpus, not given: overrides of data.* (a prepare of another
        # corpus with this run directory's config as the base) choose their own; the same data resolves to it again.
        cfg.data.out_dir = ""
    return cfg, run_dir


def resolve_data_dir(cfg: JobConfig, run_dir: Path) -> JobConfig:
    """Set data.out_dir where the config leaves it empty: to the directory the run in ``run_dir`` was prepared in
    when that run used this same data (a run started before directories were named by corpus, e.g. data/stdlib,
    resumes on its own data), else to the corpus's own directory (data_pipeline/data_dir.py). Called once the
    config is final (after --init-from); a given data.out_dir is kept as is."""
    if not cfg.data.out_dir:
        saved = (read_saved_config(run_dir) or {}).get("data")
        own = saved.get("out_dir") if isinstance(saved, dict) else None
        if own and isinstance(own, str):
            try:
                check_resume_compatible(cfg, run_dir, sections=("data",))
                cfg.data.out_dir = own
            except ConfigError:
                pass  # other data: refused if the run is resumed, and no reason to reuse its directory
    resolve_out_dir(cfg.data)
    return cfg


# Data settings that do not change which tokens are trained on, nor their order: where the prepared data
# lives (its tokenizer is compared by fingerprint instead), how it is read, and what prepare does about
# bad records (a prepare that succeeded under "error" produced what "skip" would have).
RESUME_FREE_DATA = ("out_dir", "streaming", "num_workers", "workers", "part_mb", "on_bad_record",
                    "max_malformed_fraction", "on_source_change")
_ABSENT = object()


def read_saved_config(run_dir: Path) -> dict | None:
    """The run directory's saved ``config.yaml`` as a mapping (None if there is none); ConfigError if damaged."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    ckpt = latest_checkpoint(run_dir)
    fix = (f"copy {ckpt / 'config.yaml'} (the latest checkpoint's copy) over it" if ckpt is not None
           else "delete it (no checkpoint was saved yet)")
    try:
        old = yaml.safe_load(saved.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"the run's saved config {saved} is unreadable ({type(e).__name__}); {fix}, or start a "
                          f"new --run-dir") from None
    if not isinstance(old, dict):
        raise ConfigError(f"the run's saved config {saved} holds no config mapping; {fix}, or start a new --run-dir")
    return old


def _first_difference(old, new, key: str):
    """(key, old, new) of the first setting in ``new`` that ``old`` holds with another value, or None."""
    if old is _ABSENT:  # a setting the saved config does not know (and its defaults could not fill in)
        return None
    if isinstance(new, dict) and isinstance(old, dict):
        for k, v in new.items():
            if (d := _first_difference(old.get(k, _ABSENT), v, f"{key}.{k}")) is not None:
                return d
        return None
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            if (d := _first_difference(a, b, f"{key}[{i}]")) is not None:
                return d
        return None
    return None if old == new else (key, old, new)


def check_resume_compatible(cfg: JobConfig, run_dir: Path, sections: tuple[str, ...] = ("model", "data")) -> None:
    """A run directory continues only with the model it was started with and the same data: every model
    setting, and every data setting that changes which tokens are trained on (sources, tokenizer settings,
    seq_len, split, seed, ...). The tokenizer itself is compared by fingerprint in check_resume_tokenizer."""
    old = read_saved_config(run_dir)
    if old is None:
        return
    try:  # settings added since the run was saved compare with their defaults
        old = from_dict(JobConfig, old).to_dict()
    except (ConfigError, TypeError, ValueError, AttributeError, KeyError):
        pass  # a config of another version: compare the keys it has
    new = cfg.to_dict()
    for section in sections:
        # model.kernels says how the same function is computed (kernels/backend.py), not what is trained
        free = RESUME_FREE_DATA if section == "data" else ("kernels",)
        before = old.get(section)
        before = before if isinstance(before, dict) else {}
        now = new[section]
        if section == "data" and now["tokenizer"]["kind"] == "pretrained" and isinstance(before.get("tokenizer"), dict):
            # a pretrained tokenizer is the file's content, compared by check_resume_tokenizer: not where it lies
            before = {**before, "tokenizer": {k: v for k, v in before["tokenizer"].items() if k != "path"}}
            now = {**now, "tokenizer": {k: v for k, v in now["tokenizer"].items() if k != "path"}}
        for k, v in now.items():
            d = None if k in free else _first_difference(before.get(k, _ABSENT), v, f"{section}.{k}")
            if d is not None:
                key, was, now = d
                raise ConfigError(
                    f"--run-dir {run_dir} holds a run with {key}={was!r}, but this config has {key}={now!r}; resume "
                    f"with the run's {section} settings (drop the override or --config) or choose another --run-dir"
                )


def check_resume_tokenizer(ckpt: Path | None, tokenizer, tokenizer_dir: Path) -> None:
    """The checkpoint was trained with the tokenizer the data now resolves to (the same file bytes), not another
    one of the same size: continuing would train on differently tokenized data."""
    if ckpt is None or not (ckpt / "tokenizer").is_dir():
        return
    from hybridtron.train.checkpoint import verify_manifest  # imports torch: a run's, after the config is checked

    verify_manifest(ckpt, only=("tokenizer",))
    old = load_tokenizer(ckpt / "tokenizer").fingerprint
    if old != tokenizer.fingerprint:
        raise ConfigError(
            f"checkpoint {ckpt} was trained with tokenizer {old[:12]} ({ckpt / 'tokenizer'}), but the data in "
            f"{tokenizer_dir.parent} uses tokenizer {tokenizer.fingerprint[:12]} ({tokenizer_dir}); resume with the "
            f"data.out_dir the run was prepared with, or start a new --run-dir"
        )
