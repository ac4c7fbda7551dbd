"""``train.dump_grads``: a hook run after the first step's backward, before clipping, that writes the whole fp32
gradient of each named parameter -- reduced over the data-parallel ranks, in the model's names and row order -- to
``<run_dir>/grads_step1.pt`` (name -> tensor). The distributed tests compare layouts by it."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from hybridtron.atomic import write_bytes_atomic
from hybridtron.configs import ConfigError

from .model_order import canonical_name, from_row_order
from .run_dir import naming
from .step import whole


class GradDump:
    """Called by the trainer after each step's backward; acts at the run's first step only (not after a resume).
    Every rank must call it: gathering a sharded gradient is a collective over the ranks that hold the parameter."""

    def __init__(self, names: list[str], run_dir: Path):
        self.names, self.path = set(names), Path(run_dir) / "grads_step1.pt"

    def __call__(self, trainer) -> None:
        if trainer.state.step != 0:
            return
        mesh, mine = trainer.mesh, {}
        if trainer.engine is not None:
            from deepspeed.utils import safe_get_full_grad

            for name, p in trainer.engine.module.named_parameters():
                if name in self.names:
                    g = safe_get_full_grad(p)  # ZeRO partitions gathered: a collective over the dp ranks
                    if g is not None:
                        mine[name] = g.detach().float().cpu().clone()
        else:
            # Every rank holding a parameter walks the same names in the same order, so the gathers pair up.
            for name, p in trainer.model.named_parameters():
                name = canonical_name(name)  # without activation checkpointing's and torch.compile's wrappers
                if name in self.names and p.grad is not None:
                    g = whole(p.grad.detach())  # FSDP / TP / EP shards gathered (a collective over p's mesh)
                    # clone: DDP's gradient is a view of its bucket, which torch.save would write whole
                    mine[name] = from_row_order(trainer.model, name, g).float().cpu().clone()
        if mesh.pp > 1:  # a stage's parameters live on its ranks only: the first rank of each stage sends them
            import torch.distributed as dist

            first_of_stage = mesh.rank % (mesh.world_size // mesh.pp) == 0
            parts = [None] * mesh.world_size if mesh.is_main else None
            dist.gather_object(mine if first_of_stage else {}, parts, dst=0)
            if mesh.is_main:
                mine = {k: v for part in reversed(parts) for k, v in part.items()}  # tied copies are equal
        missing = mesh.broadcast(sorted(self.names - mine.keys()) if mesh.is_main else None)
        if missing:
            raise ConfigError(f"train.dump_grads: the model has no parameter {', '.join(missing)} (with a gradient); "
                              f"give names as model.named_parameters() prints them, e.g. layers.0.mlp.down_proj.weight")
        if mesh.is_main:
            buf = io.BytesIO()
            torch.save(mine, buf)
            with naming(self.path):  # a failed write names the file (a full disk: exit 4)
                write_bytes_atomic(self.path, buf.getvalue())
