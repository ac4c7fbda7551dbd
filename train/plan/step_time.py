"""Step time from the step's FLOPs at a peak x MFU, each dimension's bytes at its link's bandwidth, the pipeline
bubble and what the engines overlap."""

from __future__ import annotations

import dataclasses

from hybridtron.configs import JobConfig
from hybridtron.train.parallel.layout import Layout, target_layout
from hybridtron.train.parallel.parallelize import checkpointing_mode


# ---- step time --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the step-time prediction assumes of the cluster (``hybridtron plan`` flags). Defaults: an H100 SXM's
    dense bf16 peak (989 TFLOP/s); MFU 0.40, what dense_1b reached on one H100 without activation checkpointing
    (measured 2026-11-24: 40.3%); NVLink at 360 GB/s per GPU and direction (80% of its 450) and one 400 Gb/s NIC
    per GPU at 45 GB/s (90% of 50) between nodes: assumptions, not measurements."""

    peak_tflops: float = 989.0
    mfu: float = 0.40
    intra_node_gbps: float = 360.0
    inter_node_gbps: float = 45.0
    gpus_per_node: int = 8


def _strides(cfg: JobConfig, layout: Layout) -> dict[str, tuple[int, int]]:
    """(stride, size) of every dimension's groups in the rank order of ``Mesh`` (pp, dp, cp, tp; tp innermost; HSDP's
    shard groups innermost in dp; ep's groups neighbouring dp ranks): a group whose stride x size exceeds a node's
    GPUs crosses nodes."""
    p, dp, shard = cfg.parallel, layout.dp, layout.dp_shard
    fsdp = (p.tp, dp * p.cp) if shard == dp else (p.tp, shard * p.cp)
    return {"dp": fsdp, "dp_replicate": (p.tp * p.cp * shard, dp // shard), "tp": (1, p.tp), "cp": (p.tp, p.cp),
            "ep": (p.tp * p.cp, p.ep), "pp": (dp * p.cp * p.tp, p.pp)}


def step_time(cfg: JobConfig, world: int, comm: dict[str, float], hw: Hardware) -> dict:
    """Predicted seconds per optimizer step on one GPU, and their breakdown.

    compute: the step's model FLOPs (``model/flops.py``: 6 N per token plus attention, MoE counting the routed
    experts) over every GPU evenly, at ``peak x mfu``; full activation checkpointing runs the forward again (x 4/3;
    every k-th block: x (1 + 1/(3k))), selective only elementwise ops (x 1).
    pipeline bubble (pp > 1): (pp - 1) / m of the compute for gpipe and 1f1b, / (m v) for the interleaved schedules
    (v stages per rank; taken for zero_bubble too, an upper bound). Each dimension's bytes (``comm_bytes``) move at the
    intra-node bandwidth when its groups fit in a node, else at the inter-node one. What overlaps, as the engines do
    it: DDP's bucketed all-reduce and HSDP's all-reduce across replicas run during the last micro-batch's backward
    (2/3 of its compute); FSDP2's gathers and reduce-scatters, prefetched a layer ahead, during all of the compute;
    tensor-, expert- and context-parallel exchanges and the pipeline's sends sit on the critical path (exposed)."""
    from hybridtron.model.flops import flops_per_token

    p, t = cfg.parallel, cfg.train
    layout = target_layout(cfg, world)
    dp = layout.dp
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    tokens = t.micro_batch_size * cfg.data.seq_len * t.grad_accum_steps * dp  # per step, all GPUs
    model_flops = flops_per_token(cfg.model, vocab, cfg.data.seq_len) * tokens / world
    mode = checkpointing_mode(t)  # full re-runs the checkpointed blocks' forward (1 of every k blocks: 1/k of it);
    # selective recomputes only elementwise ops between the matmuls it keeps, counted as nothing
    done = model_flops * (1 + 1 / 3 / t.activation_checkpointing_every if mode == "full" else 1.0)
    compute = done / (hw.peak_tflops * 1e12 * hw.mfu)
    bubble = 0.0
    if p.pp > 1:
        bubble = compute * (p.pp - 1) / (t.grad_accum_steps * p.pp_stages_per_rank)
    strides = _strides(cfg, layout)
    seconds, exposed, links = {}, {}, {}
    last_backward = compute / t.grad_accum_steps * 2 / 3
    for dim, volume in comm.items():
        if not volume:
            continue
        stride, size = strides[dim]
        inter = stride * size > hw.gpus_per_node
        links[dim] = "inter-node" if inter else "intra-node"
        seconds[dim] = volume / ((hw.inter_node_gbps if inter else hw.intra_node_gbps) * 1e9)
        if dim == "dp":
            exposed[dim] = max(0.0, seconds[dim] - (compute if p.zero_stage >= 2 else last_backward))
        elif dim == "dp_replicate":
            exposed[dim] = max(0.0, seconds[dim] - last_backward)
        else:
            exposed[dim] = seconds[dim]
    total = compute + bubble + sum(exposed.values())
    return {"step_s": total, "compute_s": compute, "bubble_s": bubble, "comm_s": seconds, "exposed_s": exposed,
            "links": links, "tokens_per_s": tokens / total,
            "mfu": model_flops / total / (hw.peak_tflops * 1e12)}
