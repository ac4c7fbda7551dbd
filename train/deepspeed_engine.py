"""DeepSpeed as the second data-parallel engine: ZeRO stages 0-3 and optimizer offload to the CPU.

``parallel.engine: deepspeed`` hands the initialised model and our AdamW to ``deepspeed.initialize`` on the
process group the Mesh created. The DeepSpeed config is built from the job config (micro-batch, accumulation,
clipping, ZeRO stage, bf16 on GPUs, offload); a user's own JSON (``parallel.deepspeed_config``) is used as
given, with only its missing keys filled in, and a key it sets to another value than the job config is refused
by name, since the loader and the logs depend on them. The learning rate stays ours (set on the optimizer's
groups every step), so schedules are the same for both engines.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridtron.configs import ConfigError, JobConfig

from .parallelize import autocast_dtype

TAG = "state"  # the one tag inside a checkpoint's deepspeed/ directory


def deepspeed_config(cfg: JobConfig, dp: int, device) -> dict:
    """The DeepSpeed JSON for this job: the user's file (if any) completed from ``cfg``."""
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
        "steps_per_print": 1 << 30,  # our metrics line is the log
        "zero_allow_untested_optimizer": True,  # our AdamW, with its weight-decay groups
        "zero_force_ds_cpu_optimizer": False,  # offload keeps our torch AdamW (no compiled CPU Adam needed)
    }
    if autocast_dtype(t, device) is not None:
        ours["bf16"] = {"enabled": True}
    if not p.deepspeed_config:
        return ours
    src = Path(p.deepspeed_config)
    try:
        user = json.loads(src.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"parallel.deepspeed_config {src} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(user, dict):
        raise ConfigError(f"parallel.deepspeed_config {src} must hold a JSON object")
    _merge(user, ours, src, "")
    return user


def _merge(user: dict, ours: dict, src: Path, prefix: str) -> None:
    for key, want in ours.items():
        have = user.get(key, "auto")
        if have == "auto":
            user[key] = want
        elif isinstance(want, dict) and isinstance(have, dict):
            _merge(have, want, src, f"{prefix}{key}.")
        elif have != want:
            raise ConfigError(
                f"{src} sets {prefix}{key}={have!r} but this job needs {want!r} (from its train/parallel settings); "
                f"remove the key from the JSON (or set it to \"auto\"), or change the job config to match"
            )


def initialize(model, optimizer, cfg: JobConfig, mesh, device):
    """A DeepSpeed engine over ``model`` and ``optimizer`` on the job's process group."""
    import deepspeed

    conf = deepspeed_config(cfg, mesh.dp, device)
    engine, _opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf,
                                              dist_init_required=False)
    return engine
