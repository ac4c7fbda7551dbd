"""DeepSpeed as the second data-parallel engine: ZeRO stages 0-3 and optimizer offload to the CPU.

``parallel.engine: deepspeed`` hands the initialised model and our AdamW to ``deepspeed.initialize`` on the
process group the Mesh created. The DeepSpeed config is built from the job config (micro-batch, accumulation,
clipping, ZeRO stage, precision, offload). A user's own JSON (``parallel.deepspeed_config``) reaches the engine
as given, with its missing (or ``"auto"``) keys filled in; what it cannot have is refused by name when the run
starts, before data or model, never dropped:

* a key the job config also sets, to another value (the loader, the logs and the checkpoints depend on them);
* an ``"optimizer"`` other than Adam/AdamW, or with hyperparameters other than the job's: DeepSpeed ignores the
  block when it is handed an optimizer, so an AdamW block is honoured by checking that ours is that optimizer;
* a ``"scheduler"``: the trainer sets the learning rate on the optimizer's groups every step (the same schedule
  for both engines), which would silently override DeepSpeed's;
* sections that act through code hybridtron does not run (DeepSpeed's activation checkpointing API, its
  pipeline module, its data loader and curriculum).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridtron.atomic import write_text_atomic
from hybridtron.configs import ConfigError, JobConfig

TAG = "state"  # the one tag inside a checkpoint's deepspeed/ directory
EFFECTIVE = "deepspeed_config.json"  # in the run directory: the JSON the engine was given

# The job-config field behind each key we set, named when a user's JSON contradicts it.
_FROM = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "train_batch_size": "train.micro_batch_size x train.grad_accum_steps x dp",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "bf16.enabled": "train.dtype",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.betas": "train.beta1 and train.beta2",
    "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
}
# Keys whose value is fixed by how hybridtron trains rather than by a setting: why.
_FIXED = {
    "fp16.enabled": "train.dtype is fp32 or bf16; fp16 with loss scaling is not offered",
    "zero_force_ds_cpu_optimizer": "the optimizer is hybridtron's torch AdamW, under offload too",
    "optimizer.params.adam_w_mode": "hybridtron's AdamW decouples weight decay",
    "optimizer.params.bias_correction": "hybridtron's AdamW is bias-corrected",
    "optimizer.params.amsgrad": "hybridtron's AdamW has no AMSGrad",
    "optimizer.params.torch_adam": "hybridtron's AdamW is torch.optim.AdamW",
}
_OPTIMIZER_ONLY_IF_SET = {"adam_w_mode": True, "bias_correction": True, "amsgrad": False, "torch_adam": True}

_SCHEDULE = ("train.lr, train.schedule (cosine, wsd, constant), train.warmup_steps, train.min_lr_ratio and "
             "train.decay_fraction")
# Sections that act only through DeepSpeed code the trainer does not call: what to use instead.
_NOT_RUN = {
    "scheduler": f"the learning rate is set every step from {_SCHEDULE}",
    "activation_checkpointing": "use train.activation_checkpointing (the model does not call DeepSpeed's API)",
    "pipeline": "use parallel.pp with parallel.engine=torch",
    "curriculum_learning": "the data loader is hybridtron's (data.*)",
    "data_efficiency": "the data loader is hybridtron's (data.*)",
    "dataloader_drop_last": "the data loader is hybridtron's (data.*)",
}


def deepspeed_config(cfg: JobConfig, dp: int, device) -> dict:
    """The DeepSpeed JSON for this job: the user's file (if any) completed from ``cfg``; ConfigError names what
    it cannot honour."""
    from hybridtron.train.device import autocast_dtype

    t, p = cfg.train, cfg.parallel
    zero: dict = {"stage": p.zero_stage}
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    ours = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * dp,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        # explicit, so that a JSON asking for another precision than train.dtype is refused
        "bf16": {"enabled": autocast_dtype(t, device) is not None},
        "fp16": {"enabled": False},
        "zero_force_ds_cpu_optimizer": False,  # offload keeps our torch AdamW (no compiled CPU Adam needed)
    }
    defaults = {  # filled when absent, a user's value wins
        "steps_per_print": 1 << 30,  # our metrics line is the log
        "zero_allow_untested_optimizer": True,  # our AdamW, with its weight-decay groups
    }
    if not p.deepspeed_config:
        return {**ours, **defaults}
    src = Path(p.deepspeed_config)
    try:
        user = json.loads(src.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"parallel.deepspeed_config {src} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(user, dict):
        raise ConfigError(f"parallel.deepspeed_config {src} must hold a JSON object")
    for key, instead in _NOT_RUN.items():
        if _active(user.get(key)):
            raise ConfigError(f"{src} sets \"{key}\", which hybridtron's trainer would not honour: {instead}; "
                              f"remove it from the JSON")
    if "bfloat16" in user and "bf16" not in user:  # DeepSpeed's older name; ours would shadow it
        user["bf16"] = user.pop("bfloat16")
    if "optimizer" in user:
        _check_optimizer(user["optimizer"], cfg, src)
    _merge(user, ours, src, "")
    for key, value in defaults.items():
        if user.get(key, "auto") == "auto":
            user[key] = value
    return user


def _active(section) -> bool:
    """Whether a DeepSpeed section is switched on (present, and not ``false``, ``{}`` or ``enabled: false``)."""
    if section is None or section is False or section == {}:
        return False
    return not (isinstance(section, dict) and section.get("enabled") is False)


def _check_optimizer(block, cfg: JobConfig, src: Path) -> None:
    """Honour an Adam/AdamW block by filling and checking it against the job's AdamW; refuse anything else."""
    t = cfg.train
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"{src} sets optimizer type {kind!r}, but hybridtron trains with its own AdamW (train.lr, "
                          f"train.beta1, train.beta2, train.eps, train.weight_decay); remove the \"optimizer\" block "
                          f"or make it type AdamW")
    params = block.setdefault("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{src} sets optimizer.params={params!r}; it must be a JSON object")
    extra = sorted(set(block) - {"type", "params"}) + sorted(
        set(params) - {"lr", "betas", "eps", "weight_decay", *_OPTIMIZER_ONLY_IF_SET})
    if extra:
        raise ConfigError(f"{src} sets optimizer {', '.join(extra)}, which hybridtron's AdamW does not take; remove "
                          f"them (its settings are train.lr, train.beta1, train.beta2, train.eps, train.weight_decay)")
    _merge(block, {"params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps,
                              "weight_decay": t.weight_decay}}, src, "optimizer.")
    _merge(params, {k: v for k, v in _OPTIMIZER_ONLY_IF_SET.items() if k in params}, src, "optimizer.params.")


