"""Bytes every parallel dimension sends per optimizer step and GPU (the formulas in the package's docstring), and
``CollectiveBytes``, which counts what a real step's collectives sent, for ``--measure``."""

from __future__ import annotations

import math

from hybridtron.configs import JobConfig
from hybridtron.train.parallel.layout import target_layout
from hybridtron.train.parallel.parallelize import checkpointing_mode
from hybridtron.train.plan.memory import DIMS, _compute_dtype


# ---- communication ---------------------------------------------------------------------------------------------
def _recomputed_fraction(cfg: JobConfig) -> float:
    """The share of blocks whose forward runs again in backward, collectives included."""
    if checkpointing_mode(cfg.train) != "full":
        return 0.0
    every, layers = cfg.train.activation_checkpointing_every, cfg.model.n_layers
    return math.ceil(layers / every) / layers


def _checkpointing_label(cfg: JobConfig) -> str:
    mode = checkpointing_mode(cfg.train)
    every = cfg.train.activation_checkpointing_every
    return f"{mode} (every {every} blocks)" if mode == "full" and every > 1 else mode


def comm_bytes(cfg: JobConfig, world: int, facts: dict) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step in every parallel dimension (formulas: module docstring)."""
    p, m = cfg.parallel, cfg.model
    layout = target_layout(cfg, world)
    dp = layout.dp
    mb, B, T, d = cfg.train.grad_accum_steps, cfg.train.micro_batch_size, cfg.data.seq_len, m.d_model
    amp = _compute_dtype(cfg)
    c = 2 if amp is not None else 4  # bytes of the autocast dtype
    g = 2 if amp is not None and p.mixed_precision == "auto" else 4

    def f(n):
        return (n - 1) / n

    out = dict.fromkeys((*DIMS, "dp_replicate"), 0.0)
    n, P = dp * p.cp, facts["params"]
    # the ranks FSDP2 shards over: all dp x cp ranks, or HSDP's dp_shard x cp groups
    shard = n if layout.dp_shard == dp else layout.dp_shard * p.cp
    if n > 1:
        if p.zero_stage == 0:
            out["dp"] = 2 * f(n) * 4 * P
        elif p.pp > 1:
            # torch's stages keep the gathered weights from every backward to the next forward (no reshard after a
            # backward before the step's REDUCE_GRAD) and reduce-scatter once per step: ZeRO-2 gathers once, ZeRO-3
            # gathers each block at its m forwards but those after a backward, and before its first backward: m + 1
            # (measured, package docstring), the root (FSDP2 never reshards it after forward) once
            root = facts.get("root_params", 0)
            gathered = P if p.zero_stage == 2 else root + (mb + 1) * (P - root)
            out["dp"] = f(shard) * g * gathered + f(shard) * 4 * P
        else:
            # ZeRO-3 gathers the blocks again in backward; the root stays gathered (reshard_after_forward=False)
            gathered = P if p.zero_stage == 2 else 2 * P - facts.get("root_params", 0)
            out["dp"] = mb * (f(shard) * g * gathered + f(shard) * 4 * P)
            if shard < n:  # HSDP: the step's accumulated shards all-reduced across the groups, once
                out["dp_replicate"] = 2 * f(n // shard) * 4 * P / shard
    if p.ep > 1 and n > p.ep:
        out["dp"] += 2 * f(n // p.ep) * 4 * facts["expert_params"]
    # the residual stream's bytes: bf16 under FSDP2's mixed precision (it casts each block's inputs), else fp32
    r = 2 if g == 2 and p.zero_stage >= 2 and n > 1 else 4
    if p.tp > 1:
        t = T // p.cp  # under context parallel the rank's piece of each sequence
        # per layer: the two norms' outputs all-gathered in forward (their gradients reduce-scattered in backward),
        # in c where a norm's readers are all projections (model/lm.py: the input norm without scale vectors, the
        # second norm too before a SwiGLU), else in r; the two output projections' (c) reduce-scattered, their
        # gradients all-gathered; full checkpointing repeats the forward's of each recomputed block
        plain = not (m.scale.two_sided or m.scale.branch_specific)
        layers, swiglu = facts["layers"], facts.get("swiglu_layers", 0) if plain else 0
        bytes_ = layers * ((c if plain else r) + 2 * c + r) + swiglu * (c - r)
        per_layers = (2 + _recomputed_fraction(cfg)) * f(p.tp) * B * t * d * bytes_
        # the embedding's output reduce-scattered and its gradient all-gathered (r); the final norm's output
        # all-gathered (r) and its gradient, whole sequences, all-reduced (c) by the vocabulary-parallel loss
        ends = f(p.tp) * B * t * d * (facts["embedding"] * 2 * r + facts["head"] * (r + 2 * c))
        out["tp"] = mb * (per_layers + ends)
    if p.pp > 1:
        # the residual stream in the dtype the stages send (memory.sent_dtype)
        boundary = B * (T // (p.cp * p.tp)) * d * r
        for stage in facts["stages"]:
            out["pp"] += mb * boundary * ((stage < facts["n_stages"] - 1) + (stage > 0))
        vocab = m.resolve_vocab(cfg.data.tokenizer.vocab_size)
        if m.tie_embeddings and (facts["embedding"] or facts["head"]):
            # the two ends' fp32 gradient of the shared weight, all-reduced as each rank holds it: its tp piece,
            # and under FSDP2 its dp shard (measured: a (V/2, d) fp32 all-reduce at pp 2 x dp 2, ZeRO-3)
            held = shard if p.zero_stage >= 2 and n > 1 else 1
            out["pp"] += vocab * d * 4 / (p.tp * held)
    if p.ep > 1:
        # the token rows travel in the experts' compute dtype (model/moe.py expert_dtype: autocast's), both ways
        out["ep"] = mb * facts["moe_layers"] * 2 * f(p.ep) * B * (T // p.cp) * m.moe.top_k * d * 2 * c
    if p.cp > 1:
        t = T // p.cp
        D = m.resolved_head_dim()
        block = B * t * (m.n_kv_heads // p.tp) * D  # one piece's keys (or values) of this rank's heads: the ring
        # forward: cp - 1 passes of the key and value blocks; backward: cp - 1 again, and cp of their fp32 gradients
        out["cp"] = mb * facts["attention_layers"] * block * (4 * (p.cp - 1) * c + 8 * p.cp)
        if facts["delta_layers"]:
            n_k, n_v, d_k, d_v = m.deltanet.resolved(m)
            n_h = m.deltanet.n_householder
            conv_dim = n_k * d_k * (1 + n_h) + n_v * d_v * n_h
            # all-gathers of both chunks' (A | B) of this rank's heads (fp32) and of their last conv_size - 1 inputs
            maps = 2 * (p.cp - 1) * B * (n_v // p.tp) * d_k * (d_k + d_v) * 4
            halo = 2 * (p.cp - 1) * B * (m.deltanet.conv_size - 1) * (conv_dim // p.tp) * c
            out["cp"] += mb * facts["delta_layers"] * 2 * (maps + halo)
        if m.doc_mask:
            out["cp"] += mb * (p.cp - 1) * B * t * 8
    return out
