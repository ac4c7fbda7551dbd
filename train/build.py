"""The model for a config at a training step, and a checkpoint loaded into it: what train, eval, sample, export
and plan all build, so that they agree on what a checkpoint of a given step holds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridtron.configs import JobConfig, load_config
from hybridtron.data_pipeline import load_tokenizer
from hybridtron.model import GatedLM
from hybridtron.train.checkpoint import DEEPSPEED, SHARDED, STEP_RE, CheckpointError, CheckpointManager, verify_manifest
from hybridtron.train.device import select_device
from hybridtron.train.model_hooks import structure_for_step
from hybridtron.train.parallel.layout import check_kernels
from hybridtron.train.parallel.mesh import Mesh, launch_world
from hybridtron.train.parallel.parallelize import parallelize


def build_model(cfg: JobConfig, vocab_size: int, device: torch.device, step: int = 0, cut=None,
                guide: bool | None = None):
    """The model as it is at training step ``step`` (structure that changes with the step, such as
    self-guided FFN weights leaving the model, is applied), ready for a checkpoint of that step. ``cut``: drops
    the parts another rank holds (pipeline parallel) before any weight is allocated. ``guide``: whether the
    checkpoint to be loaded holds the self-guided dense guide (`saved_guide`); None: what the step says. The model
    is plain: ``parallel.parallelize`` applies the layout, recomputation and compile afterwards."""
    with torch.device("meta"):
        model = GatedLM(cfg.model, vocab_size)
    if cut is not None:
        cut(model)
    model.to_empty(device=device)
    torch.manual_seed(cfg.train.seed)
    model.init_weights()
    if guide is None:
        structure_for_step(model, cfg, step)
    elif not guide:
        from hybridtron.model.structured_ffn import drop_self_guided

        drop_self_guided(model)
    return model


def saved_guide(ckpt: Path | None) -> bool | None:
    """Whether checkpoint ``ckpt`` holds self-guided dense guide weights (``*.dense``), read from its files'
    index (no tensor is read); None without a checkpoint.

    The files, not the step, decide: a checkpoint of the guide's last step was written before the next step
    dropped the guide, and a run extended to more steps (a later end of the guide) keeps the guide it
    already dropped dropped. Every loader builds the model for the checkpoint from this."""
    if ckpt is None:
        return None
    if (ckpt / "model.safetensors").is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
                names = list(f.keys())
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error type for a torn file)
            verify_manifest(ckpt, only=("model.safetensors",))  # names a truncated or overwritten file exactly
            raise CheckpointError(f"checkpoint {ckpt}: model.safetensors cannot be read ({e}); "
                                  f"resume from an earlier checkpoint or start a new --run-dir") from None
    elif (ckpt / SHARDED / ".metadata").is_file():
        from torch.distributed.checkpoint import FileSystemReader

        names = [k.removeprefix("model.") for k in FileSystemReader(str(ckpt / SHARDED)).read_metadata()
                 .state_dict_metadata if k.startswith("model.")]
    else:
        return None  # DeepSpeed refuses self-guided runs (train/parallel/mesh.py): nothing to find there
    return any(n.endswith(".dense") for n in names)


def model_for_checkpoint(cfg: JobConfig, vocab_size: int, device: torch.device, ckpt: Path | None, cut=None):
    """The model ``ckpt`` loads into (a fresh one for step 0 without a checkpoint): what resume, sample, eval
    and export all build, so that the self-guided guide is present exactly when the checkpoint saved it."""
    return build_model(cfg, vocab_size, device, checkpoint_step(ckpt), cut=cut, guide=saved_guide(ckpt))


def inference_structure(model, cfg: JobConfig, step: int) -> None:
    """The loaded model as training's next forward (step ``step``) would run it: the self-guided mix weight of
    that step, and the guide dropped once the weight is 0 (sample, eval and export compute the same function)."""
    f = cfg.model.ffn
    if f.kind == "dense" or not f.self_guided:
        return
    from hybridtron.model.structured_ffn import drop_self_guided, self_guided_alpha, set_self_guided_alpha

    alpha = self_guided_alpha(step, cfg.train.max_steps, f.self_guided_fraction)
    if alpha == 0.0:
        drop_self_guided(model)
    else:
        set_self_guided_alpha(model, alpha)


def checkpoint_step(ckpt: Path | None) -> int:
    """The step a checkpoint directory was saved at (its name says it); 0 for None."""
    m = STEP_RE.match(ckpt.name) if ckpt is not None else None
    return int(m.group(1)) if m else 0


def select_rank_device(cfg: JobConfig) -> torch.device:
    """This process's device: with several processes on CUDA, the GPU of its local rank."""
    device = select_device(cfg.train)
    _rank, local, world = launch_world()
    if device.type == "cuda" and world > 1 and device.index is None:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    return device


def load_for_inference(ckpt: Path, overrides: list[tuple[str, str]] = ()):
    """(cfg, model, tokenizer, device) from checkpoint directory ``ckpt``, verified before anything is read;
    ``overrides``: dotted config overrides (e.g. the device)."""
    for name in ("config.yaml", "tokenizer"):
        if not (ckpt / name).exists():
            raise CheckpointError(f"checkpoint {ckpt} has no {name}; it is incomplete or not a checkpoint")
    inference_files = ("model.safetensors", SHARDED, DEEPSPEED, "trainer_state.json", "config.yaml", "tokenizer")
    verify_manifest(ckpt, only=inference_files)  # before any of them is read
    cfg = load_config(str(ckpt / "config.yaml"), list(overrides))
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    device = select_device(cfg.train)
    check_kernels(cfg, device.type)  # a backend that cannot run here, or cannot take the model, before any weight
    cfg.train.activation_checkpointing = "none"
    model = model_for_checkpoint(cfg, cfg.model.vocab_size, device, ckpt)
    parallelize(model, cfg, Mesh())  # one process: only train.compile applies (no recomputation in inference)
    CheckpointManager.load(ckpt, model, optimizer=None, restore_rng_state=False, verify=False)
    inference_structure(model, cfg, checkpoint_step(ckpt))
    return cfg, model, tokenizer, device
