"""What ``auto`` runs on CUDA for the ops with peer libraries (backend.TUNED_OPS): the fastest correct backend,
measured on the user's GPU at the call's shape class.

The first time an op meets a shape class (op, dtype, batch, sequence-length bucket, head counts and dims, gate,
documents or not, gradients or not: kernels/tune_cases.py builds it from the call's tensors), every backend of
``backend.AUTO_ORDER[op]`` that can run here is

1. checked against the pure-torch reference on a small input of the same kind (same dtype, head dims, gate,
   grouping, documents, gradients), outputs and every input gradient, by kernels/testing.py's rule: attention by
   flash-attention's (``max|x - ref64| <= 2 max|ref_dtype - ref64| + 1e-5``), the others by our kernel tests'
   (factor 3, the reference's bf16 products where the kernels multiply bf16 operands);
2. timed at the shape class's full size: forward and backward (forward alone without gradients), warm-up calls
   first (compiles, Triton autotuning), then rounds in which the candidates alternate, CUDA events, the median.
   The reference is timed only where no kernel agreed with it (it is the fallback, never the fastest on a GPU).

The fastest that agreed is kept. One that disagrees, fails to compile or raises is dropped with one warning naming
it and the error. Decisions are cached per machine -- GPU, driver, CUDA, torch, triton, cuDNN, the peers' versions
and our kernels' sources -- in ``kernel_choices.json`` under the user's cache directory (``$HYBRIDTRON_CACHE_DIR``,
else ``$XDG_CACHE_HOME/hybridtron``, else ``~/.cache/hybridtron``), so later runs and every rank of a job reuse them:
a process measures a class under an exclusive lock on the file and the others, waiting on it, read its decision (a
cluster's home directory is shared by its nodes; train/kernel_choice.py also hands rank 0's decisions to every
rank). A version change makes the machine another one: its classes are measured again. The file is bounded
(``MAX_MACHINES`` machines, ``MAX_DECISIONS`` classes each, the least recently used dropped at a write), and an entry
of the wrong shape is dropped with one warning naming the file and measured again.

No measurement runs inside a torch.compile trace (the tensors there are fake, and `backend.pick` is a constant to
the compiler): there the tuner answers from what it knows -- the class's decision, the decision of the same class
with gradients for a forward-only one, else ``AUTO_ORDER``'s first runnable backend, said once. The trainer runs
its first step eagerly so the compiled steps find every class decided. ``HYBRIDTRON_KERNEL_TUNE=0`` turns
measuring off (``AUTO_ORDER`` then, ours first).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridtron.kernels import backend
from hybridtron.kernels.testing import reference_errors

ENV_TUNE = "HYBRIDTRON_KERNEL_TUNE"
ENV_CACHE = "HYBRIDTRON_CACHE_DIR"
CACHE_NAME = "kernel_choices.json"
FORMAT = 1
WARMUP, ROUNDS = 2, 7  # calls before timing (the first compiles and autotunes), timed rounds (the median is kept)
MAX_MACHINES = 8  # fingerprints kept in one cache file (a shared home seen from several GPU kinds)
# Shape classes kept per machine: a user's presets, batch sizes and sequence buckets meet a few dozen; what is beyond
# this was least recently measured or used and is dropped at a write (the file stays under ~1 MB).
MAX_DECISIONS = 256


class KernelTuningWarning(UserWarning):
    """A backend dropped from ``auto``'s choice (it disagreed with the reference or failed), or a class decided
    without a measurement."""


@dataclass
class Decision:
    """What ``auto`` runs for one shape class, and why: every candidate's median time (ms) or why it was dropped."""

    chosen: str
    times_ms: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    measured: str = ""  # when (ISO time, UTC) it was measured; "" for a class decided without a measurement
    note: str = ""  # where the answer came from when not measured here: "cache", "rank 0", or why no measurement

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("note")
        return d

    @classmethod
    def from_json(cls, d: dict, note: str = "") -> Decision:
        return cls(str(d["chosen"]), {str(k): float(v) for k, v in d.get("times_ms", {}).items()},
                   {str(k): str(v) for k, v in d.get("dropped", {}).items()}, str(d.get("measured", "")), note)


