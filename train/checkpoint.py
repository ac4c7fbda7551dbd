"""Atomic, verified, resumable checkpoints.

Layout of ``<run_dir>/checkpoints/``::

    step_00000100/          one complete checkpoint
        model.safetensors   weights (safetensors: loading executes no code)
        optimizer.pt        optimizer state, loaded with weights_only=True
        rng.pt              torch RNG states, loaded with weights_only=True
        trainer_state.json  step, data position, tokens seen, python RNG, LR plan, spike-guard history
        config.yaml         the resolved job config
        tokenizer/          the tokenizer the run was trained with (its real files only, never temp files)
        manifest.json       size and sha256 of every file above, written last
    latest                  text file naming the newest complete checkpoint

A checkpoint is written under a temporary name and renamed into place only when every file (the manifest
included) is on disk, and ``latest`` is replaced after that; a crash at any moment leaves either the
previous state or the new one, never a directory that looks complete and is not. Loading verifies the
files against the manifest first, so a truncated, overwritten or missing file is named in a one-line
error instead of resuming from other values; a damaged newest checkpoint is refused (with the advice to
delete it), never skipped for an older one in silence. A full disk during a save removes the partial
directory and raises ``DiskFullError`` naming the file; ``latest`` keeps naming the previous checkpoint.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import _remove_duplicate_names, load_model, save_file, save_model  # (save_model's helper)
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from hybridtron.atomic import (
    fsync_dir,
    parse_scratch,
    pid_alive,
    reclaim_scratch,
    remove_entry,
    report_removed,
    scratch_name,
    this_host,
    write_text_atomic,
)
from hybridtron.train import checkpoint_names, watchdog
from hybridtron.train.checkpoint_names import LATEST, STEP_RE
from hybridtron.train.checkpoint_pins import prune
from hybridtron.train.errors import CheckpointError, DiskFullError
from hybridtron.train.model_order import canonical_name, canonical_state_dicts, to_row_order
from hybridtron.train.parallel.mesh import launch_world

MANIFEST = "manifest.json"
SHARDED = "dcp"  # torch.distributed.checkpoint directory of a multi-process run: model + optimizer shards
DEEPSPEED, DEEPSPEED_TAG = "deepspeed", "state"  # a DeepSpeed engine's checkpoint directory and its one tag
# Never copied into a checkpoint's tokenizer/: dotfiles and the temporary files of an interrupted atomic write
# (".tokenizer.json.tmp-HOST-PID"; older versions: ".tokenizer.json.tmp-PID"), which would otherwise travel into
# every checkpoint after it.
TOKENIZER_SKIP = shutil.ignore_patterns(".*", "*.tmp", "*.tmp-*", "*.tmp.*", "*~")
# torch.save reports a failed write (ENOSPC among others) from its zip writer without the errno, e.g.
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 662"; such a failure is taken for a
# full disk when the file system has less than LOW_SPACE_BYTES left.
TORCH_WRITE_FAILURE = ("inline_container", "pytorchstreamwriter", "file write failed", "unexpected pos")
LOW_SPACE_BYTES = 64 << 20
# Tests only: seconds a background checkpoint write pauses after its weights are on disk, before the checkpoint is
# finished (manifest, rename, latest), so that a test can kill or stop the run while a write is in progress.
TEST_WRITE_DELAY = "HYBRIDTRON_TEST_CHECKPOINT_WRITE_DELAY"

_warned: set[tuple[str, ...]] = set()  # warnings already printed in this process (latest() runs twice per resume)


def _warn_once(key: tuple[str, ...], msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        rank, _local, world = launch_world()
        print(f"[hybridtron{f' rank {rank}/{world}' if world > 1 else ''}] warning: {msg}", file=sys.stderr, flush=True)


def _note(msg: str) -> None:
    rank, _local, world = launch_world()
    if rank == 0:
        print(f"[hybridtron{f' rank {rank}/{world}' if world > 1 else ''}] {msg}", flush=True)


# ---- checksums ---------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    """sha256 of a file, read in 1 MiB blocks. Faster than blake2b on CPUs with SHA instructions (measured in
    bench/RESULTS.md, "Checkpoint checksums"); the files of a checkpoint are hashed in parallel."""
    h = hashlib.sha256()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _digests(paths: list[Path]) -> list[str]:
    if len(paths) <= 1:
        return [file_digest(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:  # hashlib releases the GIL
        return list(pool.map(file_digest, paths))


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != MANIFEST)


def write_manifest(root: Path) -> None:
    """``manifest.json`` in checkpoint directory ``root``: the size and sha256 of every other file in it."""
    files = _files(root)
    digests = _digests(files)
    manifest = {"format": 1, "files": {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": d}
                                       for p, d in zip(files, digests, strict=True)}}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))


def resume_advice(path: Path) -> str:
    """What to do about a damaged checkpoint ``path``: delete it, naming the one the run then resumes from."""
    prev = [p for p in CheckpointManager(path.parent.parent).complete() if p.name < path.name] if STEP_RE.match(
        path.name) else []
    if prev:
        return f"delete {path} to resume from {prev[-1].name}, the checkpoint before it"
    return f"delete {path} to start the run over (it is the run's only checkpoint), or use another checkpoint"


def verify_manifest(path: Path, only: tuple[str, ...] | None = None, share: tuple[int, int] = (0, 1)) -> None:
    """The files ``manifest.json`` lists (those under the top-level names ``only``, or all) are there with their
    size and sha256; otherwise CheckpointError naming the first that is not. A checkpoint without a manifest
    (written before manifests existed) is loaded with a warning. ``share`` = (i, n): every process checks that
    each file is there at its size, but hashes only the i-th of n shares of the bytes, so n processes resuming
    one checkpoint read it once between them, not n times."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        _warn_once(("no-manifest", str(path)), f"checkpoint {path} has no {MANIFEST} (written by an older version); "
                   f"its files cannot be verified")
        return
    try:
        files = json.loads(mf.read_text())["files"]
        want = {str(rel): (int(v["bytes"]), str(v["sha256"])) for rel, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({type(e).__name__}); "
                              f"{resume_advice(path)}") from None
    rels = sorted(r for r in want if only is None or r.split("/", 1)[0] in only)
    for rel in rels:
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: {rel} is missing (the manifest lists it); {resume_advice(path)}")
        if f.stat().st_size != want[rel][0]:
            raise CheckpointError(f"checkpoint {path}: {rel} has {f.stat().st_size} bytes, the manifest says "
                                  f"{want[rel][0]} (truncated or replaced); {resume_advice(path)}")
    i, n = share
    rels = sorted(rels, key=lambda r: (-want[r][0], r))[i::n]  # largest first, dealt round: shares of equal bytes
    for rel, got in zip(rels, _digests([path / r for r in rels]), strict=True):
        if got != want[rel][1]:
            raise CheckpointError(f"checkpoint {path}: {rel} does not match its checksum (corrupt or modified "
                                  f"after saving); {resume_advice(path)}")


