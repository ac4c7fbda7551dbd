"""The plan's table: every ZeRO stage of a config side by side (memory, communication, step time, fit), its text
form, and ``--measure``'s comparison of the prediction with a real step."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybridtron.configs import ConfigError, JobConfig
from hybridtron.train.parallel.layout import target_layout
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.plan.comm import _checkpointing_label, comm_bytes
from hybridtron.train.plan.memory import DIMS, GIB, _compute_dtype, step_peak, with_zero_stage
from hybridtron.train.plan.progress import Progress
from hybridtron.train.plan.reduced import plan_ranks
from hybridtron.train.plan.step_time import Hardware, step_time


# ---- the table -------------------------------------------------------------------------------------------------
def n_params(cfg: JobConfig) -> int:
    from hybridtron.model import GatedLM

    with torch.device("meta"):
        model = GatedLM(cfg.model, cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size))
    return model.num_params()


def plan_table(cfg: JobConfig, world: int, gpu_memory_gib: float, stages=(0, 2, 3), hw: Hardware | None = None,
               exact: bool = False, jobs: int = 1) -> list[dict]:
    """One row per ZeRO stage the layout accepts (one row when nothing is data parallel): the heaviest planned
    rank's memory by category (GiB), whether it fits, GB it sends per step in every dimension (and in all), and
    every planned rank's peak (pipeline stages). A stage the layout refuses is a row with its reason. The memory
    of each rank is extrapolated from reduced traces (``reduced.py``); ``exact``: from a trace of every layer
    (minutes for a 1B model, the reference the extrapolation is tested against). A plan that takes more than 3 s
    says on stderr what it is planning (``Progress``). ``jobs``: processes tracing at once (``workers.py``)."""
    refusals, layouts = {}, {}
    for z in stages:
        try:
            layouts[z] = target_layout(with_zero_stage(cfg, z), world)
            dp = layouts[z].dp  # the same for every stage the layout accepts
        except ConfigError as e:
            refusals[z] = e
    if len(refusals) == len(stages):  # the most sharded stage's reason: ZeRO-0's is often only that it replicates
        raise refusals[stages[-1]]
    if dp * cfg.parallel.cp == 1:  # nothing to shard over: every ZeRO stage is the same layout
        stages, refusals = (cfg.parallel.zero_stage,), {}
    P = n_params(cfg)
    with Progress() as progress:
        planned = plan_ranks(cfg, world, [z for z in stages if z not in refusals], exact=exact,
                             note=lambda what: progress.note(f"planning {what} ..."), jobs=jobs)
    return [_row(cfg, z, world, gpu_memory_gib, hw, P, dp, layouts, planned[z]) if z not in refusals else
            {"zero_stage": z, "refused": str(refusals[z])} for z in stages]


def _row(cfg: JobConfig, z: int, world: int, gpu_memory_gib: float, hw: Hardware | None, P: int, dp: int,
         layouts: dict, per_rank: dict[int, dict]) -> dict:
    """``plan_table``'s row of ZeRO stage ``z`` from its planned ranks (``per_rank``)."""
    cz = with_zero_stage(cfg, z)
    rank = max(per_rank, key=lambda r: per_rank[r]["memory"]["total"])
    mem, facts = per_rank[rank]["memory"], per_rank[rank]["facts"]
    comm = comm_bytes(cz, world, facts)
    time = step_time(cz, world, comm, hw or Hardware())
    return {"time": time, "zero_stage": z, "dp": dp, "dp_shard": (layouts.get(z) or target_layout(cz, world)).dp_shard, "params": P, "rank": rank,
            "stages": facts["stages"],
            **{k: v / GIB for k, v in mem.items()}, "fits": mem["total"] / GIB <= gpu_memory_gib,
            "comm_gb": {k: v / 1e9 for k, v in comm.items()}, "comm_gb_per_step": sum(comm.values()) / 1e9,
            "rank_peaks_gib": {r: v["memory"]["total"] / GIB for r, v in per_rank.items()}}


