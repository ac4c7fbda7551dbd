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
from tqdm import tqdm

from hybridtron.configs import ConfigError, JobConfig, load_config
from hybridtron.train import kernel_choice, watchdog
from hybridtron.train import step as step_mod
from hybridtron.train.checkpoint import CheckpointError, CheckpointManager, TrainerState, resume_advice, verify_manifest
from hybridtron.train.device import autocast_context
from hybridtron.train.engine import Engine
from hybridtron.train.errors import NonFiniteLossError
from hybridtron.train.grad_dump import GradDump
from hybridtron.train.metrics import MetricsLogger, device_peak_flops, peak_memory_gib
from hybridtron.train.parallel.context_parallel import local_piece
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.profile import StepProfiler
from hybridtron.train.run_dir import LAST_STOP, STOP_REQUEST
from hybridtron.train.schedule import Plan, resume_plan, warmup_note
from hybridtron.train.spike import SpikeGuard


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
             loss_of=None) -> float:
    """Mean loss over the first ``n_batches`` validation micro-batches (the same ones every time), computed as
    training computes it: the batches' document ids reach the model exactly when it was trained with them
    (``model.doc_mask``), so a model trained across document boundaries is evaluated across them too.
    ``loss_of``: a batch's mean loss (the run's engine's ``eval_loss``; default: ``model``'s)."""
    was_training = model.training
    model.eval()
    loader = val_loader_factory()
    total = 0.0
    for _ in range(n_batches):
        b = local_piece({k: v.to(device) for k, v in next(loader).items() if k in step_mod.batch_keys(doc_mask)},
                        mesh)
        with autocast_context(device, amp_dtype):
            total += loss_of(b) if loss_of is not None else step_mod.eval_loss(model, b)
    model.train(was_training)
    if mesh is not None and mesh.cp > 1:  # each context-parallel rank saw its piece of the sequences
        return mesh.mean(total / n_batches)
    return total / n_batches