def shape_key(shape: tuple) -> str:
    """``op[name=value,...]``: a shape class (``(op, ((name, value), ...))``) as the cache file's key."""
    op, params = shape
    return f"{op}[{','.join(f'{k}={v}' for k, v in params)}]"


# ---- state: this process's decisions and settings ------------------------------------------------------------

_decisions: dict[str, Decision] = {}
_shapes: dict[str, tuple] = {}  # shape key -> the shape class it names (for the report's work and floors)


@dataclass
class _Settings:
    devices: tuple[str, ...] = ("cuda",)  # device types whose ``auto`` is measured (tests add "cpu")
    measure: bool | None = None  # None: unless HYBRIDTRON_KERNEL_TUNE=0
    cache_dir: Path | None = None  # None: the user's cache directory (see `cache_path`)
    timer: Callable | None = None  # fns: dict[name, callable], device -> dict[name, ms or Exception] (tests)
    cases: dict | None = None  # op -> case (kernels/tune_cases.py); tests inject their own
    frozen: bool = False  # decisions handed over by rank 0 (train/kernel_choice.py): no further measuring
    refresh: bool = False  # measure again what the cache file knows (``hybridtron kernels --retune``)
    said: set = field(default_factory=set)


_settings = _Settings()


def configure(**kw) -> None:
    """Set tuner settings (`_Settings`' fields), e.g. ``configure(devices=("cuda", "cpu"), timer=...)`` in tests or
    ``configure(cache_dir=...)``."""
    for k, v in kw.items():
        if not hasattr(_settings, k):
            raise TypeError(f"tune.configure: no setting {k!r}")
        setattr(_settings, k, v)


def reset() -> None:
    """Forget this process's decisions and settings (tests)."""
    global _settings
    _decisions.clear()
    _shapes.clear()
    _settings = _Settings()
    _load_file.cache_clear()


def measures_on(device_type: str) -> bool:
    """Whether ``auto`` on this device type is decided here (CUDA; the CPU only when a test asks)."""
    return device_type in _settings.devices


def measuring_allowed() -> bool:
    if _settings.frozen or torch.compiler.is_compiling():
        return False
    if _settings.measure is not None:
        return _settings.measure
    return os.environ.get(ENV_TUNE, "").strip().lower() not in ("0", "false", "no", "off")


def decisions() -> dict[str, Decision]:
    """The decisions this process has used, by shape key."""
    return dict(_decisions)


def remember(shape: tuple, d: Decision, device_type: str) -> None:
    """Keep ``d`` (e.g. from `measure`) as the decision for ``shape`` in this process and in the cache file."""
    key = shape_key(shape)
    _decisions[key], _shapes[key] = d, shape
    with _cache_lock():
        _store(_fingerprint_hash(device_type), device_type, {key: d})


def shapes() -> dict[str, tuple]:
    """The shape classes of `decisions`, by shape key."""
    return dict(_shapes)


def install(found: dict[str, dict], note: str = "rank 0") -> None:
    """Take ``found`` (shape key -> Decision.to_json()) as this process's decisions, e.g. rank 0's, and measure
    nothing more: every rank then runs the same backends."""
    for key, d in found.items():
        _decisions[key] = Decision.from_json(d, note)
    _settings.frozen = True


def _say(text: str) -> None:
    if text not in _settings.said:
        _settings.said.add(text)
        warnings.warn(text, KernelTuningWarning, stacklevel=3)


# ---- the choice ------------------------------------------------------------------------------------------------