def _same(have, want) -> bool:
    if isinstance(have, list | tuple) and isinstance(want, list | tuple):  # betas: a JSON list, our tuple
        return len(have) == len(want) and all(_same(h, w) for h, w in zip(have, want, strict=True))
    if isinstance(have, bool) or isinstance(want, bool):  # true is not 1 here
        return type(have) is type(want) and have == want
    return have == want


def _merge(user: dict, ours: dict, src: Path, prefix: str) -> None:
    for key, want in ours.items():
        have = user.get(key, "auto")
        if have == "auto":
            user[key] = want
        elif isinstance(want, dict) and isinstance(have, dict):
            _merge(have, want, src, f"{prefix}{key}.")
        elif not _same(have, want):
            path = f"{prefix}{key}"
            head = f"{src} sets {path}={have!r} but this job needs {want!r}"
            if path in _FIXED:
                raise ConfigError(f"{head} ({_FIXED[path]}); remove the key from the JSON (or set it to \"auto\")")
            field = _FROM.get(path, "its train/parallel settings")
            raise ConfigError(f"{head} (from {field}); remove the key from the JSON (or set it to \"auto\"), or "
                              f"set {field} to match")


def check_config(cfg: JobConfig, dp: int, device_type: str) -> None:
    """Refuse a DeepSpeed JSON this job cannot honour (``deepspeed_config``'s errors) when the job runs DeepSpeed;
    nothing otherwise (and no torch import: ``submit`` calls it on a login node). Called before data or model (the
    recipe) and at ``submit``."""
    if cfg.parallel.engine == "deepspeed":
        import torch

        deepspeed_config(cfg, dp, torch.device(device_type))


def initialize(model, optimizer, cfg: JobConfig, mesh, device, run_dir: Path | None = None):
    """A DeepSpeed engine over ``model`` and ``optimizer`` on the job's process group; rank 0 records the JSON the
    engine was given in ``run_dir``/deepspeed_config.json."""
    import deepspeed

    conf = deepspeed_config(cfg, mesh.dp, device)
    if not mesh.distributed:  # DeepSpeed asserts a launcher's LOCAL_RANK even for one process: this is device 0
        os.environ.setdefault("LOCAL_RANK", "0")
    if device.type == "cpu":
        # DeepSpeed's CPU backend compiles its shared-memory all-reduce (a C++ extension: about 2 minutes and a
        # compiler, once per machine) when it wraps the process group; only its inference all-reduce uses it,
        # training's collectives are torch.distributed's. Marked unavailable, it is not built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    engine, _opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf,
                                              dist_init_required=False)
    if run_dir is not None and mesh.is_main:
        from hybridtron.train.run_dir import naming

        with naming(Path(run_dir) / EFFECTIVE):  # a failed write names the file (a full disk: exit 4)
            write_text_atomic(Path(run_dir) / EFFECTIVE, json.dumps(engine.config, indent=2, sort_keys=True) + "\n")
    return engine
