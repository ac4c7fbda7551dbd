"""``train.dump_grads``: a hook run after the first step's backward, before clipping, that writes the whole fp32
gradient of each named parameter -- reduced over the data-parallel ranks, in the model's names and row order -- to
``<run_dir>/grads_step1.pt`` (name -> tensor). The distributed tests compare layouts by it."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from hybridtron.atomic import write_bytes_atomic
from hybridtron.configs import ConfigError
from hybridtron.train.run_dir import naming


class GradDump:
    """Called by the trainer after each step's backward; acts at the run's first step only (not after a resume).
    Every rank must call it: gathering a sharded gradient is a collective over the ranks that hold the parameter."""

    def __init__(self, names: list[str], run_dir: Path):
        self.names, self.path = set(names), Path(run_dir) / "grads_step1.pt"

    def __call__(self, trainer) -> None:
        if trainer.state.step != 0:
            return
        mesh = trainer.mesh
        mine = trainer.engine.full_grads(self.names)  # rank 0's has them all; the gathers are collectives
        missing = mesh.broadcast(sorted(self.names - mine.keys()) if mesh.is_main else None)
        if missing:
            raise ConfigError(f"train.dump_grads: the model has no parameter {', '.join(missing)} (with a gradient); "
                              f"give names as model.named_parameters() prints them, e.g. layers.0.mlp.down_proj.weight")
        if mesh.is_main:
            buf = io.BytesIO()
            torch.save(mine, buf)
            with naming(self.path):  # a failed write names the file (a full disk: exit 4)
                write_bytes_atomic(self.path, buf.getvalue())