def choose(op: str, shape: tuple, device_type: str) -> str:
    """The backend ``auto`` runs ``op`` with for ``shape`` on ``device_type`` (see the module docstring)."""
    key = shape_key(shape)
    hit = _decisions.get(key)
    if hit is not None:
        return hit.chosen
    _shapes[key] = shape
    device = torch.device(device_type)
    fp = _fingerprint_hash(device_type)
    found = None if _settings.refresh else _load_file(str(cache_path()), fp).get(key)
    if found is not None:
        _decisions[key] = Decision.from_json(found, "cache")
        return _decisions[key].chosen
    if measuring_allowed():
        with _cache_lock():
            _load_file.cache_clear()  # another process may have measured it while this one waited
            found = None if _settings.refresh else _load_file(str(cache_path()), fp).get(key)
            if found is not None:
                _decisions[key] = Decision.from_json(found, "cache")
            else:
                _decisions[key] = measure(op, shape, device)
                _store(fp, device_type, {key: _decisions[key]})
        return _decisions[key].chosen
    return _untuned(op, shape, key, device_type).chosen


def _untuned(op: str, shape: tuple, key: str, device_type: str) -> Decision:
    """A class met where nothing may be measured: a forward-only class takes its training twin's decision, else the
    first runnable backend of AUTO_ORDER (said once)."""
    params = dict(shape[1])
    if params.get("grad") is False:
        twin = shape_key((op, tuple((k, True if k == "grad" else v) for k, v in shape[1])))
        if twin in _decisions:
            _decisions[key] = Decision(_decisions[twin].chosen, note=f"as {twin}")
            return _decisions[key]
    why = ("inside a torch.compile trace" if torch.compiler.is_compiling() else
           "after rank 0's decisions were installed" if _settings.frozen else f"{ENV_TUNE}=0")
    chosen = backend.resolve(op, "auto", device_type)
    _decisions[key] = Decision(chosen, note=f"not measured ({why})")
    _say(f"kernels: {key} was not measured ({why}); auto runs {chosen}, the first runnable of AUTO_ORDER")
    return _decisions[key]


def candidates(op: str, device: torch.device) -> list[str]:
    """The backends of ``op`` that can run on ``device`` (AUTO_ORDER's order), the reference always among them."""
    return [b for b in backend.AUTO_ORDER[op] if backend.unavailable_reason(b, device) is None]


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