# ---- full disks --------------------------------------------------------------------------------
def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62  # unknown: do not claim the disk is full
    return st.f_bavail * st.f_frsize


def is_disk_full(e: BaseException, where: Path | None = None) -> bool:
    """Whether a write failed for want of space: ENOSPC/EDQUOT, a message saying so (safetensors, shutil.Error),
    or torch's errno-less zip-writer failure while ``where``'s file system is (nearly) full."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e).lower()
    if "no space left" in text or "disk quota exceeded" in text or "os error 28" in text:
        return True
    return where is not None and any(s in text for s in TORCH_WRITE_FAILURE) and _free_bytes(where) < LOW_SPACE_BYTES


def honour_umask(path: Path) -> None:
    """safetensors creates its files with mode 0600 whatever the umask; give ``path`` the mode every other file
    of a checkpoint or export gets (0644 under the usual umask 022), so a shared group can read the weights."""
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _save_model_state(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """``model.safetensors`` from a model's state dict, as safetensors' ``save_model`` writes it from the model
    (a tied tensor once, its other names in the metadata), so a save from a staged copy writes the same file."""
    state_dict = dict(state_dict)
    metadata = {}
    for kept, removed in _remove_duplicate_names(state_dict).items():
        for name in removed:
            metadata.setdefault(name, kept)
            del state_dict[name]
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata=metadata or None)
    honour_umask(path)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, plain


def restore_rng(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    v, st, g = plain["python"]
    random.setstate((v, tuple(st), g))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # global data position (independent of the DP size)
    tokens_seen: int = 0
    # The loop's side concerns' own state, saved in trainer_state.json: "schedule" (the LR plan in force),
    # "spike_guard" (the loss-spike guard's recent history). Empty in checkpoints written before them.
    extra: dict = field(default_factory=dict)


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 3):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self._pending: tuple[Path, Future] | None = None  # a background save: its checkpoint, the writer's result
        self._writer: ThreadPoolExecutor | None = None  # the one thread that writes background saves, in order
        self._staging = None  # torch.distributed.checkpoint's DefaultStager, made at the first background save

    # ---- discovery -------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        return checkpoint_names.complete(self.dir)

    def latest(self, warn: bool = True) -> Path | None:
        """The checkpoint named by ``latest``; if the pointer names a directory that is not there, the newest
        complete one, with a warning naming both (once per process)."""
        found, named = checkpoint_names.latest(self.dir)
        if named is not None and warn:
            ptr = self.dir / LATEST
            _warn_once(("latest", str(ptr), named), f"{ptr} names {named!r}, which is not a checkpoint directory "
                       f"here; " + (f"using the newest complete checkpoint, {found.name}" if found is not None
                                    else "no complete checkpoint is left: starting from step 0"))
        return found

    def clean_partial(self, log: Callable[[str], object] | None = None) -> list[Path]:
        """Remove what writes killed midway left in the run directory and its checkpoints/, and say so in one line
        (through ``log``; without one, rank 0 prints it). Returns what was removed.

        Every process of a run calls this at its start, before its first step, so no save of the run is in flight:
        every partial save in checkpoints/ goes, whichever node wrote it (a requeued job often lands on other
        nodes) -- the ``.tmp-<step>-sharded`` directory of a multi-process save, a one-process save's scratch
        directory and ``latest``'s scratch file (``scratch_name``; ``.tmp-<step>-<pid>`` from older versions) --
        except one whose writer is seen alive on this host (another run in the same directory). The run
        directory's own files may be written by other commands meanwhile: there only the scratch of dead
        processes goes (``reclaim_scratch``'s rule)."""
        removed = []
        if self.dir.is_dir():
            for p in sorted(self.dir.iterdir()):
                parsed = parse_scratch(p.name)
                if parsed is None and not p.name.startswith(".tmp-"):
                    continue
                if parsed is not None and parsed[1] == this_host() and (parsed[2] == os.getpid()
                                                                        or pid_alive(parsed[2])):
                    continue
                if remove_entry(p):
                    removed.append(p)
        removed += reclaim_scratch(self.dir.parent)
        report_removed(removed, log or _note, "of interrupted writes")
        return removed

    # ---- save ------------------------------------------------------------------------------
    def save(
        self,
        state: TrainerState,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config_yaml: str,
        tokenizer_dir: Path,
        mesh=None,
        own_format=None,
        background: bool = False,
    ) -> Path:
        """Write checkpoint ``step_<state.step>`` atomically and point ``latest`` at it.

        One process: ``model.safetensors`` + ``optimizer.pt``. Several (``mesh.distributed``, every rank calls
        this): ``dcp/``, a torch.distributed.checkpoint directory to which every rank writes its own shards;
        rank 0 writes the rest, the manifest, and renames the directory into place only after every rank's
        shards are on disk. Ranks agree after each phase, so a failure on any rank removes the partial
        directory on all of them and raises on all of them. ``own_format``: an engine's writer of its own
        format, called on every rank with the directory to fill (``deepspeed/``: a DeepSpeed engine's ZeRO
        partitions, train/engine.py), synchronously, instead.

        ``background`` (checkpoint.async, torch engine): the model and optimizer state are copied to host memory
        (pinned on CUDA) and the RNG and trainer state captured here; the files are written by a thread while
        training goes on (several processes: ``dcp.async_save`` over ``mesh.checkpoint_group``), and rank 0
        finishes the checkpoint there the way a synchronous save does. The files are the same either way. The
        next save, ``wait`` and ``close`` wait for the write; ``wait`` raises its failure on every rank.

        In three stages (``_Save``): stage (every phase agreed by every rank), write (here, or by the writer
        thread), publish (rank 0 renames the directory into place and moves ``latest``)."""
        self.wait(mesh)  # the previous write is published (or has failed) before this one starts
        job = _Save(self, state, model, optimizer, config_yaml, tokenizer_dir, mesh, own_format, background)
        job.stage()
        if job.background:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridtron-checkpoint")
            self._pending = (job.final, self._writer.submit(job.finish_behind))
        else:
            job.publish()
        return job.final

    def _stager(self):
        """torch.distributed.checkpoint's stager: copies a state dict's tensors into host memory it keeps for the next
        save (pinned on CUDA, for fast copies), tensors that share storage staying shared. Reusing the memory is safe
        because a save first waits for the previous write. torch 2.11's stager empties itself after every stage
        (its copy table and its cached host memory), and a second stage then fails with ``KeyError: <class 'type'>``
        (seen on an H200, 2026-11-28): such a stager is replaced by a new one, so those versions pin host memory
        again at each save."""
        inner = getattr(self._staging, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self._staging = None
        if self._staging is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._staging = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                         use_shared_memory=False, use_async_staging=False,
                                                         use_non_blocking_copy=False))
        return self._staging

    def write_failed(self) -> bool:
        """Whether the background write in progress has ended, in failure (``wait`` raises it)."""
        return self._pending is not None and self._pending[1].done() and self._pending[1].result() is not None

    def wait(self, mesh=None) -> Path | None:
        """Wait for the background write in progress, if any (every rank calls this at the same point); returns the
        checkpoint it published. A failure on any rank raises on every rank, as a synchronous save's does: the
        partial checkpoint is removed and ``latest`` names the previous one."""
        if self._pending is None:
            return None
        (final, future), self._pending = self._pending, None
        err = future.result()
        if mesh.any(err is not None) if mesh is not None else err is not None:
            if err is not None:
                raise err
            prev = self.latest(warn=False)
            raise CheckpointError(f"checkpoint {final.name} was not saved: another rank failed while writing it (its "
                                  f"error names the cause); the partial checkpoint was removed and {LATEST} still "
                                  f"names {prev.name if prev else 'no checkpoint'}")
        return final

    def close(self) -> str | None:
        """Let a background write in progress finish (this rank alone: after a failure elsewhere no collective can
        be trusted) and free the staging memory. Returns that write's error, one line, or None."""
        err = None
        if self._pending is not None:
            (final, future), self._pending = self._pending, None
            if (e := future.result()) is not None:
                err = f"checkpoint {final.name}, written in the background, was not saved: {_first_line(e)}"
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        return err

    def _abort_save(self, err: Exception | None, tmp: Path, final: Path, writing: Path, main: bool):
        """Remove the partial checkpoint and raise: a full disk as DiskFullError, another rank's failure as
        CheckpointError, anything else as it is. ``latest`` still names the previous checkpoint."""
        full = err is not None and is_disk_full(err, self.dir)  # judged before the partial files go
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = self.latest(warn=False)
        kept = f"{LATEST} still names {prev.name if prev else 'no checkpoint'}"
        if full:
            raise DiskFullError(
                f"no space left on device writing {writing.name} of checkpoint {final.name} in {self.dir}; the "
                f"partial checkpoint was removed and {kept}: free space there (or lower checkpoint.keep_last), "
                f"then run the same command to resume"
            ) from None
        if err is None:
            raise CheckpointError(f"checkpoint {final.name} was not saved: another rank failed while writing it (its "
                                  f"error names the cause); the partial checkpoint was removed and {kept}")
        if isinstance(err, CheckpointException):  # DCP's report of every rank's failure, tracebacks included
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
            why = lines[-1][:200] if lines else "no message"
            raise CheckpointError(f"checkpoint {final.name}: writing {SHARDED}/ failed ({why}); the partial checkpoint "
                                  f"was removed and {kept}") from None
        raise err

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():  # re-saving the same step (e.g. exit right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        try:
            write_text_atomic(self.dir / LATEST, final.name)
        except OSError as e:  # write_text_atomic removed its scratch file
            if not is_disk_full(e):
                raise
            prev = self.latest(warn=False)
            raise DiskFullError(
                f"no space left on device writing {self.dir / LATEST}; checkpoint {final.name} is complete but "
                f"{LATEST} still names {prev.name if prev else 'no checkpoint'}: free space in {self.dir}, then run "
                f"the same command to resume"
            ) from None
        self._prune()

    def _prune(self) -> None:
        """Keep the last ``keep_last`` checkpoints, and any older one an export is reading (train/checkpoint_pins.py:
        it goes at a later save, once the export is done)."""
        prune(self.dir, self.complete(), self.keep_last)

    # ---- load ------------------------------------------------------------------------------
    @staticmethod
    def load_deepspeed(path: Path, engine, verify: bool = True) -> TrainerState:
        """Restore a DeepSpeed engine (model, optimizer partitions) and the trainer state and RNG from ``path``
        (``verify=False``: the caller has checked the files against the manifest)."""
        path = Path(path)
        if not (path / DEEPSPEED).is_dir():
            raise CheckpointError(f"checkpoint {path} was written by the torch engine; resume it with "
                                  f"parallel.engine=torch (its layouts resume one another), or start a new --run-dir")
        _require(path, ["trainer_state.json", "rng.pt"])
        if verify:
            verify_manifest(path)
        state, meta = _read_trainer_state(path)
        try:
            loaded, _ = engine.load_checkpoint(str(path / DEEPSPEED), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=False)
        except Exception as e:  # noqa: BLE001  (DeepSpeed raises assertions and runtime errors alike)
            raise CheckpointError(f"checkpoint {path}: DeepSpeed cannot resume it here ({type(e).__name__}: "
                                  f"{_first_line(e)}); a DeepSpeed checkpoint resumes at the dp size and ZeRO stage "
                                  f"it was saved with (see {path / 'config.yaml'})") from None
        if loaded is None:
            raise CheckpointError(f"checkpoint {path}: DeepSpeed found nothing to load in {path / DEEPSPEED}; "
                                  f"{resume_advice(path)}")
        restore_rng(_torch_load(path, "rng.pt"), meta["rng"])
        return state

    @staticmethod
    def load(
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        restore_rng_state: bool = True,
        verify: bool = True,
    ) -> TrainerState:
        """Restore ``model`` (and ``optimizer``, RNG states) from checkpoint ``path``, its files first verified
        against the manifest (``verify=False``: the caller has just done it). Every way a checkpoint can be
        missing, damaged or foreign is a CheckpointError naming the file."""
        path = Path(path)
        if (path / DEEPSPEED).is_dir() and optimizer is not None:
            raise CheckpointError(f"checkpoint {path} was written by the DeepSpeed engine; resume it with "
                                  f"parallel.engine=deepspeed at the same dp and ZeRO stage, or start a new --run-dir")
        sharded, deepspeed = (path / SHARDED).is_dir(), (path / DEEPSPEED).is_dir()
        needed = ["trainer_state.json"] + (["rng.pt"] if restore_rng_state else [])
        if sharded:
            needed.append(f"{SHARDED}/.metadata")
        elif not deepspeed:
            needed += ["model.safetensors"] + (["optimizer.pt"] if optimizer is not None else [])
        _require(path, needed)
        if verify:
            verify_manifest(path)
        state, meta = _read_trainer_state(path)
        if sharded:
            _load_sharded(path, model, optimizer)
        elif deepspeed:
            _load_deepspeed_weights(path, model)
        elif _has_dtensors(model) or _is_pipeline_part(model):
            _load_full_into_sharded(path, model, optimizer)
        else:
            _load_plain(path, model, optimizer)
        if restore_rng_state:
            rng_tensors = _torch_load(path, "rng.pt")
            try:
                restore_rng(rng_tensors, meta["rng"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint {path}: the RNG state in rng.pt / trainer_state.json is unusable "
                                      f"({type(e).__name__}); {resume_advice(path)}") from None
        return state



class _Save:
    """One ``CheckpointManager.save``: where its files go and the phases that write them. ``stage`` runs them with
    every rank agreeing after each (a failure anywhere removes the partial directory everywhere and raises
    everywhere); a synchronous save then writes the rest and ``publish``-es, a background one leaves the writing,
    the rest and the publishing to ``finish_behind`` in the writer thread."""

    def __init__(self, manager: CheckpointManager, state: TrainerState, model, optimizer, config_yaml: str,
                 tokenizer_dir: Path, mesh, own_format, background: bool):
        self.manager, self.model, self.optimizer, self.mesh = manager, model, optimizer, mesh
        self.own_format = own_format  # an engine's writer of its own files (DeepSpeed's), synchronous
        self.config_yaml, self.tokenizer_dir = config_yaml, tokenizer_dir
        self.background = background and not own_format
        self.sharded = (mesh is not None and mesh.distributed) or bool(own_format)
        self.main = mesh is None or mesh.is_main
        self.final = manager.dir / step_dir_name(state.step)
        self.tmp = manager.dir / f".tmp-{self.final.name}-sharded" if self.sharded else scratch_name(self.final)
        self.writing = self.tmp  # the file being written, for the error message
        self.upload = None  # background: what the thread writes (a DCP future, or the staged one-process state)
        self.rng_tensors, rng_plain = capture_rng()  # this step's RNG, whenever the files are written
        self.meta = {"step": state.step, "consumed_samples": state.consumed_samples, "tokens_seen": state.tokens_seen,
                     **({"extra": copy.deepcopy(state.extra)} if state.extra else {}), "rng": rng_plain}

    # ---- stage ---------------------------------------------------------------------------------------------------
    def stage(self) -> None:
        """The phases this process runs now (start, weights, and unless in the background the rest), each agreed
        by every rank."""
        phases = ((self.start, False), (self.weights, True)) + (() if self.background else ((self.rest, False),))
        for phase, everyone in phases:
            err = None
            watchdog.phase(f"checkpoint {phase.__name__}")  # a rank stuck writing is behind those that agree
            if everyone or self.main:
                try:
                    phase()
                except (Exception, CheckpointException) as e:  # noqa: BLE001  (reported below, after every rank knows)
                    err = e
                except BaseException:
                    shutil.rmtree(self.tmp, ignore_errors=True)  # interrupted: a killed save leaves nothing
                    raise
            watchdog.phase("checkpoint agree")
            if (self.mesh.any(err is not None) if self.mesh is not None else err is not None):
                self.manager._abort_save(err, self.tmp, self.final, self.writing, self.main)

    def start(self) -> None:
        self.manager.dir.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()

    def weights(self) -> None:
        """The model and optimizer state, in the run's format (every rank)."""
        if self.own_format:
            self._own_format()
        elif self.sharded:
            self._dcp()
        elif self.background:
            self.upload = self.manager._stager().stage({"model": self.model.state_dict(),
                                                        "optim": self.optimizer.state_dict()})
        else:
            self._plain(self.model, self.optimizer.state_dict())

    def _own_format(self) -> None:
        """The engine's own layout (DeepSpeed's: every rank writes its ZeRO partitions)."""
        self.writing = self.tmp / DEEPSPEED
        self.own_format(self.writing)

    def _dcp(self) -> None:
        """torch.distributed.checkpoint shards of the model in its own names and row order, and of the optimizer;
        in the background staged into host memory now and written by DCP's thread."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.writing = self.tmp / SHARDED
        msd, osd = canonical_state_dicts(self.model, *get_state_dict(self.model, self.optimizer,
                                                                     options=_flat_optimizer()))
        if self.background:
            self.upload = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(self.writing),
                                         process_group=self.mesh.checkpoint_group,
                                         async_stager=self.manager._stager())
        else:
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(self.writing))

    def _plain(self, weights, optim_sd) -> None:
        """One process: ``model.safetensors`` and ``optimizer.pt``; ``weights``: the model, or its staged state."""
        self.writing = self.tmp / "model.safetensors"
        if isinstance(weights, torch.nn.Module):
            save_model(weights, str(self.writing))
            honour_umask(self.writing)
        else:
            _save_model_state(weights, self.writing)
        self.writing = self.tmp / "optimizer.pt"
        torch.save(optim_sd, self.writing)

    def rest(self) -> None:
        """Rank 0: the RNG, trainer state, config, tokenizer and the manifest, all flushed to disk."""
        tmp = self.tmp
        for name, write in (("rng.pt", lambda p: torch.save(self.rng_tensors, p)),
                            ("trainer_state.json", lambda p: p.write_text(json.dumps(self.meta))),
                            ("config.yaml", lambda p: p.write_text(self.config_yaml)),
                            ("tokenizer", lambda p: shutil.copytree(self.tokenizer_dir, p, ignore=TOKENIZER_SKIP)),
                            (MANIFEST, lambda _p: write_manifest(tmp))):
            self.writing = tmp / name
            write(self.writing)
        self.writing = tmp
        _fsync_tree(tmp)

    # ---- write and publish ---------------------------------------------------------------------------------------
    def finish_behind(self) -> BaseException | None:
        """In the writer thread: the weights written, then (rank 0) the rest and the publish; returns the error to
        raise at ``wait``, or None."""
        try:
            if self.sharded:
                self.upload.result()  # every rank's shards and DCP's metadata are on disk (DCP agreed on it)
            else:
                self._plain(self.upload["model"], self.upload["optim"])
            if delay := float(os.environ.get(TEST_WRITE_DELAY, "0") or 0):
                time.sleep(delay)  # tests only: a write still in progress when the process is killed
            if self.main:
                self.rest()
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            try:
                self.manager._abort_save(e, self.tmp, self.final, self.writing, self.main)
            except BaseException as reported:  # noqa: BLE001  (the error in the words of a synchronous save)
                return reported
        if self.main:
            try:
                self.manager._publish(self.tmp, self.final)
            except Exception as e:  # noqa: BLE001
                return e
        return None

    def publish(self) -> None:
        """A synchronous save's end: rank 0 renames the directory into place and moves ``latest``; every rank raises
        if that failed."""
        err = None
        if self.main:
            try:
                self.manager._publish(self.tmp, self.final)
            except Exception as e:  # noqa: BLE001
                err = e
        if self.mesh.any(err is not None) if self.mesh is not None else err is not None:
            if err is not None:
                raise err
            raise CheckpointError(f"checkpoint {self.final.name} was saved but rank 0 could not make it {LATEST} "
                                  f"(its error names the cause)")


def _require(path: Path, names: list[str]) -> None:
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} has no {name}; it is incomplete or not a checkpoint "
                                  f"({resume_advice(path)})")


def _read_trainer_state(path: Path) -> tuple[TrainerState, dict]:
    """The TrainerState of checkpoint ``path`` and the whole trainer_state.json (its python RNG state too)."""
    try:
        meta = json.loads((path / "trainer_state.json").read_text())
        extra = meta.get("extra") or {}
        if not isinstance(extra, dict):
            raise TypeError("extra")
        return TrainerState(int(meta["step"]), int(meta["consumed_samples"]), int(meta["tokens_seen"]), extra), meta
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: trainer_state.json is unreadable ({type(e).__name__}); "
                              f"{resume_advice(path)}") from None


def _load_deepspeed_weights(path: Path, model: torch.nn.Module) -> None:
    """The fp32 weights of a DeepSpeed checkpoint (any ZeRO stage, any number of ranks) into a whole model."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(str(path / DEEPSPEED), tag=DEEPSPEED_TAG)
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise _fit_error(path, e) from None
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path}: {DEEPSPEED}/ cannot be read ({type(e).__name__}: "
                              f"{_first_line(e)}); {resume_advice(path)}") from None


