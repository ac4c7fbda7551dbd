"""``hybridtron plan``: per-GPU memory and per-step communication of a config on a cluster shape, before a launch.

Memory is not guessed from formulas: one training step (forward, backward, optimizer) of one rank runs on fake
tensors (``FakeTensorMode``: shapes and dtypes, no storage), with the data-parallel layout applied as it would
be on the cluster (FSDP2 over a fake process group of ``dp`` ranks), and torch's memory trackers record the peak
by category: sharded and gathered weights, gradients, optimizer state, activations and temporaries. So the plan
follows the model code as it is, MoE, delta-rule and structured layers included. Bytes are those of the CPU
run: fp32, or bf16 where CPU autocast casts (matmuls) when the run trains in bf16; flash attention on a GPU
keeps no more than the CPU kernel does.

``--measure`` runs the same step on real tensors, in the job's real layout (under torchrun, every rank), and
prints the prediction beside the measured peak of rank 0: the check that the plan is right.

Communication per step and GPU (ring algorithms; bytes sent, equal to bytes received), with P parameters,
c bytes per gathered parameter (2 in bf16, else 4) and gradients reduced in fp32:
  ZeRO-0 (DDP)  all-reduce of the gradients once per step:                 2 (dp-1)/dp * 4P
  ZeRO-2        all-gather of the weights once per micro-batch (forward),    (dp-1)/dp * cP
                reduce-scatter of the gradients once per micro-batch:      (dp-1)/dp * 4P
  ZeRO-3        all-gather in forward and again in backward per micro-batch: 2 (dp-1)/dp * cP, plus the same
                reduce-scatter
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from hybridtron.configs import ConfigError, JobConfig

from .distributed import resolve_layout
from .parallelize import autocast_dtype

GIB = 1 << 30
CATEGORIES = {  # tracker category (enum name) -> what the plan calls it
    "PARAM": "weights", "SHARDED_PARAM": "weights", "BUFFER": "weights",
    "UNSHARDED_PARAM": "gathered", "ALL_GATHER": "gathered",
    "GRAD": "grads", "SHARDED_GRAD": "grads", "UNSHARDED_GRAD": "grads", "REDUCE_SCATTER": "grads",
    "OPT": "optimizer",
    "ACT": "activations", "TEMP": "activations", "INP": "activations", "OTH": "activations",
}


def _compute_dtype(cfg: JobConfig) -> torch.dtype | None:
    """The run's autocast dtype on the GPUs it plans for."""
    return autocast_dtype(cfg.train, torch.device("cuda"))


def step_peak(cfg: JobConfig, dp: int, zero_stage: int, fake: bool, device_mesh=None,
              device: torch.device | None = None) -> dict[str, float]:
    """Peak bytes of one rank over two training steps (the second has optimizer state), by plan category. ``fake``: on fake tensors; else real, on ``device`` (default CPU), in the
    process group already set up. On CUDA the allocator's own peak is added as ``cuda_max_allocated``."""
    device = device or torch.device("cpu")
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from hybridtron.model import GatedLM

    from .optim import build_optimizer
    from .parallelize import apply_data_parallel, parallelize

    amp = _compute_dtype(cfg)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    B, T, accum = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.train.grad_accum_steps
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    else:
        mode = contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with mode, torch.device(device):
        torch.manual_seed(cfg.train.seed)
        model = parallelize(GatedLM(cfg.model, vocab), cfg.train)
        model.init_weights()

        sharded = dp > 1 and zero_stage >= 2
        if sharded:  # the fields of a Mesh that apply_data_parallel reads, on the simulated or real group
            layout = SimpleNamespace(dp=dp, data_ranks=dp, zero_stage=zero_stage, device_mesh=device_mesh)
            apply_data_parallel(model, layout, amp, cfg.parallel.mixed_precision)
        optimizer = build_optimizer(model, cfg.train)
        x = torch.randint(0, vocab, (B, T))
        tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()
        if not sharded:
            tracker.track_external(model, optimizer)
        autocast = torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
        with tracker:
            # Step 1 creates the optimizer state; step 2 is the steady state. Its second micro-batch already holds
            # the accumulated gradients beside a micro-batch's activations, so later ones change nothing.
            calls = 0
            for micro_batches in (1, min(accum, 2)):
                for _ in range(micro_batches):
                    if calls:  # the trackers follow one call per module: start each micro-batch afresh (the
                        tracker.reset_mod_stats()  # peak over all of them is kept)
                    calls += 1
                    with autocast:
                        loss = model(x, labels=x)
                    (loss / micro_batches).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        snap = tracker.get_tracker_snapshot("peak")
    per_dev = snap[device] if device in snap else next(iter(snap.values()))
    out = {"weights": 0.0, "gathered": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    for key, val in per_dev.items():
        name = getattr(key, "name", key)
        if name == "Total":
            out["total"] = float(val)
        elif name in CATEGORIES:
            out[CATEGORIES[name]] += float(val)
    if device.type == "cuda":
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(device))
    return out