def measure(op: str, shape: tuple, device: torch.device, only: list[str] | None = None) -> Decision:
    """Check and time every runnable candidate of ``op`` at ``shape`` on ``device`` (``only``: these backends);
    the fastest that agrees with the reference wins."""
    case = _cases()[op]
    params = dict(shape[1])
    names = [b for b in candidates(op, device) if only is None or b in only]
    dropped: dict[str, str] = {}
    key = shape_key(shape)
    with measuring_context(device):
        small = case.inputs(params, device, small=True)
        for name in names:
            if name == "reference":
                continue
            try:
                errors = reference_errors(f"{op} ({name})", functools.partial(case.run, name, params),
                                          functools.partial(case.run, "reference", params), small.tensors, small.dtypes,
                                          factor=case.factor, atol=case.atol, ref_mode=case.ref_mode(params),
                                          grad=params["grad"])
                if errors:
                    dropped[name] = f"disagrees with the reference: {errors[0]}"
            except Exception as e:  # noqa: BLE001  (a candidate that cannot run is dropped, whatever it raised)
                dropped[name] = f"failed: {one_line(e)}"
        del small
        # The reference is the ground truth and the fallback, timed only where no kernel agreed with it: on a GPU
        # it is never the fastest, and at full size its autograd keeps what the kernels recompute (gigabytes,
        # measured while a training step's own activations are live).
        ok = [n for n in names if n not in dropped and n != "reference"] or ["reference"]
        full = case.inputs(params, device, small=False)
        fns = {n: timed_call(case, n, params, full) for n in ok}
        timed = timer()(fns, device)
        del full, fns
    times = {}
    for n in ok:
        t = timed.get(n)
        if isinstance(t, BaseException) or t is None:
            dropped[n] = f"failed: {one_line(t)}" if isinstance(t, BaseException) else "not timed"
        else:
            times[n] = float(t)
    for n, why in dropped.items():
        _say(f"kernels: {op} backend {n} dropped for {key}: {why}")
    if not times:  # nothing ran, not even the reference: let the op's own error surface at the call
        chosen = "reference"
    else:
        chosen = min(times, key=times.get)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the candidates' inputs and scratch, before the caller's own allocations go on
    return Decision(chosen, times, dropped, datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


@contextlib.contextmanager
def measuring_context(device: torch.device):
    """Measure as the op would run alone: no autocast (each case casts as the model's call does), gradients on, no
    inference mode, no saved-tensor hooks, and the caller's RNG untouched (the cases draw from their own
    generators)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(_without_saved_tensor_hooks())
        yield


@contextlib.contextmanager
def _without_saved_tensor_hooks():
    """The saved-tensor hooks of the caller set aside: a class first met inside a block under activation
    checkpointing (torch's non-reentrant checkpoint packs every tensor saved in the block's forward) would have the
    candidates' own saved tensors packed as the block's, to be recomputed with it."""
    ag = torch._C._autograd
    top, pop, push = (getattr(ag, n, None) for n in ("_top_saved_tensors_default_hooks",
                                                      "_pop_saved_tensors_default_hooks",
                                                      "_push_saved_tensors_default_hooks"))
    if top is None or pop is None or push is None:
        yield  # (torch without the stack's functions; `measuring_allowed` refuses when hooks are active there)
        return
    held = []
    while (hooks := top(False)) is not None:
        held.append(hooks)
        pop()
    try:
        yield
    finally:
        for hooks in reversed(held):
            push(*hooks)


def timed_call(case, name: str, params: dict, full) -> Callable[[], None]:
    """One forward (and backward, with fixed cotangents) of backend ``name`` on its own copies of the inputs: a
    peer that writes into its inputs cannot change what the others are timed on."""
    grad = params["grad"]
    leaves = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in full.tensors]
    diff = [t for t in leaves if t.requires_grad]
    cot: list[torch.Tensor] = []

    def run():
        outs = case.run(name, params, *leaves)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        if grad:
            if not cot:
                g = torch.Generator(device=outs[0].device).manual_seed(1)
                cot.extend(torch.randn(o.shape, generator=g, device=o.device, dtype=o.dtype) for o in outs)
            torch.autograd.grad(outs, diff, cot, allow_unused=True)

    return run


def timer() -> Callable:
    """The timing function in use: `time_candidates`, or the one a test configured."""
    return _settings.timer or time_candidates


def time_candidates(fns: dict[str, Callable[[], None]], device: torch.device, warmup: int = WARMUP,
                    rounds: int = ROUNDS) -> dict[str, float | BaseException]:
    """Median milliseconds of each callable: ``warmup`` calls each (a failure there drops it: the exception is its
    entry), then ``rounds`` rounds in which every survivor runs once, in turn. CUDA events on the GPU, the wall
    clock elsewhere."""
    out: dict[str, float | BaseException] = {}
    alive = dict(fns)
    for name, fn in list(alive.items()):
        try:
            for _ in range(warmup):
                fn()
            _sync(device)
        except Exception as e:  # noqa: BLE001
            out[name] = e
            del alive[name]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    samples: dict[str, list[float]] = {n: [] for n in alive}
    for _ in range(rounds):
        for name, fn in alive.items():
            samples[name].append(_time_once(fn, device))
    out.update({n: statistics.median(s) for n, s in samples.items()})
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _cases() -> dict:
    if _settings.cases is None:
        from hybridtron.kernels.tune_cases import CASES

        _settings.cases = CASES
    return _settings.cases


# ---- the cache file --------------------------------------------------------------------------------------------

def cache_path() -> Path:
    """``kernel_choices.json`` in the tuner's cache directory (see the module docstring)."""
    if _settings.cache_dir is not None:
        return Path(_settings.cache_dir) / CACHE_NAME
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]) / CACHE_NAME
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridtron" / CACHE_NAME


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _kernel_sources_hash() -> str:
    """Our kernels' source files (kernels/**/*.py): a change to any of them may change its speed."""
    h = hashlib.blake2b(digest_size=8)
    root = Path(__file__).resolve().parent
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


