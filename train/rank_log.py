"""Our progress lines: one line on stdout, tagged with the process's rank in a multi-process job. Its own module, so
that a command that only logs (``prepare``) does not import the trainer, and torch with it."""

from __future__ import annotations

from hybridtron.train.parallel.layout import launch_world


def rank_log(msg: str) -> None:
    rank, _local, world = launch_world()
    print(f"[hybridtron{f' rank {rank}/{world}' if world > 1 else ''}] {msg}", flush=True)
