"""The train loop: steps, evaluation, logging, checkpoints, and stopping cleanly.

Everything it needs is built by the recipe in ``train/recipe.py`` and handed in; side concerns
(metrics, checkpoints, signals, the non-finite-loss guard) stay small and separate.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

from hybridtron.configs import ConfigError, JobConfig, load_config

from . import kernel_choice, watchdog
from . import step as step_mod
from .checkpoint import CheckpointError, CheckpointManager, TrainerState, resume_advice, verify_manifest
from .device import autocast_context
from .errors import NonFiniteLossError
from .grad_dump import GradDump
from .metrics import MetricsLogger, device_peak_flops, peak_memory_gib
from .model_hooks import after_step, before_step
from .parallel.context_parallel import local_piece
from .parallel.expert_parallel import sync_expert_grads
from .parallel.grad_norm import clip_grad_norm
from .parallel.mesh import Mesh
from .profile import StepProfiler
from .run_dir import LAST_STOP, STOP_REQUEST
from .schedule import Plan, resume_plan, warmup_note
from .spike import SpikeGuard
from .step import whole


class LossSpikeError(NonFiniteLossError):
    """train.spike_policy=stop met a loss spike (or skip met too many in a row): stopped without saving."""


class StopSignal:
    """Turns the first SIGTERM/SIGINT/SIGUSR1 into a request to checkpoint and stop at the end of the step.

    SIGUSR1 is SLURM's warning before a job's time limit (``sbatch --signal``); SIGTERM is ``scancel`` or a
    preemption. The SLURM job script (``slurm/template.sbatch``) requeues the job after a SIGUSR1 stop.

    ``request_file``: where the job script records a signal that came before the handlers existed (the training
    processes ignore USR1 and TERM until then, so that an early one does not kill them): read once the handlers
    are in, so a signal is either in the file or reaches a handler."""

    def __init__(self, request_file: Path | None = None):
        self.received: int | None = None
        self._previous = {}
        self._request_file = request_file

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)
        if self._request_file is not None and self.received is None:
            try:
                name = self._request_file.read_text().strip()
            except OSError:
                name = ""
            if name in ("USR1", "TERM"):
                self.received = getattr(signal, f"SIG{name}")
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _quiet(*_a, **_k) -> None:
    pass


class _NoMetrics:
    """The metrics logger of ranks other than 0."""

    def log(self, _rec) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class FitResult:
    state: TrainerState
    last_checkpoint: Path | None
    final_val_loss: float | None
    stopped_by: str  # "max_steps" | "exit_interval" | "signal"


@torch.no_grad()
def evaluate(model: nn.Module, val_loader_factory, n_batches: int, device, amp_dtype, *, doc_mask: bool, mesh=None,
             pipeline=None) -> float:
    """Mean loss over the first ``n_batches`` validation micro-batches (the same ones every time), computed as
    training computes it: the batches' document ids reach the model exactly when it was trained with them
    (``model.doc_mask``), so a model trained across document boundaries is evaluated across them too."""
    was_training = model.training
    model.eval()
    loader = val_loader_factory()
    total = 0.0
    for _ in range(n_batches):
        b = local_piece({k: v.to(device) for k, v in next(loader).items() if k in step_mod.batch_keys(doc_mask)},
                        mesh)
        with autocast_context(device, amp_dtype):
            if pipeline is not None:
                total += pipeline.eval_loss(b)
            else:
                total += whole(model(b["input_ids"], b.get("doc_ids"), labels=b["labels"])).float().item()
    model.train(was_training)
    if mesh is not None and mesh.cp > 1:  # each context-parallel rank saw its piece of the sequences
        return mesh.mean(total / n_batches)
    return total / n_batches


class Trainer:
    def __init__(self, cfg: JobConfig, model, optimizer, train_loader, val_loader_factory, *, device, amp_dtype,
                 run_dir: Path, config_yaml: str, tokenizer_dir: Path, flops_per_token: float, mesh: Mesh | None = None,
                 engine=None, pipeline=None):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.train_loader, self.val_loader_factory = train_loader, val_loader_factory
        self.device, self.amp_dtype = device, amp_dtype
        self.run_dir, self.config_yaml, self.tokenizer_dir = run_dir, config_yaml, tokenizer_dir
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last)
        self.state = TrainerState()
        self.flops_per_token = flops_per_token
        self.mesh = mesh or Mesh()  # one process unless the recipe launched several
        self.engine = engine  # a DeepSpeed engine (parallel.engine=deepspeed) wrapping model and optimizer, or None
        self.pipeline = pipeline  # parallel.pp > 1: this rank's stages of ``model`` and their schedule, or None
        self.peak_flops = device_peak_flops(device, cfg.train.peak_flops)
        self.plan = Plan.from_config(cfg.train)  # the LR schedule; a resume may continue its checkpoint's instead
        self.resume_note: str | None = None  # what a resume made of a changed schedule, for the log
        self.spike = SpikeGuard(cfg.train.spike_policy, cfg.train.spike_threshold, cfg.train.spike_window)
        # called after each step's backward, before clipping, on every rank
        self.grad_hooks = [GradDump(cfg.train.dump_grads, run_dir)] if cfg.train.dump_grads else []

    def resume_if_possible(self, log=None) -> Path | None:
        self.ckpt.clean_partial(log if self.mesh.is_main else None)
        latest = self.ckpt.latest()
        if latest is None:
            return None
        # Each process hashes its share of the checkpoint's files; a damaged one stops them all, and the process
        # that found it names the file.
        found = None
        try:
            verify_manifest(latest, share=(self.mesh.rank, self.mesh.world_size))
        except CheckpointError as e:
            found = e
        if self.mesh.any(found is not None):
            raise found or CheckpointError(f"checkpoint {latest}: another process found a damaged file (its error "
                                           f"line names it); {resume_advice(latest)}")
        if self.engine is not None:
            self.state = CheckpointManager.load_deepspeed(latest, self.engine, verify=False)
        else:
            self.state = CheckpointManager.load(latest, self.model, self.optimizer, verify=False)
        self.train_loader.load_state_dict({"consumed_samples": self.state.consumed_samples})
        self.spike.load_state_dict(self.state.extra.get("spike_guard", {}))
        self.plan, self.resume_note = resume_plan(self._checkpoint_plan(latest), self.cfg.train, self.state.step,
                                                  self.cfg.train.schedule_on_resume)
        return latest

    def _checkpoint_plan(self, ckpt: Path) -> Plan:
        """The LR plan checkpoint ``ckpt`` was on: saved with it, or (older checkpoints) its config's schedule."""
        if "schedule" in self.state.extra:
            try:
                return Plan.from_dict(self.state.extra["schedule"])
            except TypeError:
                pass
        try:
            return Plan.from_config(load_config(str(ckpt / "config.yaml")).train)
        except (ConfigError, OSError):
            return self.plan

    def save(self) -> Path:
        watchdog.phase("checkpoint")
        self.state.consumed_samples = self.train_loader.state_dict()["consumed_samples"]
        self.state.extra["schedule"] = self.plan.to_dict()
        self.state.extra["spike_guard"] = self.spike.state_dict()
        return self.ckpt.save(self.state, self.model, self.optimizer, self.config_yaml, self.tokenizer_dir,
                              mesh=self.mesh, engine=self.engine, background=self.cfg.checkpoint.async_save)

    # ---- one step: the engine's runner (forward and backward of the micro-batches), then the shared update ----

    def train_step(self) -> dict:
        t = self.cfg.train
        if self.engine is None:
            before_step(self.model, self.optimizer, self.cfg, self.state.step)
        lr = self.plan.lr(self.state.step)
        for group in self.optimizer.param_groups:  # with DeepSpeed: its optimizer's groups, our schedule
            group["lr"] = lr
        batches = step_mod.micro_batches(self.train_loader, t.grad_accum_steps, self.mesh)
        watchdog.phase("token count")  # an all-reduce: a rank still reading its batches is behind the others
        weights = step_mod.loss_weights(batches, self.mesh)  # each micro-batch's share of the global batch's tokens
        run = dict(device=self.device, doc_mask=self.cfg.model.doc_mask)
        aux = None  # the auxiliary losses in the loss, by kind (a pipeline's stages hold them apart: not split)
        if self.engine is not None:
            local, aux = step_mod.run_deepspeed(self.engine, batches, weights, **run)
        elif self.pipeline is not None:
            local = step_mod.run_pipeline(self.pipeline, batches, weights, amp_dtype=self.amp_dtype, **run)
        else:
            local, aux = step_mod.run_torch(self.model, batches, weights, amp_dtype=self.amp_dtype, mesh=self.mesh,
                                            sharded=self._sharded(), hsdp_modules=self._hsdp_modules(), **run)
        # the global batch's loss (see train/step.py) and its auxiliary parts, reduced alike in one all-reduce;
        # every data rank has the same modules, so the same kinds
        kinds = sorted(aux or {})
        loss, *means = self.mesh.means([local, *(aux[k] for k in kinds)])
        parts = {}
        if aux is not None:
            parts = dict(zip(kinds, means, strict=True))
            parts = {"lm_loss": loss - sum(parts.values()), **parts}
        grad_norm, finite = self._update(loss)
        model_metrics = after_step(self.model, reduce=self.mesh.sum_)
        if self.pipeline is not None:
            model_metrics = self.pipeline.metrics_from_all_stages(model_metrics)
        self.state.step += 1
        tokens = step_mod.tokens_of(batches) * self.mesh.data_ranks  # every data (and context) rank took as many
        self.state.tokens_seen += tokens
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "skipped": not finite,
                "loss_parts": parts, "model_metrics": model_metrics}

    def _update(self, loss: float) -> tuple[float, bool]:
        """After the backward: the gradient hooks, clipping by the global norm, the loss-spike guard and (if all is
        finite) the optimizer step. Returns (grad_norm, finite)."""
        watchdog.phase("optimizer")
        if self.engine is None:
            sync_expert_grads(self.model, self.mesh)
        for hook in self.grad_hooks:  # e.g. train.dump_grads: the reduced, unclipped gradients
            hook(self)
        if self.engine is not None:  # DeepSpeed clips and steps inside; a non-finite loss never reaches it
            if not math.isfinite(loss):
                return float("nan"), False
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
            if math.isfinite(grad_norm):
                self.spike.allows(loss, grad_norm)  # the engine applied the step: warn or stop only
            return grad_norm, True
        if self.pipeline is not None:  # the norm over every stage, the tied embedding's copies counted once
            grad_norm = self.pipeline.clip_grad_norm(self.cfg.train.grad_clip)
        else:  # over every rank's shards (FSDP, TP, EP)
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite and self.spike.allows(loss, grad_norm):  # the loss-spike guard may hold the update back
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def _sharded(self) -> bool:
        """FSDP2 shards the model: it casts the parameters it gathers itself (MixedPrecisionPolicy)."""
        if not hasattr(self, "_is_sharded"):
            self._is_sharded = any(isinstance(m, FSDPModule) for m in self.model.modules())
        return self._is_sharded

    def _hsdp_modules(self) -> list[nn.Module]:
        """The FSDP2 modules of a hybrid-sharded model (none otherwise), found once."""
        if not hasattr(self, "_hsdp"):
            hybrid = getattr(self.mesh, "hsdp_mesh", None) is not None
            self._hsdp = [m for m in self.model.modules() if hasattr(m, "set_requires_all_reduce")] if hybrid else []
        return self._hsdp

    def _latest_name(self) -> str | None:
        latest = self.ckpt.latest()
        return latest.name if latest is not None else None

    def _rank_times(self, watch, step: int, last_log: int | None, rec: dict, log) -> None:
        """At a log step: publish this rank's step times; rank 0 adds every rank's split (median and slowest) over
        the last window to ``rec`` and names the stragglers (train.straggler_margin), in the log too."""
        watch.publish_times(step)
        if not self.mesh.is_main or last_log is None or (got := watch.rank_times(last_log)) is None:
            return
        first, times = got
        rec["rank_times"] = watchdog.split_summary(times)
        if found := watchdog.find_stragglers(times, self.cfg.train.straggler_margin):
            rec["stragglers"] = found
            log(watchdog.straggler_line(found, first, last_log))

    def fit(self, log=print) -> FitResult:
        t, cfg = self.cfg.train, self.cfg
        resumed_from = self.resume_if_possible(log)
        if resumed_from is not None:
            log(f"resumed from {resumed_from} (step {self.state.step})")
            if self.resume_note:
                log(self.resume_note)
        main = self.mesh.is_main
        if not main:
            log = _quiet  # only rank 0 reports progress; every rank still raises its own errors
        if resumed_from is None and (note := warmup_note(t)):
            log(note)  # a short run of a preset made for a long one: the warm-up it takes instead
        # 0 without a checkpoint; only rank 0 writes metrics.jsonl and TensorBoard
        metrics = MetricsLogger(self.run_dir, resume_step=self.state.step) if main else _NoMetrics()
        self.model.train()
        # A bar only on a terminal; in a log file (SLURM output) a plain line every 10 logged steps instead.
        interactive = t.progress_bar and sys.stderr.isatty() and main
        bar = tqdm(total=t.max_steps, initial=self.state.step, disable=not interactive, desc="train",
                   dynamic_ncols=True)
        last_ckpt, val_loss, stopped_by = resumed_from, None, "max_steps"
        # train.profile: traces and memory snapshots of chosen steps; None (and no cost) when off
        prof = StepProfiler.for_run(t.profile, self.run_dir, self.mesh.rank, self.device, self.state.step, log)
        # train.hang_timeout_s: every rank's step and phase where the others can read them, a hang named and ended
        watch = watchdog.watch_for(cfg, self.run_dir, self.mesh, checkpoint_dir=self._latest_name,
                                   last_stop=self.run_dir / LAST_STOP)
        last_log = None  # the previous log step: its rank times are complete on every rank (stragglers)
        try:
            with StopSignal(self.run_dir / STOP_REQUEST) as stop:
                first = True  # this process's first step: it meets (and measures) every kernel shape class first
                while self.state.step < t.max_steps:
                    t0 = time.perf_counter()
                    if watch:
                        watch.step_begin(self.state.step + 1)
                    with (kernel_choice.first_step(self.device, t.compile) if first else contextlib.nullcontext(),
                          prof.guard(self.state.step + 1) if prof else contextlib.nullcontext()):
                        out = self.train_step()
                    if first:
                        kernel_choice.share(self.mesh, self.run_dir, log)
                        first = False
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    dt = time.perf_counter() - t0
                    if watch:
                        watch.step_end()
                        if not watch.armed:  # after the first step: compile and kernel tuning are not watched
                            watch.arm(watchdog.training_groups(self.mesh))
                    step = self.state.step
                    rec = {"step": step, "loss": out["loss"], **out["loss_parts"], "lr": out["lr"],
                           "grad_norm": out["grad_norm"], "tokens_per_s": out["tokens"] / dt,
                           "tokens_seen": self.state.tokens_seen}
                    if self.peak_flops:  # the global token rate against every device's peak together
                        rec["mfu"] = (self.flops_per_token * rec["tokens_per_s"]
                                      / (self.peak_flops * self.mesh.world_size))
                    rec["peak_mem_gib"] = peak_memory_gib(self.device)
                    rec.update(out["model_metrics"])
                    if (why := self.spike.after_step(step, rec, log)) is not None:
                        metrics.log(rec)
                        raise LossSpikeError(why)
                    if out["skipped"]:
                        rec["skipped"] = True
                        if t.nan_policy == "stop":
                            metrics.log(rec)  # the bad step's line is the first thing a user looks for
                            raise NonFiniteLossError(
                                f"non-finite loss={out['loss']} / grad_norm={out['grad_norm']} at step {step}; "
                                f"stopped without saving (the last good checkpoint is kept). Lower train.lr, "
                                f"or set train.nan_policy=skip to drop such steps."
                            )
                        log(f"step {step}: non-finite loss/grad norm, update skipped (train.nan_policy=skip)")
                    if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
                        watchdog.phase("eval")
                        val_loss = evaluate(self.model, self.val_loader_factory, t.eval_batches, self.device,
                                            self.amp_dtype, doc_mask=self.cfg.model.doc_mask, mesh=self.mesh,
                                            pipeline=self.pipeline)
                        rec["val_loss"], rec["val_ppl"] = val_loss, math.exp(min(val_loss, 50.0))
                        tag = f"[hybridtron rank 0/{self.mesh.world_size}] " if self.mesh.world_size > 1 else ""
                        (bar.write if main else _quiet)(f"{tag}step {step}: loss {out['loss']:.4f}  val_loss {val_loss:.4f}  "
                                  f"val_ppl {rec['val_ppl']:.2f}  lr {out['lr']:.2e}")
                    if watch and step % t.log_every == 0:
                        self._rank_times(watch, step, last_log, rec, log)
                        last_log = step
                    if step % t.log_every == 0 or "val_loss" in rec or "spike" in rec:
                        metrics.log(rec)
                    bar.update(1)
                    bar.set_postfix(loss=f"{out['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                    if t.progress_bar and not interactive and step % (10 * t.log_every) == 0:
                        log(f"step {step}/{t.max_steps}  loss {out['loss']:.4f}  lr {out['lr']:.2e}  "
                            f"grad_norm {out['grad_norm']:.3f}  {rec['tokens_per_s']:,.0f} tok/s")
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                        last_ckpt = self.save()
                    if prof:
                        prof.after(step)
                    # every rank stops at the same step, for a signal or a background save that failed on any rank
                    if self.mesh.any(stop.received is not None or self.ckpt.write_failed()):
                        self.ckpt.wait(self.mesh)  # raises a failed background save's error; else waits for it
                        stopped_by = "signal"
                        log(f"received signal {signal.Signals(stop.received).name if stop.received else 'on another rank'}; saving a checkpoint at step {step} and stopping")
                        break
                    if t.exit_interval and step % t.exit_interval == 0 and step < t.max_steps:
                        stopped_by = "exit_interval"
                        break
                # A signal or exit_interval stop always saves: that is what makes it resumable.
                if (cfg.checkpoint.at_exit or stopped_by != "max_steps") and (last_ckpt is None or last_ckpt.name != f"step_{self.state.step:08d}"):
                    last_ckpt = self.save()
                self.ckpt.wait(self.mesh)  # a background save is complete, and latest, before the run ends
        finally:
            if watch:
                watch.close()
            if prof:
                prof.close()
            bar.close()
            metrics.close()
            if (lost := self.ckpt.close()) is not None:  # only after an error here: a background save still went on
                print(f"[hybridtron] warning: {lost}", file=sys.stderr, flush=True)
        return FitResult(self.state, last_ckpt, val_loss, stopped_by)
