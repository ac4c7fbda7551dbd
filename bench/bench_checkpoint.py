"""The training stall of a checkpoint, synchronous against ``checkpoint.async``, side by side in one run.

    python -m hybridtron.bench.bench_checkpoint --mb 300                  # one process (CPU, or the GPU)
    torchrun --standalone --nproc-per-node 2 -m hybridtron.bench.bench_checkpoint --mb 300   # 2 ranks (gloo on CPU)

A model of ``--mb`` MB of fp32 weights (a stack of square linear layers; AdamW's two moments make the checkpoint
3x that) is saved through the trainer's own ``CheckpointManager.save``, alternately synchronously and in the
background, ``--saves`` times each, into a temporary directory on the same disk as ``--dir``. The stall is the time
``save`` keeps the training thread: the whole write for a synchronous save; the staging copy (to pinned memory on
CUDA) for a background one. The background write's own time is measured too (``wait`` right after), then the next
save starts: the ratio is the training time a checkpoint costs, without the write's competition for the CPU or disk
bandwidth that overlapping steps would see. Every rank reports its stall; rank 0 prints the medians."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def build(mb: float, device: torch.device, width: int = 1024) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers of ``width`` x ``width`` fp32 weights, ``mb`` MB in all, with AdamW's state filled in."""
    layers = max(1, round(mb * 1e6 / (width * width * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def measure(mb: float, saves: int, root: Path) -> dict:
    from hybridtron.configs import JobConfig
    from hybridtron.train.checkpoint import CheckpointManager, TrainerState
    from hybridtron.train.parallel.mesh import Mesh

    cfg = JobConfig()
    cfg.checkpoint.async_save = True  # so that the mesh makes the background writes' own process group
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        from hybridtron.train.parallel.mesh import launch_world

        torch.cuda.set_device(launch_world()[1])
        device = torch.device("cuda", torch.cuda.current_device())
    with Mesh.setup(cfg, device) as mesh:
        model, opt = build(mb, device)
        tok = root / "tokenizer"
        if mesh.is_main:
            tok.mkdir(parents=True, exist_ok=True)
            (tok / "tokenizer.json").write_text("{}")
        mesh.barrier()
        ckpt = CheckpointManager(root / "run", keep_last=2)
        state = TrainerState()
        stall: dict[str, list[float]] = {"sync": [], "async": []}
        write: list[float] = []
        for _ in range(saves):
            for mode in ("sync", "async"):
                state.step += 1
                mesh.barrier()
                t0 = time.perf_counter()
                ckpt.save(state, model, opt, cfg.to_yaml(), tok, mesh=mesh, background=mode == "async")
                stall[mode].append(time.perf_counter() - t0)
                if mode == "async":
                    t1 = time.perf_counter()
                    ckpt.wait(mesh)
                    write.append(time.perf_counter() - t1)
        ckpt.close()
        state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e6
        out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "ranks": mesh.world_size, "state_mb": round(state_mb), "saves": saves,
               "sync_stall_s": statistics.median(stall["sync"]), "async_stall_s": statistics.median(stall["async"]),
               "async_write_s": statistics.median(write)}
        out["async_over_sync"] = out["async_stall_s"] / out["sync_stall_s"]
        return out if mesh.is_main else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=300.0, help="MB of fp32 weights (the checkpoint holds 3x: AdamW)")
    ap.add_argument("--saves", type=int, default=3, help="saves of each kind (the median is reported)")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (a temporary directory in it)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the figures to FILE (rank 0)")
    args = ap.parse_args(argv)
    # one directory for every rank of the job (torchrun's run id), or of this process alone
    root = Path(args.dir or tempfile.gettempdir()) / f"bench-ckpt-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"
    root.mkdir(parents=True, exist_ok=True)
    try:
        res = measure(args.mb, args.saves, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if res:
        print(f"checkpoint stall, {res['state_mb']} MB of state, {res['ranks']} rank(s), {res['device']}, median of "
              f"{res['saves']}: sync {res['sync_stall_s']:.3f} s, async {res['async_stall_s']:.3f} s "
              f"(async/sync {res['async_over_sync']:.3f}; the background write took {res['async_write_s']:.3f} s)")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
