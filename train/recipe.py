"""The recipe of a run: config -> data -> model -> parallelize -> trainer -> fit, for one process of the job.

``train_run`` is what ``hybridtron train`` (and ``ablate``, for each variant) runs in every process: the layout
checks and the process group (``Mesh.setup``), the run directory's lock, then ``build_run``, the loop, and the
closing report. Nothing here parses a command line: hybridtron/cli.py does, and calls this.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hybridtron.atomic import write_text_atomic
from hybridtron.configs import JobConfig
from hybridtron.data_pipeline import build_dataset, build_loader, prepare_data
from hybridtron.data_pipeline.prepare import PreparedData
from hybridtron.model import GatedLM, flops_per_token
from hybridtron.train.build import checkpoint_step, model_for_checkpoint, select_rank_device
from hybridtron.train.checkpoint import CheckpointManager
from hybridtron.train.device import autocast_dtype
from hybridtron.train.engine import build_engine, check_engine
from hybridtron.train.parallel.mesh import Mesh, launch_world
from hybridtron.train.rank_log import rank_log
from hybridtron.train.run_dir import (
    LAST_STOP,
    check_resume_compatible,
    check_resume_tokenizer,
    check_run_paths,
    naming,
    read_restarts,
    resolve_data_dir,
)
from hybridtron.train.run_lock import hold_run_dir
from hybridtron.train.trainer import FitResult, Trainer
from hybridtron.train.watchdog import flight_recorder_env


def _quiet(_msg: str) -> None:
    pass


def val_loader_factory(val_ds, cfg: JobConfig):
    """A function making a fresh validation loader (the same batches every time)."""
    def make():
        return build_loader(val_ds, cfg.train.micro_batch_size, 1, seed=cfg.data.seed, shuffle=False)

    return make


@dataclass
class Run:
    trainer: Trainer
    model: nn.Module  # the whole model (a pipeline rank: the parts of its stages), parallelized
    prepared: PreparedData


def train_run(cfg: JobConfig, run_dir: Path, log=rank_log, init_from: Path | None = None):
    """Train (or resume) ``cfg`` in ``run_dir``; returns (FitResult, model). ``init_from``: a Hugging Face
    directory whose weights start the run (ignored when resuming from a checkpoint). Under torchrun every
    process runs this; the layout in ``cfg.parallel`` is checked before any of them builds a model."""
    resolve_data_dir(cfg, run_dir)  # data.out_dir left empty: the run's own data directory, or the corpus's
    check_run_paths(cfg, run_dir)  # a run directory or data directory that cannot be written: before anything
    device = select_rank_device(cfg)
    if launch_world()[2] > 1:  # torch's record of the last collectives, for a hang's report (RUN_DIR/hang/)
        flight_recorder_env(run_dir)
    # Mesh.setup refuses an impossible layout before anything is allocated; then rank 0 locks the run directory
    # (one writer per run) before any data is prepared, and every rank learns if another process holds it.
    with Mesh.setup(cfg, device) as mesh, hold_run_dir(run_dir, mesh.is_main, mesh.any):
        check_engine(cfg, mesh, device)  # what the engine cannot honour (a DeepSpeed JSON), before data or model
        log = log if mesh.is_main else _quiet
        run = build_run(cfg, run_dir, mesh, device, log, init_from)
        result, model = run.trainer.fit(log=log), run.model
        _report(cfg, run_dir, mesh, result, run.prepared, log)
        del run
        if mesh.distributed:
            # The replicated or sharded model holds pending gloo/NCCL work; freed after the process group is gone
            # (at interpreter exit), that work aborted the process now and then. Free it first.
            del model
            gc.collect()
            model = None
    return result, model


def build_run(cfg: JobConfig, run_dir: Path, mesh: Mesh, device: torch.device, log=rank_log,
              init_from: Path | None = None) -> Run:
    """Everything one process needs to train ``cfg`` in ``run_dir``, built in the order of a run: data, the model
    (from the latest checkpoint's step, or a Hugging Face directory), its parallel layout, the optimizer, the
    trainer (which resumes from the checkpoint when it fits)."""
    check_resume_compatible(cfg, run_dir, sections=("data",))  # before prepare writes anything for other data
    # 1. data (idempotent): rank 0 prepares, the others then find it done
    if mesh.is_main:
        prepared = prepare_data(cfg.data, log=log)
    mesh.barrier()
    if not mesh.is_main:
        prepared = prepare_data(cfg.data, log=_quiet)
    cfg.model.vocab_size = cfg.model.resolve_vocab(prepared.tokenizer.vocab_size)
    check_resume_compatible(cfg, run_dir)
    config_yaml = cfg.to_yaml()
    if mesh.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        with naming(run_dir / "config.yaml"):  # a failed write names the file (a full disk: exit 4)
            write_text_atomic(run_dir / "config.yaml", config_yaml)
    mesh.barrier()
    train_ds, val_ds = build_dataset(cfg.data, "train"), build_dataset(cfg.data, "val")
    t = cfg.train
    train_loader = build_loader(train_ds, t.micro_batch_size, t.grad_accum_steps, dp_rank=mesh.dp_rank,
                                dp_size=mesh.dp, seed=cfg.data.seed)
    latest = CheckpointManager(run_dir).latest()
    check_resume_tokenizer(latest, prepared.tokenizer, prepared.tokenizer_dir)
    resume_step = checkpoint_step(latest)
    stages_only = None
    if mesh.pp > 1:  # a pipeline rank builds the parts of its stages only (the torch engine's: layout.py)
        from hybridtron.train.parallel.pipeline import rank_cut

        stages_only = rank_cut(cfg, mesh, cfg.model.vocab_size)
    model = model_for_checkpoint(cfg, cfg.model.vocab_size, device, latest, cut=stages_only)  # 2. model, initialised
    if init_from is not None and resume_step == 0:
        from hybridtron.train.hf.load import load_hf_weights

        load_hf_weights(model, init_from)
        log(f"initialised from Hugging Face weights in {init_from}")
    whole = model
    if stages_only is not None:  # this rank holds some stages: count the whole model (shapes only)
        with torch.device("meta"):
            whole = GatedLM(cfg.model, cfg.model.vocab_size)
    sizes = (f"{whole.num_params() / 1e6:.2f}M parameters ({whole.num_params(exclude_embeddings=True) / 1e6:.2f}M "
             f"non-embedding, {whole.num_active_params() / 1e6:.2f}M active)")  # before ZeRO-3 partitions them
    amp_dtype = autocast_dtype(t, device)
    # 3. parallelize (pipeline stages, tensor, expert, context parallel, recomputation, compile, data parallel),
    # the optimizer, and the engine that runs a step of them
    engine = build_engine(model, cfg, mesh, device, amp_dtype, run_dir, log)
    log(f"model: {sizes}, device {device}, {len(train_ds)} train / "
        f"{len(val_ds)} val sequences of {cfg.data.seq_len}"
        + (f"; {mesh.world_size} processes, dp={mesh.dp}, tp={mesh.tp}, pp={mesh.pp}, ep={mesh.ep}, cp={mesh.cp}, zero_stage={mesh.zero_stage}"
           + (f" (HSDP: dp_shard={mesh.dp_shard})" if mesh.hsdp_mesh is not None else "")
           if mesh.distributed else "")
        + engine.label)
    # 4. the loop, with its checkpoints and logs
    trainer = Trainer(cfg, engine, train_loader, val_loader_factory(val_ds, cfg), device=device,
                      amp_dtype=amp_dtype, run_dir=run_dir, config_yaml=config_yaml,
                      tokenizer_dir=prepared.tokenizer_dir,
                      flops_per_token=flops_per_token(cfg.model, cfg.model.vocab_size, cfg.data.seq_len), mesh=mesh)
    return Run(trainer, model, prepared)


def _report(cfg: JobConfig, run_dir: Path, mesh: Mesh, result: FitResult, prepared, log) -> None:
    """Where the run stopped and where its files are; ``last_stop.json`` for ``hybridtron status``."""
    t = cfg.train
    if mesh.is_main:
        stop = {"stopped_by": result.stopped_by, "step": result.state.step, "max_steps": t.max_steps,
                "checkpoint": result.last_checkpoint.name if result.last_checkpoint else None}
        if job := os.environ.get("SLURM_JOB_ID"):  # the failures this SLURM job's script restarted training after
            stop["restarts"] = read_restarts(run_dir, job)
        with naming(run_dir / LAST_STOP):
            write_text_atomic(run_dir / LAST_STOP, json.dumps(stop) + "\n")
    log(f"stopped at step {result.state.step}/{t.max_steps} ({result.stopped_by})")
    if result.final_val_loss is not None:
        log(f"final val_loss {result.final_val_loss:.4f}")
    log(f"run directory:  {run_dir.resolve()}")
    log(f"metrics:        {(run_dir / 'metrics.jsonl').resolve()}")
    log(f"tensorboard:    tensorboard --logdir {(run_dir / 'tensorboard').resolve()}")
    log(f"checkpoint:     {result.last_checkpoint.resolve() if result.last_checkpoint else None}")
    log(f"data+tokenizer: {prepared.out_dir.resolve()}")
    if result.state.step < t.max_steps:
        log("run the same command again to resume")
    else:  # run again as it is, it resumes at its last step and stops at once: say what trains on
        start = f"from {result.last_checkpoint.name}" if result.last_checkpoint else "from step 0 (no checkpoint was saved)"
        log(f"to train on, run the same command with --train.max_steps N, N > {t.max_steps}: it resumes {start}")