class Trainer:
    """The loop over ``engine`` (train/engine.py: what runs a step and applies it, for the run's layout), which it
    never asks about: the same loop for every engine and layout."""

    def __init__(self, cfg: JobConfig, engine: Engine, train_loader, val_loader_factory, *, device, amp_dtype,
                 run_dir: Path, config_yaml: str, tokenizer_dir: Path, flops_per_token: float, mesh: Mesh | None = None):
        self.cfg, self.engine, self.model = cfg, engine, engine.model
        self.train_loader, self.val_loader_factory = train_loader, val_loader_factory
        self.device, self.amp_dtype = device, amp_dtype
        self.run_dir, self.config_yaml, self.tokenizer_dir = run_dir, config_yaml, tokenizer_dir
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last)
        self.state = TrainerState()
        self.flops_per_token = flops_per_token
        self.mesh = mesh or Mesh()  # one process unless the recipe launched several
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
        self.state = self.engine.load(latest)
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
        return self.engine.save(self.ckpt, self.state, self.config_yaml, self.tokenizer_dir,
                                background=self.cfg.checkpoint.async_save)

    # ---- one step: the engine runs the micro-batches (forward and backward), then the shared update ----

    def train_step(self) -> dict:
        t = self.cfg.train
        self.engine.before_step(self.state.step)
        lr = self.plan.lr(self.state.step)
        self.engine.set_lr(lr)  # with DeepSpeed: its optimizer's groups, our schedule
        batches = step_mod.micro_batches(self.train_loader, t.grad_accum_steps, self.mesh)
        watchdog.phase("token count")  # an all-reduce: a rank still reading its batches is behind the others
        weights = step_mod.loss_weights(batches, self.mesh)  # each micro-batch's share of the global batch's tokens
        # the auxiliary losses in the loss, by kind (None: a pipeline's stages hold them apart, not split)
        local, aux = self.engine.run(batches, weights)
        # the global batch's loss (see train/step.py) and its auxiliary parts, reduced alike in one all-reduce;
        # every data rank has the same modules, so the same kinds
        kinds = sorted(aux or {})
        loss, *means = self.mesh.means([local, *(aux[k] for k in kinds)])
        parts = {}
        if aux is not None:
            parts = dict(zip(kinds, means, strict=True))
            parts = {"lm_loss": loss - sum(parts.values()), **parts}
        grad_norm, finite = self._update(loss)
        model_metrics = self.engine.model_metrics()
        self.state.step += 1
        tokens = step_mod.tokens_of(batches) * self.mesh.data_ranks  # every data (and context) rank took as many
        self.state.tokens_seen += tokens
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "skipped": not finite,
                "loss_parts": parts, "model_metrics": model_metrics}

    def _update(self, loss: float) -> tuple[float, bool]:
        """After the backward: the gradient hooks, clipping by the global norm, the loss-spike guard and (if all is
        finite) the optimizer step. Returns (grad_norm, finite)."""
        watchdog.phase("optimizer")
        self.engine.reduce_gradients()
        for hook in self.grad_hooks:  # e.g. train.dump_grads: the reduced, unclipped gradients
            hook(self)
        # the loss-spike guard may hold the update back (DeepSpeed's engine applies it anyway: warn or stop only)
        return self.engine.update(loss, self.spike.allows)

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
        """Train to ``train.max_steps`` (or a stop), resuming from the latest checkpoint; every rank runs this."""
        t = self.cfg.train
        last_ckpt, log = self._resume(log)
        main = self.mesh.is_main
        run = _RunParts(self, log)  # metrics, progress bar, profiler, hang watch: opened here, closed below
        val_loss, stopped_by = None, "max_steps"
        try:
            with StopSignal(self.run_dir / STOP_REQUEST) as stop:
                while self.state.step < t.max_steps:
                    out, dt = self._timed_step(run)
                    step, rec = self.state.step, self._record(out, dt)
                    self._guard(step, out, rec, run.metrics, log)  # the spike guard and the NaN policy: may raise
                    if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
                        val_loss = self._evaluate(step, out, rec, run.bar, main)
                    run.after_step(step, out, rec)
                    if self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0:
                        last_ckpt = self.save()
                    if run.prof:
                        run.prof.after(step)
                    if (stopped_by := self._stop_reason(stop, step, log)) != "max_steps":
                        break
                # A signal or exit_interval stop always saves: that is what makes it resumable.
                if ((self.cfg.checkpoint.at_exit or stopped_by != "max_steps")
                        and (last_ckpt is None or last_ckpt.name != f"step_{self.state.step:08d}")):
                    last_ckpt = self.save()
                self.ckpt.wait(self.mesh)  # a background save is complete, and latest, before the run ends
        finally:
            run.close()
            if (lost := self.ckpt.close()) is not None:  # only after an error here: a background save still went on
                print(f"[hybridtron] warning: {lost}", file=sys.stderr, flush=True)
        return FitResult(self.state, last_ckpt, val_loss, stopped_by)

    # ---- the parts of fit --------------------------------------------------------------------------------------
    def _resume(self, log) -> tuple[Path | None, object]:
        """Resume from the latest checkpoint if there is one, and say so; returns (it, the log this rank uses:
        only rank 0 reports progress, every rank still raises its own errors)."""
        resumed_from = self.resume_if_possible(log)
        if resumed_from is not None:
            log(f"resumed from {resumed_from} (step {self.state.step})")
            if self.resume_note:
                log(self.resume_note)
        if not self.mesh.is_main:
            log = _quiet
        if resumed_from is None and (note := warmup_note(self.cfg.train)):
            log(note)  # a short run of a preset made for a long one: the warm-up it takes instead
        return resumed_from, log

    def _timed_step(self, run: _RunParts) -> tuple[dict, float]:
        """One training step under the hang watch and the profiler; (its results, its wall time). This process's
        first step meets (and measures) every kernel shape class first, and then shares the choices."""
        t0 = time.perf_counter()
        if run.watch:
            run.watch.step_begin(self.state.step + 1)
        with (kernel_choice.first_step(self.device, self.cfg.train.compile) if run.first else contextlib.nullcontext(),
              run.prof.guard(self.state.step + 1) if run.prof else contextlib.nullcontext()):
            out = self.train_step()
        if run.first:
            kernel_choice.share(self.mesh, self.run_dir, run.log)
            run.first = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        if run.watch:
            run.watch.step_end()
            if not run.watch.armed:  # after the first step: compile and kernel tuning are not watched
                run.watch.arm(watchdog.training_groups(self.mesh))
        return out, dt

    def _record(self, out: dict, dt: float) -> dict:
        """The step's line of metrics.jsonl."""
        rec = {"step": self.state.step, "loss": out["loss"], **out["loss_parts"], "lr": out["lr"],
               "grad_norm": out["grad_norm"], "tokens_per_s": out["tokens"] / dt, "tokens_seen": self.state.tokens_seen}
        if self.peak_flops:  # the global token rate against every device's peak together
            rec["mfu"] = self.flops_per_token * rec["tokens_per_s"] / (self.peak_flops * self.mesh.world_size)
        rec["peak_mem_gib"] = peak_memory_gib(self.device)
        rec.update(out["model_metrics"])
        return rec

    def _guard(self, step: int, out: dict, rec: dict, metrics, log) -> None:
        """The loss-spike guard (train.spike_policy) and the non-finite policy (train.nan_policy): raise to stop
        (the bad step's line logged first: it is the first thing a user looks for), or note a skipped update."""
        if (why := self.spike.after_step(step, rec, log)) is not None:
            metrics.log(rec)
            raise LossSpikeError(why)
        if not out["skipped"]:
            return
        rec["skipped"] = True
        if self.cfg.train.nan_policy == "stop":
            metrics.log(rec)
            raise NonFiniteLossError(
                f"non-finite loss={out['loss']} / grad_norm={out['grad_norm']} at step {step}; "
                f"stopped without saving (the last good checkpoint is kept). Lower train.lr, "
                f"or set train.nan_policy=skip to drop such steps."
            )
        log(f"step {step}: non-finite loss/grad norm, update skipped (train.nan_policy=skip)")

    def _evaluate(self, step: int, out: dict, rec: dict, bar, main: bool) -> float:
        """The validation loss (train.eval_batches), into ``rec`` and a line above the progress bar."""
        watchdog.phase("eval")
        val_loss = evaluate(self.model, self.val_loader_factory, self.cfg.train.eval_batches, self.device,
                            self.amp_dtype, doc_mask=self.cfg.model.doc_mask, mesh=self.mesh,
                            loss_of=self.engine.eval_loss)
        rec["val_loss"], rec["val_ppl"] = val_loss, math.exp(min(val_loss, 50.0))
        tag = f"[hybridtron rank 0/{self.mesh.world_size}] " if self.mesh.world_size > 1 else ""
        (bar.write if main else _quiet)(f"{tag}step {step}: loss {out['loss']:.4f}  val_loss {val_loss:.4f}  "
                                        f"val_ppl {rec['val_ppl']:.2f}  lr {out['lr']:.2e}")
        return val_loss

    def _stop_reason(self, stop: StopSignal, step: int, log) -> str:
        """Why the loop stops after ``step``: "signal" (on any rank, or a background save that failed on any:
        every rank stops at the same step), "exit_interval", else "max_steps" (go on, or the last step)."""
        if self.mesh.any(stop.received is not None or self.ckpt.write_failed()):
            self.ckpt.wait(self.mesh)  # raises a failed background save's error; else waits for it
            name = signal.Signals(stop.received).name if stop.received else "on another rank"
            log(f"received signal {name}; saving a checkpoint at step {step} and stopping")
            return "signal"
        t = self.cfg.train
        if t.exit_interval and step % t.exit_interval == 0 and step < t.max_steps:
            return "exit_interval"
        return "max_steps"