def _fit_error(path: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} does not fit this model ({_first_line(e)}); resume with the model "
                           f"config it was saved with (see {path / 'config.yaml'}) or start a new --run-dir")


def _load_plain(path: Path, model: torch.nn.Module, optimizer) -> None:
    """A one-process checkpoint (model.safetensors + optimizer.pt) into a model whose tensors are whole."""
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error type for a torn file)
        if "size mismatch" not in str(e) and "shape" not in str(e).lower():
            raise CheckpointError(f"checkpoint {path}: model.safetensors cannot be read "
                                  f"({_first_line(e)}); {resume_advice(path)}") from None
        raise _fit_error(path, e) from None
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; use the model config in {path / 'config.yaml'} or a new --run-dir"
        )
    if optimizer is not None:
        opt_state = _torch_load(path, "optimizer.pt")
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: optimizer.pt does not fit this model's optimizer "
                                  f"({_first_line(e)}); resume with the train settings in "
                                  f"{path / 'config.yaml'} or start a new --run-dir") from None


def _has_dtensors(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _is_pipeline_part(model: torch.nn.Module) -> bool:
    """The layers of one pipeline-parallel rank (``train/parallel/pipeline.py``): the others are None."""
    return any(layer is None for layer in getattr(model, "layers", ()))


def _flat_optimizer():
    """DCP's optimizer state dict keyed by parameter name throughout (``state.<fqn>.<name>``, and the hyperparameters
    as ``param_groups.<fqn>.<name>``): torch's nested form numbers the param groups, and every pipeline stage has
    its own group 0 with its own parameters, of which DCP kept one stage's; the other stages then resumed with
    groups missing their hyperparameters (KeyError 'betas' at the first step: a pipeline run could not resume)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizer_is_flat(path: Path) -> bool:
    """Whether checkpoint ``path``'s dcp/ holds the flattened optimizer state (``_flat_optimizer``: saved since
    2026-11-29) rather than torch's nested form (numbered param groups: earlier checkpoints)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path / SHARDED)).read_metadata().state_dict_metadata
    # the nested form lists each numbered group's parameters (optim.param_groups.<i>.params); the flat one keys
    # every hyperparameter by parameter name and has no such list
    return not any(re.fullmatch(r"optim\.param_groups\.\d+\.params", k) for k in keys)