def format_table(cfg: JobConfig, rows: list[dict], world: int, gpu_memory_gib: float) -> str:
    p = cfg.parallel
    dp, dp_shard = next((r["dp"], r["dp_shard"]) for r in rows if "refused" not in r)
    hsdp = dp_shard < dp  # the dp column is then the shard groups' traffic, dp_replicate the all-reduce across them
    dims = ["dp", *(["dp_replicate"] if hsdp else [])] + [k for k in DIMS[1:] if getattr(p, k) > 1]
    layout = ", ".join(f"{k}={dp if k == 'dp' else getattr(p, k)}" for k in DIMS if k == "dp" or getattr(p, k) > 1)
    if hsdp:
        layout = layout.replace(f"dp={dp}", f"dp={dp} (HSDP: dp_replicate={dp // dp_shard} x dp_shard={dp_shard})", 1)
    head = (f"{n_params(cfg) / 1e6:.1f}M parameters; {world} GPUs, {layout}; micro-batch "
            f"{cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, {cfg.train.grad_accum_steps} per step; "
            f"{'bf16' if _compute_dtype(cfg) is not None else 'fp32'} compute; activation checkpointing "
            f"{_checkpointing_label(cfg)}; per-GPU peak in GiB of {gpu_memory_gib:g}")
    notes = []
    if p.pp > 1:
        notes.append(f"pipeline schedule {p.pp_schedule}: each row is the heaviest stage's first rank (all stages "
                     f"are planned: see 'stage peaks')")
    if cfg.model.moe.n_experts:
        notes.append("MoE routing assumed balanced (every expert gets an equal share of the token assignments)")
    if cfg.train.compile:
        notes.append("train.compile=true is not modelled: the blocks are planned as eager PyTorch runs them; compiled, "
                     "their fused elementwise ops keep fewer temporaries, so the activation peak is typically lower "
                     "(dense_1b on one H100: 40.3 GiB compiled, 43.7 eager)")
    if cfg.train.fp8 != "none":
        notes.append(f"train.fp8={cfg.train.fp8}: memory planned with the blocks' linears as torchao's Float8Linear, as "
                     f"on the cluster's GPUs (FP8 casts and matmuls"
                     + (", FP8 weight all-gather in FSDP2" if cfg.train.fp8 == "tensorwise" else "")
                     + "); not modelled: the communication and step-time columns count those weights at their "
                       "bf16/fp32 bytes and the matmuls at --peak-tflops")
    pp = p.pp > 1  # a pipeline's receive buffers (activations and their gradients, one per micro-batch) apart
    lines = [head, *notes,
             "| zero_stage | rank (stage) | weights | gathered | grads | optimizer | activations | "
             + ("pp buffers | " if pp else "") + "peak | fits | "
             + " | ".join(f"{k} GB/step" for k in dims) + " | comm GB/step |",
             "|---" * (9 + pp + len(dims) + 1) + "|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['zero_stage']} | refused: {r['refused']} |")
            continue
        stage = ",".join(str(s) for s in r["stages"])
        lines.append(f"| {r['zero_stage']} | {r['rank']} ({stage}) | {r['weights']:.3f} | {r['gathered']:.3f} | "
                     f"{r['grads']:.3f} | {r['optimizer']:.3f} | {r['activations']:.3f} | "
                     + (f"{r['pp_buffers']:.3f} | " if pp else "") + f"{r['total']:.3f} | "
                     f"{'yes' if r['fits'] else 'NO'} | "
                     + " | ".join(f"{r['comm_gb'][k]:.3f}" for k in dims) + f" | {r['comm_gb_per_step']:.3f} |")
    lines += ["", "step time (prediction: compute at the configured peak x MFU, communication at the configured "
                  "bandwidths, overlapped as the engine does; seconds per step)",
              "| zero_stage | compute | bubble | " + " | ".join(f"{k} comm (exposed)" for k in dims)
              + " | step | tokens/s | MFU |", "|---" * (6 + len(dims)) + "|"]
    for r in rows:
        if "refused" in r:
            continue
        tm = r["time"]
        lines.append(f"| {r['zero_stage']} | {tm['compute_s']:.3f} | {tm['bubble_s']:.3f} | "
                     + " | ".join(f"{tm['comm_s'].get(k, 0):.3f} ({tm['exposed_s'].get(k, 0):.3f}"
                                  + (f", {tm['links'][k]})" if k in tm["links"] else ")") for k in dims)
                     + f" | {tm['step_s']:.3f} | {tm['tokens_per_s']:,.0f} | {100 * tm['mfu']:.1f}% |")
    for r in rows:
        if "host" in r:
            lines.append(f"zero_stage {r['zero_stage']}, parallel.offload=cpu: {r['host']:.3f} GiB of sharded weights, "
                         f"gradients and optimizer state in host memory per rank, outside the GPU peak")
    for r in rows:
        if "refused" not in r and len(r["rank_peaks_gib"]) > 1:
            peaks = ", ".join(f"rank {k} (stage {i}) {v:.3f}" for i, (k, v) in enumerate(r["rank_peaks_gib"].items()))
            lines.append(f"stage peaks at zero_stage {r['zero_stage']}: {peaks}")
    return "\n".join(lines)


def measure(cfg: JobConfig, mesh: Mesh, device: torch.device) -> dict:
    """The real peak of this rank over the same two steps in the job's own layout (``mesh``: the running job's)."""
    return step_peak(cfg, mesh, fake=False, device=device)["memory"]