def comm_bytes(n_params: int, dp: int, zero_stage: int, accum: int, c: int) -> float:
    """Bytes each GPU sends per optimizer step for data parallelism (module docstring)."""
    if dp == 1:
        return 0.0
    f = (dp - 1) / dp
    if zero_stage == 0:
        return 2 * f * 4 * n_params
    gathers = 1 if zero_stage == 2 else 2
    return accum * (gathers * f * c * n_params + f * 4 * n_params)


def simulate(cfg: JobConfig, dp: int, zero_stage: int) -> dict[str, float]:
    """``step_peak`` on fake tensors; ZeRO-2/3 over a fake process group of ``dp`` ranks in this process."""
    import torch.distributed as dist

    if dp == 1 or zero_stage == 0:
        return step_peak(cfg, dp, zero_stage, fake=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ConfigError("hybridtron plan simulates other layouts in one process: run it without torchrun "
                          "(torchrun is for --measure)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    try:
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        return step_peak(cfg, dp, zero_stage, fake=True, device_mesh=mesh)
    finally:
        dist.destroy_process_group()


def n_params(cfg: JobConfig) -> int:
    from hybridtron.model import GatedLM

    with torch.device("meta"):
        model = GatedLM(cfg.model, cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size))
    return model.num_params()


def plan_table(cfg: JobConfig, world: int, gpu_memory_gib: float, stages=(0, 2, 3)) -> list[dict]:
    """One row per ZeRO stage: predicted per-GPU memory by category (GiB), whether it fits, and GB sent per step."""
    dp = resolve_layout(cfg, world)
    P = n_params(cfg)
    c = 2 if _compute_dtype(cfg) is not None else 4
    rows = []
    for z in stages:
        mem = simulate(cfg, dp, z)
        rows.append({"zero_stage": z, "dp": dp, "params": P, **{k: v / GIB for k, v in mem.items()},
                     "fits": mem["total"] / GIB <= gpu_memory_gib,
                     "comm_gb_per_step": comm_bytes(P, dp, z, cfg.train.grad_accum_steps, c) / 1e9})
    return rows


def format_table(cfg: JobConfig, rows: list[dict], world: int, gpu_memory_gib: float) -> str:
    head = (f"{rows[0]['params'] / 1e6:.1f}M parameters; {world} GPUs, dp={rows[0]['dp']}; micro-batch "
            f"{cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, {cfg.train.grad_accum_steps} per step; "
            f"{'bf16' if _compute_dtype(cfg) is not None else 'fp32'} compute; activation checkpointing "
            f"{'on' if cfg.train.activation_checkpointing else 'off'}; per-GPU peak in GiB of {gpu_memory_gib:g}")
    lines = [head, "| zero_stage | weights | gathered | grads | optimizer | activations | peak | fits | comm GB/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['zero_stage']} | {r['weights']:.3f} | {r['gathered']:.3f} | {r['grads']:.3f} | "
                     f"{r['optimizer']:.3f} | {r['activations']:.3f} | {r['total']:.3f} | "
                     f"{'yes' if r['fits'] else 'NO'} | {r['comm_gb_per_step']:.3f} |")
    return "\n".join(lines)


def measure(cfg: JobConfig, mesh, device: torch.device) -> dict[str, float]:
    """The real peak of this rank over a training step in the job's own layout (``mesh``: the running job's)."""
    return step_peak(cfg, mesh.dp, mesh.zero_stage, fake=False,
                     device_mesh=mesh.device_mesh if mesh.distributed else None, device=device)