class _RunParts:
    """What ``Trainer.fit`` opens for a run and closes after it: the metrics logger (rank 0 writes metrics.jsonl
    and TensorBoard), the progress bar (a bar on a terminal; in a log file, a plain line every 10 logged steps),
    the profiler (train.profile: traces and memory snapshots of chosen steps; None and no cost when off) and the
    hang watch (train.hang_timeout_s: every rank's step and phase where the others can read them, a hang named
    and ended; the stragglers' report at each log step)."""

    def __init__(self, trainer: Trainer, log):
        t, self.trainer, self.log = trainer.cfg.train, trainer, log
        main, step = trainer.mesh.is_main, trainer.state.step
        self.metrics = MetricsLogger(trainer.run_dir, resume_step=step) if main else _NoMetrics()
        trainer.model.train()
        self.interactive = t.progress_bar and sys.stderr.isatty() and main
        self.bar = tqdm(total=t.max_steps, initial=step, disable=not self.interactive, desc="train",
                        dynamic_ncols=True)
        self.prof = StepProfiler.for_run(t.profile, trainer.run_dir, trainer.mesh.rank, trainer.device, step, log)
        self.watch = watchdog.watch_for(trainer.cfg, trainer.run_dir, trainer.mesh, checkpoint_dir=trainer._latest_name,
                                        last_stop=trainer.run_dir / LAST_STOP)
        self.last_log = None  # the previous log step: its rank times are complete on every rank (stragglers)
        self.first = True  # this process's first step is still to come

    def after_step(self, step: int, out: dict, rec: dict) -> None:
        """The step's logs: rank times at a log step, its metrics line, the bar and the plain progress line."""
        t = self.trainer.cfg.train
        if self.watch and step % t.log_every == 0:
            self.trainer._rank_times(self.watch, step, self.last_log, rec, self.log)
            self.last_log = step
        if step % t.log_every == 0 or "val_loss" in rec or "spike" in rec:
            self.metrics.log(rec)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{out['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if t.progress_bar and not self.interactive and step % (10 * t.log_every) == 0:
            self.log(f"step {step}/{t.max_steps}  loss {out['loss']:.4f}  lr {out['lr']:.2e}  "
                     f"grad_norm {out['grad_norm']:.3f}  {rec['tokens_per_s']:,.0f} tok/s")

    def close(self) -> None:
        if self.watch:
            self.watch.close()
        if self.prof:
            self.prof.close()
        self.bar.close()
        self.metrics.close()