PEER_DISTRIBUTIONS = ("triton", "fla-core", "flash-linear-attention", "flash-attn", "flash-attn-4", "causal-conv1d",
                      "flash-qla", "tilelang", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13")


@functools.cache
def fingerprint(device_type: str) -> dict:
    """What a decision depends on besides the shape: the device, its driver and every library that runs a candidate."""
    fp = {"device": device_type, "torch": torch.__version__, "cuda": torch.version.cuda,
          "kernels": _kernel_sources_hash()}
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        fp.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
        with contextlib.suppress(Exception):
            fp["driver"] = torch._C._cuda_getDriverVersion()
        with contextlib.suppress(Exception):
            fp["cudnn"] = torch.backends.cudnn.version()
    fp.update({d: v for d in PEER_DISTRIBUTIONS if (v := _version(d)) is not None})
    return fp


def _fingerprint_hash(device_type: str) -> str:
    return hashlib.blake2b(json.dumps(fingerprint(device_type), sort_keys=True).encode(), digest_size=8).hexdigest()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"format": FORMAT, "machines": {}}
    except (OSError, ValueError) as e:
        _say(f"kernels: ignoring the tuner's cache {path} ({one_line(e)}); it is rewritten at the next measurement")
        return {"format": FORMAT, "machines": {}}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("machines"), dict):
        return {"format": FORMAT, "machines": {}}
    dropped = _drop_malformed(data["machines"])
    if dropped:
        more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        _say(f"kernels: dropped {len(dropped)} malformed entr{'y' if len(dropped) == 1 else 'ies'} of the tuner's "
             f"cache {path}: {'; '.join(dropped[:3])}{more}; what they held is measured again")
    return data


def _malformed(key: str, d) -> str | None:
    """Why the cached decision ``d`` of shape key ``key`` cannot be used (a hand edit, another program's file, a
    version that wrote something else), or None when it can."""
    op = key.split("[", 1)[0]
    if op not in backend.AUTO_ORDER or not key.endswith("]"):
        return f"{key[:60]!r} (not a shape class of an op)"
    if not isinstance(d, dict):
        return f"{key} (a {type(d).__name__}, not an object)"
    chosen, times, dropped = d.get("chosen"), d.get("times_ms", {}), d.get("dropped", {})
    if not isinstance(chosen, str):
        return f"{key} (no chosen backend)"
    if chosen not in backend.AUTO_ORDER[op]:
        return f"{key} (chosen backend {chosen[:40]!r} is none of {op}'s)"
    if not isinstance(times, dict) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
            for t in times.values()):
        return f"{key} (times_ms is not a map of backend to milliseconds)"
    if not isinstance(dropped, dict) or not all(isinstance(v, str) for v in dropped.values()):
        return f"{key} (dropped is not a map of backend to reason)"
    if not isinstance(d.get("measured", ""), str):
        return f"{key} (measured is not a time)"
    return None