def release_distributed_state() -> None:
    """After the measured step's process group is destroyed: drop what still refers to it (DTensor's per-mesh
    sharding cache, the step's garbage), so no gloo object outlives it into interpreter shutdown. Without this
    a rank aborted at exit about once in six runs ("terminate called without an active exception")."""
    import gc

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    gc.collect()


def gather_measurements(mesh: Mesh, mine: dict) -> dict[int, dict]:
    """Every rank's ``measure`` on every rank: {rank: memory}."""
    if not mesh.distributed:
        return {0: mine}
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine)
    return dict(enumerate(everyone))


def compare(cfg: JobConfig, world: int, measured: dict[int, dict], exact: bool = False) -> dict:
    """The prediction for the heaviest planned rank beside what that rank measured: on a GPU the allocator's own
    peak (torch.cuda.max_memory_allocated: every tensor of the real step, the trackers' blind spots included), on
    the CPU the tracked peak of the real tensors. The prediction is ``plan_table``'s (``exact``: every layer
    traced)."""
    on_gpu = any("cuda_max_allocated" in m for m in measured.values())
    with Progress() as progress:  # the kernels the measured step ran
        predicted = plan_ranks(cfg, world, kernels="gpu" if on_gpu else "cpu", exact=exact,
                               note=lambda what: progress.note(f"predicting {what} ..."))[cfg.parallel.zero_stage]
    rank = max(predicted, key=lambda r: predicted[r]["memory"]["total"])
    pred, real = predicted[rank]["memory"], measured[rank]

    def peak(m: dict) -> float:
        return m.get("cuda_max_allocated", m["total"])

    # The measured step ran min(accum, 2) micro-batches outside a pipeline (``step_peak``): the volumes for those.
    n_micro = cfg.train.grad_accum_steps if cfg.parallel.pp > 1 else min(cfg.train.grad_accum_steps, 2)
    cm = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=n_micro))

    def comm(r: int) -> dict:
        sent = measured[r].get("comm_sent", {})
        volumes = comm_bytes(cm, world, predicted[r]["facts"])
        return {"comm_measured_gb": sum(sent.values()) / 1e9, "comm_predicted_gb": sum(volumes.values()) / 1e9,
                "comm_predicted_gb_by_dim": {k: v / 1e9 for k, v in volumes.items() if v},
                "comm_measured_gb_by_op": {k: v / 1e9 for k, v in sent.items()}}

    real = {k: v for k, v in real.items() if k != "comm_sent"}

    layout = target_layout(cfg, world)
    return {"dp": layout.dp, "dp_shard": layout.dp_shard, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp,
            "ep": cfg.parallel.ep, "cp": cfg.parallel.cp,
            "zero_stage": cfg.parallel.zero_stage, "rank": rank,
            "measured_gib": {k: v / GIB for k, v in real.items()}, "predicted_gib": {k: v / GIB for k, v in pred.items()},
            "predicted_over_measured": pred["total"] / peak(real),
            **comm(rank),
            "ranks": {r: {"predicted_gib": predicted[r]["memory"]["total"] / GIB,
                          "measured_gib": peak(measured[r]) / GIB, **comm(r)} for r in predicted}}


def format_comparison(result: dict) -> str:
    """``compare``'s result as text: the heaviest planned rank's predicted and measured peak by category, then
    every rank's peak and communication."""
    layout = ", ".join(f"{k}={result[k]}" for k in ("dp", "tp", "pp", "ep", "cp") if k == "dp" or result[k] > 1)
    pred, real = result["predicted_gib"], result["measured_gib"]
    cats = [k for k in pred if k in real] + [k for k in real if k not in pred]
    cell = lambda d, k: f"{d[k]:.3f}" if k in d else "-"  # noqa: E731
    lines = [f"{layout}, zero_stage {result['zero_stage']}: rank {result['rank']} (planned heaviest), GiB "
             f"(cuda_max_allocated: the allocator's own peak, on a GPU)",
             "| | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|",
             "| predicted | " + " | ".join(cell(pred, k) for k in cats) + " |",
             "| measured | " + " | ".join(cell(real, k) for k in cats) + " |",
             f"predicted / measured peak: {result['predicted_over_measured']:.3f}", "",
             "| rank | predicted GiB | measured GiB | comm predicted GB/step | comm measured GB/step |",
             "|---|---|---|---|---|"]
    for r, v in result["ranks"].items():
        lines.append(f"| {r} | {v['predicted_gib']:.3f} | {v['measured_gib']:.3f} | {v['comm_predicted_gb']:.3f} | "
                     f"{v['comm_measured_gb']:.3f} |")
    return "\n".join(lines)