def _load_sharded(path: Path, model: torch.nn.Module, optimizer) -> None:
    """A multi-process checkpoint (``dcp/``) into ``model`` at whatever layout it has now (one process, or
    sharded or replicated over any number): torch.distributed.checkpoint reshards on load. The optimizer state in
    the form it was saved in (``_optimizer_is_flat``)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    with warnings.catch_warnings():  # one process, no process group: DCP says it loads alone, which is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            # (tensor-parallel fused weights are read in the model's row order, straight into these tensors)
            if optimizer is None:
                msd = get_model_state_dict(model)
                dcp.load({"model": canonical_state_dicts(model, msd, None)[0]}, checkpoint_id=str(path / SHARDED))
                set_model_state_dict(model, msd)
            else:
                options = _flat_optimizer() if _optimizer_is_flat(path) else None
                msd, osd = get_state_dict(model, optimizer, options=options)
                cmsd, cosd = canonical_state_dicts(model, msd, osd)
                dcp.load({"model": cmsd, "optim": cosd}, checkpoint_id=str(path / SHARDED))
                set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=options)
        except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's own type is a BaseException)
            lines = [ln.strip() for ln in str(e).splitlines()
                     if any(s in ln for s in ("Missing key", "Unexpected key", "size mismatch", "shape"))]
            if lines:  # the model is another one than the checkpoint's
                raise _fit_error(path, RuntimeError(lines[-1])) from None
            raise CheckpointError(f"checkpoint {path}: {SHARDED}/ cannot be read ({type(e).__name__}: "
                                  f"{_first_line(e)}); {resume_advice(path)}") from None


def _load_full_into_sharded(path: Path, model: torch.nn.Module, optimizer) -> None:
    """A one-process checkpoint into a sharded model (FSDP, tensor parallel) or a pipeline stage's part of one:
    every rank reads the whole files and keeps its shard of the tensors it holds."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    try:
        full = {canonical_name(k): v for k, v in
                load_file(str(path / "model.safetensors")).items()}
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path}: model.safetensors cannot be read ({_first_line(e)}); "
                              f"{resume_advice(path)}") from None
    want = get_model_state_dict(model)  # sharded: only its keys are used
    if _is_pipeline_part(model):  # the tensors of this rank's stages; the rest are other ranks'
        full = {k: v for k, v in full.items() if k in want}
    if sorted(full) != sorted(want):
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: missing {sorted(set(want) - set(full))[:5]}, unexpected "
            f"{sorted(set(full) - set(want))[:5]}; use the model config in {path / 'config.yaml'} or a new --run-dir")
    full = {k: to_row_order(model, k, v) for k, v in full.items()}  # tensor parallel's order of fused weights
    try:
        set_model_state_dict(model, full, options=opts)
    except (RuntimeError, ValueError) as e:
        raise _fit_error(path, e) from None
    if optimizer is None:
        return
    osd = _torch_load(path, "optimizer.pt")
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    try:  # torch's optimizer state is keyed by position; the distributed API keys it by parameter name
        if _is_pipeline_part(model):  # positions in the saving run's optimizer, which held the whole model
            order = _whole_model_param_order(path, model)
        keep = set(names.values())
        by_name = {"state": {order[int(i)]: {n: to_row_order(model, order[int(i)], t) if torch.is_tensor(t) else t
                                             for n, t in v.items()}
                             for i, v in osd["state"].items() if order[int(i)] in keep},
                   "param_groups": [{**g, "params": [order[int(i)] for i in g["params"] if order[int(i)] in keep]}
                                    for g in osd["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, by_name, options=opts)
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path}: optimizer.pt does not fit this model's optimizer "
                              f"({_first_line(e)}); resume with the train settings in {path / 'config.yaml'} "
                              f"or start a new --run-dir") from None


def _whole_model_param_order(path: Path, part: torch.nn.Module) -> list[str]:
    """Parameter names in the order of the optimizer that wrote ``path`` over the whole model (its groups as the
    saved train config formed them)."""
    from hybridtron.configs import load_config
    from hybridtron.train.optim import param_groups

    saved = load_config(str(path / "config.yaml"))
    with torch.device("meta"):
        whole = type(part)(saved.model, part.vocab_size)
    names = {id(p): n for n, p in whole.named_parameters()}
    return [names[id(p)] for g in param_groups(whole, saved.train) for p in g["params"]]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:200] if text else type(e).__name__)


def _torch_load(path: Path, name: str):
    try:
        return torch.load(path / name, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001  (a torn zip or pickle surfaces as several error types)
        raise CheckpointError(f"checkpoint {path}: {name} cannot be read ({type(e).__name__}: {_first_line(e)}); "
                              f"{resume_advice(path)}") from None