def _drop_malformed(machines: dict) -> list[str]:
    """Remove from the cache file's ``machines`` what is not of the shape `_store` writes; says what went."""
    dropped = []
    for fp, entry in list(machines.items()):
        if not isinstance(entry, dict):
            dropped.append(f"machine {fp} (a {type(entry).__name__}, not an object)")
            del machines[fp]
            continue
        if not isinstance(entry.get("machine", {}), dict):
            dropped.append(f"machine {fp}'s fingerprint (not an object)")
            del entry["machine"]
        found = entry.setdefault("decisions", {})
        if not isinstance(found, dict):
            dropped.append(f"machine {fp}'s decisions (a {type(found).__name__}, not an object)")
            entry["decisions"] = {}
            continue
        for key, d in list(found.items()):
            why = _malformed(key, d)
            if why is not None:
                dropped.append(why)
                del found[key]
    return dropped


@functools.lru_cache(maxsize=4)
def _load_file(path: str, fp_hash: str) -> dict[str, dict]:
    """The cached decisions of this machine (fingerprint hash) in the file at ``path``."""
    entry = _read(Path(path))["machines"].get(fp_hash) or {}
    found = entry.get("decisions", {})
    return found if isinstance(found, dict) else {}


def _store(fp_hash: str, device_type: str, new: dict[str, Decision]) -> None:
    """Merge ``new`` into the cache file atomically (the caller holds the lock). A cache directory that cannot be
    written is said once: the decisions then live for this process only."""
    from hybridtron.atomic import write_text_atomic

    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        machines = data["machines"]
        found = (machines.pop(fp_hash, None) or {}).get("decisions", {})
        entry = {"machine": fingerprint(device_type), "decisions": found}
        # Most recently used last, so that the least recently used go first: what this process has used (read from
        # the file or measured), then what it stores now.
        used = [k for k in _decisions if k in found and k not in new]
        for k in used:
            found[k] = found.pop(k)
        for k, d in new.items():
            found.pop(k, None)
            found[k] = d.to_json()
        machines[fp_hash] = entry  # the newest last; the oldest machines go first
        while len(machines) > MAX_MACHINES:
            machines.pop(next(iter(machines)))
        for m in machines.values():  # (another machine's too: a file an older version let grow is bounded here)
            while len(m["decisions"]) > MAX_DECISIONS:
                m["decisions"].pop(next(iter(m["decisions"])))
        write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
    except OSError as e:
        _say(f"kernels: cannot write the tuner's cache {path} ({one_line(e)}); set {ENV_CACHE} to a writable "
             f"directory to keep decisions between runs")
    _load_file.cache_clear()


@contextlib.contextmanager
def _cache_lock():
    """An exclusive advisory lock on ``kernel_choices.json.lock`` beside the cache: one process of a machine (of a
    cluster, where the directory is shared and its file system honours flock: NFSv4, Lustre mounted with flock)
    measures a class while the others wait and then read its decision. Where no lock can be taken, each process
    measures for itself (said once)."""
    path = cache_path().with_name(CACHE_NAME + ".lock")
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")  # noqa: SIM115  (held for the block)
    except (ImportError, OSError) as e:
        _say(f"kernels: no lock on {path} ({one_line(e)}); each process measures for itself")
        yield
        return
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError as e:
            _say(f"kernels: flock on {path} failed ({one_line(e)}); each process measures for itself")
        yield
    finally:
        f.close()  # releases the lock


# ---- the table -------------------------------------------------------------------------------------------------

def table(found: dict[str, Decision] | None = None) -> str:
    """One line per shape class: op and class, every candidate's time (or why it was dropped), the choice."""
    found = decisions() if found is None else found
    if not found:
        return "kernels: no op was decided by measurement"
    lines = ["kernels: auto's choices (ms: forward+backward, or forward without gradients; median on this GPU)"]
    for key, d in sorted(found.items()):
        cands = [f"{n} {t:.3f}" for n, t in sorted(d.times_ms.items(), key=lambda kv: kv[1])]
        cands += [f"{n} dropped ({why[:80]})" for n, why in d.dropped.items()]
        src = f" [{d.note}]" if d.note else ""
        lines.append(f"  {key}: {'; '.join(cands) or '-'} -> {d.chosen}{src}")
    return "\n".join(lines)

