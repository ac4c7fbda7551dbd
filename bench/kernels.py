"""Fused kernels against their peers, in one run: time, bandwidth or FLOP rate, and peak memory per op.

    python -m hybridtron.bench.kernels                      # every op at LM sizes on the GPU, appended to RESULTS.md
    python -m hybridtron.bench.kernels --ops norm swiglu --tokens 16384 --d-model 4096 --no-append

Ops and the peers each is timed against (a peer that is not installed is listed as unavailable):

- ``norm``: RMSNorm with the residual add fused (the form every block uses), forward + backward -- torch
  eager (our reference), ``torch.compile`` of it, Liger-Kernel's RMSNorm (+ a torch add: it has no residual
  form), our Triton kernel; and the delta-rule mixer's gated norm ``norm(o) * silu(z)`` per value head
  (``--dr-heads`` x ``--dr-head-dim`` per token) -- eager, compiled, ours.
- ``rotary``: QK-norm + rotary of q and k (Qwen3.5's 25% rotary fraction by default) -- eager, compiled,
  Liger's rope (after a torch QK-norm, in its (B, H, T, D) layout, partial rotary via its ``rotary_dim``),
  ours.
- ``swiglu``: ``silu(g) * u`` -- eager, compiled, Liger's SiLU-mul, ours.
- ``conv``: Gated DeltaNet's short causal depthwise convolution + SiLU (kernels/short_conv) over the q/k/v
  channels of in_proj_qkv (hybrid_1b: 6144 channels, width 4; every ``--conv-seq`` x ``--conv-batch``, without
  and with documents of mean length ``--dr-doc-len``) -- eager reference, compiled, Dao-AILab's
  ``causal_conv1d_fn`` (``causal-conv1d``, CUDA; documents as its ``seq_idx``) where installed, ours; a verdict
  each against the 70% of copy bandwidth target.
- ``cross_entropy``: LM head + loss at a 152k vocabulary -- the plain path (logits, fp32 upcast,
  F.cross_entropy), compiled plain path, Liger's fused linear cross-entropy, ours (chunked).
- ``delta_rule``: Gated DeltaNet's chunked gated delta rule, forward + backward (issue 10) -- the torch
  chunked reference eager and compiled, flash-linear-attention's ``chunk_gated_delta_rule`` (``fla-core``,
  carried as a wheel like Liger's), ours; every ``--dr-seq`` (4k, 8k, 16k by default) x ``--dr-batch`` (1, 4)
  x ``--dr-docs`` (``none``: B rows of T tokens; ``packed``: the B x T tokens as one row cut into documents of
  lengths uniform in [1, 2 x ``--dr-doc-len``), fla given them as ``cu_seqlens``, ours as the document starts the
  mixer passes), each with its own verdict: time and peak memory against fla's.
- ``moe_permute``: the MoE token permute (expert-sorted gather) and unpermute (weighted combine), forward +
  backward, at the hybrid_moe preset's sizes (``--tokens`` x top-4 x d 1024) -- eager reference, compiled, ours.
- ``grouped_gemm``: the MoE expert matmuls (model/moe.py's ``grouped_linear``), forward + backward, at the
  hybrid_moe preset's sizes (d 1024, 32 experts, top-4, expert hidden 768) -- ours (the native backend:
  ``torch._grouped_mm``), megablocks' ``grouped_gemm.ops.gmm`` (its dMoE's kernel; model.moe.backend=megablocks)
  where installed, a per-expert ``torch.matmul`` loop (the eager reference), and the dense baseline: the same
  FLOPs as one plain ``torch.matmul`` per projection over all routed rows (a rate baseline: it computes
  something else, so it is not compared with ours).
- ``moe_layer``: a whole MoE layer (model/moe.py: router, aux and z losses, permute, grouped expert SwiGLUs,
  unpermute, shared expert), forward + backward, at the hybrid_moe preset's sizes, as the trainer runs it (fp32
  parameters, ``--dtype`` autocast, fp32 input from the norm) -- ours, the same layer with the permutation fused
  into the gate_up GEMM (``model.moe.gather=gemm``, kernels/moe_gemm; where Triton runs), the masked per-expert loop
  (``moe_reference``, the ground truth), the same layer with autocast off (fp32 experts: the path the layer took
  before it cast for the grouped GEMM; a rate baseline) and a dense SwiGLU of the same active FLOPs (hidden =
  top_k x expert hidden + shared hidden; a rate baseline). Rated in TFLOP/s of the active FLOPs.
- ``attention``: gated attention, delegated to bench/kernels_attention.py (SDPA flash + gate, the masked
  SDPA path, flash-attn varlen + gate, our Triton kernel; each checked against the float32 reference, rated
  in TFLOP/s over the unmasked causal pairs).

Every candidate's outputs and input gradients are first compared with ours (a candidate that computes
something else is reported, not timed; a case's rate baselines are timed without the comparison). Each
candidate runs on its own copies of the inputs and cotangents, so a peer that writes into them in place
cannot change what the others are checked and timed on. Timing:
CUDA events, ``--repeats`` rounds after a warm-up, the candidates alternating within a round; the median
is reported. Bandwidth counts the bytes an op must move
at least (inputs read once, outputs written once, forward and backward), against the device's copy
bandwidth measured in the same run (``y.copy_(x)`` of 1 GiB); the loss counts 6 N d V FLOPs. Peak memory
is the allocator's peak over one forward + backward above what the inputs already hold.

Targets (issue 9, one H100): norm, rotary and SwiGLU at >= 85% of the copy bandwidth and faster than
torch.compile; fused linear cross-entropy at vocabulary 152k with <= 15% of the plain path's peak memory
in <= 1.1x its time. Issue 10 (same GPU): the chunked delta rule at least as fast as fla's at head dim 128,
sequence 4k-16k. MoE (same GPU): the grouped expert matmul at >= 80% of the TFLOP/s of a dense matmul of
the same FLOPs, megablocks' dMoE kernel timed beside it where installed; the whole MoE layer's forward + backward
within 1.3x the time of a dense SwiGLU of the same active FLOPs (issue 21). Gated attention (same GPU): forward +
backward >= 1.1x SDPA-flash + a separate gate at head dims 128 and 256, sequences 4k-8k, with and without
documents. The summary lines under the table say met / not met (or not measured) for each.

Liger-Kernel on a machine without internet (the lent GPU machines): download here, carry, install there:

    pip download liger-kernel --no-deps -d wheels/liger      # here: one pure-Python wheel
    # run on the device with carry=["wheels"], then:
    pip install --no-deps wheels/liger/*.whl && python -m hybridtron.bench.kernels

(``--no-deps``: its triton/torch requirements are already met by the CUDA torch install.)

On the CPU (``--device cpu``) the script runs at tiny sizes for its tests: eager and reference peers
only unless TRITON_INTERPRET=1; the numbers mean nothing there and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridtron.bench.report import RESULTS, append_results, device_name
from hybridtron.bench.timing import (  # noqa: F401  (Row and the ATT_ names: this module's public table)
    ATT_HEAD_DIMS,
    ATT_OURS,
    ATT_SDPA_FLASH,
    ATT_SEQS,
    ATT_TARGET,
    Row,
    _fwd_bwd,
    _peak_mib,
    _sync,
    _timed,
    _timed_pair,
    _tuple,
    attention_verdicts,
)
from hybridtron.kernels import backend
from hybridtron.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from hybridtron.kernels.gated_delta_rule import chunk_gated_delta_rule, delta_rule_chunked
from hybridtron.kernels.moe_permute import (
    moe_permute,
    moe_unpermute,
    permute_reference,
    sort_assignments,
    unpermute_reference,
)
from hybridtron.kernels.norm import rms_norm, rms_norm_reference
from hybridtron.kernels.rotary import rotary_qk, rotary_qk_reference
from hybridtron.kernels.short_conv import short_conv, short_conv_reference
from hybridtron.kernels.swiglu import swiglu, swiglu_reference
from hybridtron.model.moe import _grouped_mm_ok, grouped_linear

OPS = ("norm", "rotary", "swiglu", "conv", "cross_entropy", "delta_rule", "moe_permute", "grouped_gemm",
       "moe_layer", "attention")


@dataclass
class Case:
    """One op at one size: inputs (those requiring grad get gradients), the traffic or work to rate it by, and
    candidates name -> fn(*inputs) returning a tensor or tuple to backpropagate through."""

    op: str
    shape: str
    inputs: list[torch.Tensor]
    candidates: dict[str, Callable | str]  # a str: why the candidate is unavailable
    bytes_moved: int = 0  # forward + backward, for GB/s
    flops: float = 0.0  # forward + backward, for TFLOP/s
    ours: str = "triton (ours)"  # the candidate the others are checked against (the first callable where absent)
    baselines: frozenset[str] = frozenset()  # rate baselines: timed, but they compute something else (no max diff)
    extra: dict = field(default_factory=dict)  # copied to every row (what a verdict needs besides the shape string)


# ---- candidates -----------------------------------------------------------------------------------------------
def _liger(name: str):
    """A Liger-Kernel autograd.Function by module and class name, or the reason it is unavailable."""
    try:
        import importlib

        mod, cls = name.rsplit(".", 1)
        return getattr(importlib.import_module(f"liger_kernel.ops.{mod}"), cls)
    except Exception as e:  # not installed, or another version's layout
        return f"Liger-Kernel unavailable ({type(e).__name__}: {str(e).splitlines()[0][:60]})"


def _compiled(fn: Callable, enabled: bool) -> Callable | str:
    return torch.compile(fn) if enabled else "torch.compile skipped (--no-compile)"


def norm_case(tokens: int, d: int, dtype, device, compile_peers: bool, ours: bool) -> Case:
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    r = torch.randn(tokens, d, device=device, dtype=dtype)
    w = torch.rand(d, device=device) + 0.5

    def eager(x, r, w):
        return rms_norm_reference(x, w, 1e-6, 0.0, r)

    cands: dict = {"torch eager": eager, "torch.compile": _compiled(eager, compile_peers)}
    liger = _liger("rms_norm.LigerRMSNormFunction")
    if isinstance(liger, str):
        cands["liger (+ torch add)"] = liger
    else:
        def liger_fn(x, r, w):
            h = x + r
            return liger.apply(h, w.to(h.dtype), 1e-6, 0.0, "llama", False), h
        cands["liger (+ torch add)"] = liger_fn
    if ours:
        cands["triton (ours)"] = lambda x, r, w: rms_norm(x, w, 1e-6, residual=r, backend="triton")
    e = x.element_size()
    # fwd: read x, r; write y, h. bwd: read dy, dh, h; write dx (= dr). w is negligible.
    return Case("norm", f"{tokens}x{d} {_dt(dtype)} +residual", [x, r, w], cands, bytes_moved=8 * tokens * d * e)


def gated_norm_case(tokens: int, heads: int, head_dim: int, dtype, device, compile_peers: bool, ours: bool) -> Case:
    """The Gated DeltaNet mixer's output norm, ``norm(o) * silu(z)`` per value head (model/gated_deltanet.py):
    rows of head_dim, tokens x heads of them."""
    o = torch.randn(tokens * heads, head_dim, device=device, dtype=dtype)
    z = torch.randn(tokens * heads, head_dim, device=device, dtype=dtype)
    w = torch.rand(head_dim, device=device) + 0.5

    def eager(o, z, w):
        return rms_norm_reference(o, w, 1e-6, z=z)

    cands: dict = {"torch eager": eager, "torch.compile": _compiled(eager, compile_peers)}
    if ours:
        cands["triton (ours)"] = lambda o, z, w: rms_norm(o, w, 1e-6, z=z, backend="triton")
    # fwd: read o, z; write y. bwd: read dy, o, z; write do, dz. w is negligible.
    return Case("norm", f"{tokens}x{heads}x{head_dim} {_dt(dtype)} gated (delta-rule output)", [o, z, w], cands,
                bytes_moved=8 * o.numel() * o.element_size())


def rotary_case(tokens: int, heads: int, kv_heads: int, head_dim: int, fraction: float, dtype, device,
                compile_peers: bool, ours: bool) -> Case:
    B, T = max(1, tokens // 4096), min(tokens, 4096)
    q = torch.randn(B, T, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(B, T, kv_heads, head_dim, device=device, dtype=dtype)
    rot = int(head_dim * fraction)
    ang = torch.outer(torch.arange(T, device=device, dtype=torch.float64),
                      10000.0 ** -(torch.arange(0, rot, 2, device=device, dtype=torch.float64) / rot))
    cos, sin = ang.cos().float(), ang.sin().float()
    qw, kw = torch.rand(head_dim, device=device) + 0.5, torch.rand(head_dim, device=device) + 0.5

    def eager(q, k, qw, kw):
        return rotary_qk_reference(q, k, cos, sin, norm=True, q_weight=qw, k_weight=kw)

    cands: dict = {"torch eager": eager, "torch.compile": _compiled(eager, compile_peers)}
    liger = _liger("rope.LigerRopeFunction")
    if isinstance(liger, str):
        cands["liger rope (+ torch QK-norm)"] = liger
    else:
        def liger_fn(q, k, qw, kw):  # its layout is (B, H, T, D); rotary_dim with half-width tables (>= 0.8)
            qn, kn = rms_norm_reference(q, qw), rms_norm_reference(k, kw)
            qo, ko = liger.apply(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin, None, 1, rot)
            return qo.transpose(1, 2), ko.transpose(1, 2)
        cands["liger rope (+ torch QK-norm)"] = liger_fn
    if ours:
        cands["triton (ours)"] = lambda q, k, qw, kw: rotary_qk(q, k, cos, sin, norm=True, q_weight=qw, k_weight=kw,
                                                                backend="triton")
    n = (q.numel() + k.numel()) * q.element_size()
    # fwd: read q, k; write both. bwd: read dq_out, dk_out, q, k; write dq, dk.
    return Case("rotary", f"B{B} T{T} H{heads}/{kv_heads} D{head_dim} rot {fraction:g} {_dt(dtype)} +QK-norm",
                [q, k, qw, kw], cands, bytes_moved=6 * n)


def swiglu_case(tokens: int, hidden: int, dtype, device, compile_peers: bool, ours: bool) -> Case:
    g = torch.randn(tokens, hidden, device=device, dtype=dtype)
    u = torch.randn(tokens, hidden, device=device, dtype=dtype)
    cands: dict = {"torch eager": swiglu_reference, "torch.compile": _compiled(swiglu_reference, compile_peers)}
    liger = _liger("swiglu.LigerSiLUMulFunction")
    cands["liger"] = liger if isinstance(liger, str) else (lambda g, u: liger.apply(g, u))
    if ours:
        cands["triton (ours)"] = lambda g, u: swiglu(g, u, backend="triton")
    # fwd: read g, u; write y. bwd: read dy, g, u; write dg, du.
    return Case("swiglu", f"{tokens}x{hidden} {_dt(dtype)}", [g, u], cands,
                bytes_moved=8 * g.numel() * g.element_size())


def _causal_conv1d(device):
    """Dao-AILab's causal_conv1d_fn, or the reason it is unavailable (imported lazily: CUDA-only, optional)."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception as e:
        return f"causal-conv1d unavailable ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
    if device.type != "cuda":
        return "causal-conv1d runs on CUDA only"
    return causal_conv1d_fn


def conv_case(seq: int, channels: int, width: int, dtype, device, compile_peers: bool, ours: bool,
              batch: int = 1, doc_len: int | None = None) -> Case:
    """silu(causal depthwise conv) of ``batch`` (batch, seq, channels) rows; with ``doc_len``, each row cut into
    documents (`packed_cu_seqlens`) given as doc ids (ours, the reference) or as causal-conv1d's seq_idx.
    Weight (C, 1, K) as nn.Conv1d stores it."""
    x = torch.randn(batch, seq, channels, device=device, dtype=dtype)
    w = (torch.rand(channels, 1, width, device=device) * 2 - 1) * width ** -0.5  # nn.Conv1d's default init
    doc_ids = None
    if doc_len:
        cu = packed_cu_seqlens(batch, seq, doc_len)
        doc_ids = (torch.searchsorted(cu, torch.arange(batch * seq), right=True) - 1).view(batch, seq).to(device)

    def eager(x, w):
        return short_conv_reference(x, w, doc_ids)

    cands: dict = {"torch eager": eager, "torch.compile": _compiled(eager, compile_peers)}
    cc = _causal_conv1d(device)
    # (B, C, T) as a transposed view of our (B, T, C): its channel-last layout, so no copy either way; its
    # documents are seq_idx (B, T) int32, which it takes in that layout only
    seq_idx = None if doc_ids is None else doc_ids.to(torch.int32)
    cands["causal-conv1d"] = cc if isinstance(cc, str) else (
        lambda x, w: cc(x.transpose(1, 2), w[:, 0], seq_idx=seq_idx, activation="silu").transpose(1, 2))
    if ours:
        cands["triton (ours)"] = lambda x, w: short_conv(x, w, doc_ids, backend="triton")
    # fwd: read x; write y. bwd: read dy, x; write dx. w and dw (C x K) and the doc ids are negligible.
    docs = f" docs~{doc_len}" if doc_len else ""
    return Case("conv", f"B{batch} T{seq} C{channels} K{width}{docs} {_dt(dtype)}", [x, w], cands,
                bytes_moved=5 * x.numel() * x.element_size())


def cross_entropy_case(tokens: int, d: int, vocab: int, dtype, device, compile_peers: bool, ours: bool) -> Case:
    h = torch.randn(tokens, d, device=device, dtype=dtype)
    w = torch.randn(vocab, d, device=device, dtype=dtype) * d ** -0.5
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[::17] = -100

    def plain(h, w, labels):
        return linear_cross_entropy_reference(h, w, labels)

    cands: dict = {"plain (logits + F.cross_entropy)": plain, "torch.compile plain": _compiled(plain, compile_peers)}
    liger = _liger("fused_linear_cross_entropy.LigerFusedLinearCrossEntropyFunction")
    cands["liger fused linear CE"] = liger if isinstance(liger, str) else (lambda h, w, labels: _first(liger.apply(h, w, labels)))
    if ours:
        cands["triton (ours, chunked)"] = lambda h, w, labels: linear_cross_entropy(h, w, labels, backend="triton")
    return Case("cross_entropy", f"N{tokens} d{d} V{vocab} {_dt(dtype)}", [h, w, labels], cands,
                flops=6.0 * tokens * d * vocab, ours="triton (ours, chunked)")


def _fla_chunk_gdr(device=None):
    """flash-linear-attention's chunk_gated_delta_rule, or the reason it is unavailable (its kernels run on CUDA
    only; carry its ``fla-core`` wheel to the GPU machine as Liger's above)."""
    why = backend.peer_unavailable_reason("fla", device)
    if why is not None:
        return f"fla unavailable ({why})"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:
        return f"fla unavailable ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
    _lift_fla_hopper_guard()
    return chunk_gated_delta_rule


FLA_GUARD_LIFTED = False  # True once the bench lifted fla's Hopper guard (the verdicts say so)


def _lift_fla_hopper_guard() -> None:
    """fla-core refuses its gated backward on Hopper with triton < 3.7.1 (its issue #640), and the lent GPUs run
    triton 3.6: the bench times fla with that guard lifted, as issue 20 asks. Its results may be off then; the
    table's max-diff column says by how much, and its time is what the verdict compares."""
    global FLA_GUARD_LIFTED
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception:
        return
    if getattr(chunk_o, "IS_NVIDIA_HOPPER", False):
        chunk_o.IS_NVIDIA_HOPPER = False
        FLA_GUARD_LIFTED = True


def packed_cu_seqlens(batch: int, seq: int, mean_len: int, seed: int = 0) -> torch.Tensor:
    """Cumulative lengths (int64, fla's and flash-attn's convention) of ``batch`` rows of ``seq`` tokens packed
    into one: each row cut into documents of lengths uniform in [1, 2 mean_len), the last one cut at the row's
    end, so no document crosses from one row into the next."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cuts = [0]
    for b in range(batch):
        at, end = b * seq, (b + 1) * seq
        while at < end:
            at = min(end, at + int(torch.randint(1, 2 * mean_len, (1,), generator=g)))
            cuts.append(at)
    return torch.tensor(cuts, dtype=torch.int64)


def delta_rule_case(seq: int, heads: int, head_dim: int, chunk: int, dtype, device, compile_peers: bool,
                    ours: bool, batch: int = 1, doc_len: int | None = None) -> Case:
    """Gated DeltaNet's chunked delta rule, forward + backward, on ``batch`` sequences of ``seq`` tokens: q, k, v
    of ``heads`` heads of ``head_dim`` (no grouped values, one Householder step: what fla's kernel also takes),
    log decays and write strengths in fp32 as the mixer makes them; q and k L2-normalised inside. With
    ``doc_len``, the batch x seq tokens are one packed row of documents (`packed_cu_seqlens`): fla takes them as
    cu_seqlens, ours and the reference as document starts (what the mixer passes; computed once, outside the
    timed calls, as the trainer does once per batch)."""
    g0 = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g0).to(device=device, dtype=dt)

    B, T = (1, batch * seq) if doc_len else (batch, seq)
    q, k, v = rnd(B, T, heads, head_dim), rnd(B, T, 1, heads, head_dim), rnd(B, T, 1, heads, head_dim)
    g = -torch.nn.functional.softplus(rnd(B, T, heads, dt=torch.float32)) * 0.1
    beta = torch.sigmoid(rnd(B, T, 1, heads, dt=torch.float32))
    cu = packed_cu_seqlens(batch, seq, doc_len).to(device) if doc_len else None
    resets = backend.starts_from_cu_seqlens(cu, T, "delta_rule bench") if doc_len else None

    def reference(q, k, v, g, beta):
        return delta_rule_chunked(q, k, v, g, beta, resets=resets, chunk_size=chunk)[0]

    cands: dict = {"torch eager (reference)": reference, "torch.compile (reference)": _compiled(reference, compile_peers)}
    fla = _fla_chunk_gdr(device)
    cands[DR_FLA] = fla if isinstance(fla, str) else (
        lambda q, k, v, g, beta: fla(q, k[:, :, 0], v[:, :, 0], g, beta[:, :, 0], use_qk_l2norm_in_kernel=True,
                                     cu_seqlens=cu)[0])
    if ours:
        cands[DR_OURS] = lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, resets=resets,
                                                                         chunk_size=chunk)[0]
    docs = f" docs~{doc_len} ({cu.numel() - 1})" if doc_len else ""
    return Case("delta_rule", f"B{batch} T{seq} H{heads} D{head_dim} C{chunk}{docs} {_dt(dtype)}", [q, k, v, g, beta],
                cands, extra={"seq": seq, "head_dim": head_dim, "batch": batch, "docs": bool(doc_len)})


def moe_permute_case(tokens: int, d: int, experts: int, top_k: int, dtype, device, compile_peers: bool,
                     ours: bool) -> Case:
    """MoE token permute and unpermute, forward + backward, as MoE.forward calls them around the experts: xs =
    permute(x) and y = unpermute(ys, weights), each on its own input (ys stands in for the experts' outputs).
    Routing: top_k distinct uniformly random experts per token (the gather's cost hardly depends on balance);
    router weights in fp32 as MoE.route makes them."""
    g0 = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.rand(tokens, experts, generator=g0).topk(top_k, dim=-1).indices
    order, pos = (t.to(device) for t in sort_assignments(idx.flatten()))
    x = torch.randn(tokens, d, generator=g0).to(device=device, dtype=dtype)
    ys = torch.randn(tokens * top_k, d, generator=g0).to(device=device, dtype=dtype)
    wts = torch.rand(tokens, top_k, generator=g0).softmax(-1).to(device)

    def eager(x, ys, wts):
        return permute_reference(x, order, top_k), unpermute_reference(ys, order, wts, top_k)

    cands: dict = {"torch eager": eager, "torch.compile": _compiled(eager, compile_peers)}
    if ours:
        cands["triton (ours)"] = lambda x, ys, wts: (moe_permute(x, order, pos, top_k, backend="triton"),
                                                     moe_unpermute(ys, order, pos, wts, top_k, backend="triton"))
    # In rows of d, N tokens, k: permute fwd reads N, writes N k; bwd reads N k, writes N. Unpermute fwd reads
    # N k, writes N; bwd reads dy (N) and ys (N k, for dw), writes dys (N k). Indices and weights are negligible.
    rows = (2 * (top_k + 1) + 3 * top_k + 2) * tokens
    return Case("moe_permute", f"N{tokens} E{experts} top{top_k} d{d} {_dt(dtype)}", [x, ys, wts], cands,
                bytes_moved=rows * d * x.element_size())


CONV_TARGET = 0.7  # the short convolution's fwd + bwd at >= 70% of copy bandwidth (issue 20)
DR_OURS, DR_FLA = "triton (ours)", "fla chunk_gated_delta_rule"  # the delta-rule candidates the target compares
DR_TARGET = 0.8  # ours at <= 0.8x fla's time (issue 20), and no more peak memory than fla ...
DR_HEAD_DIM, DR_SEQS, DR_BATCHES = 128, (4096, 16384), (1, 4)  # ... at this head dim, sequences, batches
GG_OURS = "ours (grouped_linear, native)"
GG_MEGABLOCKS = "megablocks gmm (grouped_linear, megablocks)"
GG_LOOP = "torch.matmul per expert (eager reference)"
GG_DENSE = "dense torch.matmul, same FLOPs (rate baseline, not compared)"


def _megablocks_gmm(device) -> str | None:
    """None where megablocks' grouped GEMM can run here, else the reason it is unavailable."""
    try:
        import grouped_gemm.ops  # noqa: F401  (installed with megablocks; CUDA only)
    except Exception as e:
        return f"megablocks unavailable ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
    if device.type != "cuda":
        return "megablocks' grouped_gemm runs on CUDA only"
    return None


def grouped_gemm_case(tokens: int, d: int, experts: int, top_k: int, hidden: int, dtype, device,
                      temperature: float = 1.0) -> Case:
    """The MoE expert matmuls, forward + backward: the two projections of the expert SwiGLUs as MoE.run_experts
    runs them through ``grouped_linear`` (gate_up: d -> 2 hidden, down: hidden -> d, weights in the layer's
    (E, out, in) layout), on the ``tokens * top_k`` assignments sorted by expert. The unit is the matmuls alone:
    each projection takes its own input rows (the down projection's stand in for ``silu(gate) * up``), so the
    SwiGLU's elementwise work, the routing, the permutation and the offsets are outside the timing.

    Routing is uneven as a real router's is: a seeded linear router with a random popularity per expert, its
    softmax at ``temperature`` sampled for top_k distinct experts per token; the expert-sorted rows are the
    token rows that kernels/moe_permute gathers (``x[order // k]``). FLOPs: 6 R d hidden forward (2 R d 2h +
    2 R h d), twice that backward (input and weight gradients), R the routed rows. The dense baseline does
    the same FLOPs as one (R, d) x (d, 2 hidden) and one (R, hidden) x (hidden, d) matmul with one weight each."""
    g0 = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g0) * scale).to(device=device, dtype=dtype)

    x = torch.randn(tokens, d, generator=g0)
    logits = x @ torch.randn(d, experts, generator=g0) * d ** -0.5 + 0.5 * torch.randn(experts, generator=g0)
    idx = torch.multinomial((logits / temperature).softmax(-1), top_k, replacement=False, generator=g0)
    order, _ = sort_assignments(idx.flatten())
    counts = torch.bincount(idx.flatten(), minlength=experts).tolist()
    xs = permute_reference(x, order, top_k).to(device=device, dtype=dtype)
    rows = xs.shape[0]
    h = rnd(rows, hidden)
    w_gu, w_d = rnd(experts, 2 * hidden, d, scale=d ** -0.5), rnd(experts, d, hidden, scale=hidden ** -0.5)
    dense_gu, dense_d = rnd(2 * hidden, d, scale=d ** -0.5), rnd(d, hidden, scale=hidden ** -0.5)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)  # as MoE.run_experts makes them

    def grouped(backend):
        def fn(xs, h, w_gu, w_d, dense_gu, dense_d):
            return (grouped_linear(xs, w_gu, offsets, backend, counts),
                    grouped_linear(h, w_d, offsets, backend, counts))
        return fn

    def loop(xs, h, w_gu, w_d, dense_gu, dense_d):
        # unbind, not w[e]: each w[e]'s backward would write a zero gradient of the whole (E, out, in) weight
        gu, dn = w_gu.unbind(0), w_d.unbind(0)
        return (torch.cat([torch.matmul(xe, gu[e].T) for e, xe in enumerate(xs.split(counts))]),
                torch.cat([torch.matmul(he, dn[e].T) for e, he in enumerate(h.split(counts))]))

    def dense(xs, h, w_gu, w_d, dense_gu, dense_d):
        return torch.matmul(xs, dense_gu.T), torch.matmul(h, dense_d.T)

    mb = _megablocks_gmm(device)
    cands: dict = {GG_OURS: grouped("native"), GG_MEGABLOCKS: mb or grouped("megablocks"), GG_LOOP: loop,
                   GG_DENSE: dense}
    path = "torch._grouped_mm" if _grouped_mm_ok(xs, 2 * hidden, d, hidden) else "per-expert fallback"
    shape = (f"N{tokens} E{experts} top{top_k} d{d} I{hidden} {_dt(dtype)}: {rows} rows, expert load "
             f"{min(counts)}-{max(counts)}; native = {path}")
    return Case("grouped_gemm", shape, [xs, h, w_gu, w_d, dense_gu, dense_d], cands,
                flops=18.0 * rows * d * hidden, ours=GG_OURS, baselines=frozenset({GG_DENSE}))


ML_OURS = "MoE layer (ours)"
ML_LOOP = "MoE layer, masked per-expert loop (moe_reference)"
ML_GATHER = "MoE layer, rows gathered by the gate_up GEMM (model.moe.gather=gemm)"
ML_FP32 = "MoE layer, autocast off: fp32 experts (rate baseline, not compared)"
ML_DENSE = "dense SwiGLU, same active FLOPs (rate baseline, not compared)"
ML_TARGET = 1.3  # the MoE layer's fwd+bwd within 1.3x the dense SwiGLU's time


def moe_layer_case(tokens: int, d: int, experts: int, top_k: int, hidden: int, shared: int, dtype, device) -> Case:
    """One MoE layer, forward + backward, as a training step runs it: fp32 parameters under ``dtype`` autocast (no
    autocast for float32), the input in fp32 as the norm hands it over, the weighted aux and z losses
    backpropagated with the output, the parameters' gradients accumulated. Routing comes from the router itself
    (weights N(0, 0.02), so loads are uneven as early in training). FLOPs: the active ones, 6 per weight a token
    (router, top_k experts, shared expert and its gate); the dense SwiGLU has hidden top_k * hidden + shared, the
    same FLOPs but the router's and the gate's (under 1%)."""
    from hybridtron.configs import ModelConfig, MoEConfig
    from hybridtron.model.mlp import SwiGLU
    from hybridtron.model.moe import MoE, moe_reference

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=d, moe=MoEConfig(n_experts=experts, top_k=top_k, expert_hidden=hidden,
                                               shared_expert_hidden=shared, aux_loss_coef=1e-3, z_loss_coef=1e-3,
                                               bias_update_rate=1e-3))
    moe, dense = MoE(cfg).to(device), SwiGLU(d, top_k * hidden + shared, cfg).to(device)
    for p in [*moe.parameters(), *dense.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    moe.train()
    # The same layer and weights with the permutation fused into the gate_up GEMM (kernels/moe_gemm, Triton): the
    # default stays the permute path until this row shows the gathered one faster on the GPU.
    why_not = backend.unavailable_reason("triton", device)
    if why_not is None:
        cfg.moe.gather, cfg.kernels.moe = "gemm", "triton"
        gathered = MoE(cfg).to(device)
        gathered.load_state_dict(moe.state_dict())
        gathered.train()
    x = torch.randn(tokens, d, device=device)
    amp = dtype if dtype != torch.float32 else None

    def autocast():
        return torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()

    def layer(x):
        with autocast():
            y = moe(x)
        return y, moe.aux_loss

    def gather_gemm(x):
        with autocast():
            y = gathered(x)
        return y, gathered.aux_loss

    def loop(x):
        with autocast():
            y = moe_reference(moe, x)
        logits, probs, _, idx = moe.route(x)  # the same losses from the same routing
        return y, moe._losses(logits, probs, torch.bincount(idx.flatten(), minlength=experts))[0]

    def fp32(x):
        return moe(x), moe.aux_loss

    def swiglu(x):
        with autocast():
            return dense(x)

    cands: dict = {ML_OURS: layer, ML_GATHER: gather_gemm if why_not is None else f"Triton unavailable: {why_not}",
                   ML_LOOP: loop, ML_FP32: fp32, ML_DENSE: swiglu}
    per_token = moe.active_params_per_token()
    shape = f"N{tokens} E{experts} top{top_k} d{d} I{hidden} shared{shared} " + (f"{_dt(dtype)} autocast" if amp else
                                                                                   "fp32, no autocast")
    return Case("moe_layer", shape, [x], cands, flops=6.0 * tokens * per_token, ours=ML_OURS,
                baselines=frozenset({ML_FP32, ML_DENSE}))


def _first(out):
    """Liger's fused linear CE returns (loss, z_loss, accuracy, predicted) in recent versions, the loss alone before."""
    return out[0] if isinstance(out, tuple) else out


# ---- measuring ------------------------------------------------------------------------------------------------
def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fresh(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Private copies of ``tensors`` (leaves, requires_grad kept) for one candidate."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def copy_bandwidth(device, gib: float = 1.0, repeats: int = 10) -> float | None:
    """GB/s of y.copy_(x) (read + write counted), the device's practical memory bandwidth."""
    if device.type != "cuda":
        return None
    n = int(gib * 2**30) // 4
    x, y = torch.empty(n, device=device), torch.empty(n, device=device)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n * 4 / statistics.median(times) / 1e9


def run_case(case: Case, device, repeats: int, warmup: int, copy_gbs: float | None) -> list[Row]:
    for t in case.inputs:
        if t.is_floating_point():
            t.requires_grad_(True)
    rows, live = [], {}
    ours = case.candidates.get(case.ours)
    ref_fn = ours if callable(ours) else next(f for f in case.candidates.values() if callable(f))
    ref_out, ref_grad = _fwd_bwd(ref_fn, _fresh(case.inputs))
    cot = [torch.ones_like(o) / o.numel() ** 0.5 for o in ref_out]
    for name, fn in case.candidates.items():
        if not callable(fn):
            rows.append(Row(case.op, case.shape, name, note=fn, extra=dict(case.extra)))
            continue
        # Each candidate checks and times on its own copies of the inputs and cotangents: a peer that writes
        # into them in place (Liger's SwiGLU backward stores its gradients in the saved inputs; its rope
        # rotates in place) then changes only what it computes on itself, never a later candidate's data.
        args, c = _fresh(case.inputs), _fresh(cot)
        try:
            out, grad = _fwd_bwd(fn, args, c)
        except Exception as e:  # a peer's version or layout that does not fit: report, do not time
            rows.append(Row(case.op, case.shape, name, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}",
                            extra=dict(case.extra)))
            continue
        errs = [] if name in case.baselines else [
            (a.float() - b.float()).abs().max().item() for a, b in zip(out + grad, ref_out + ref_grad, strict=False)
            if a is not None and b is not None and a.shape == b.shape]
        del out, grad
        for t in args:
            t.grad = None
        live[name] = (fn, args, c)
        rows.append(Row(case.op, case.shape, name, max_err=max(errs) if errs else None, extra=dict(case.extra)))
    for _ in range(warmup):
        for fn, args, c in live.values():
            _timed(fn, args, c, device)
    times: dict[str, list[float]] = {n: [] for n in live}
    for _ in range(repeats):
        for n, (fn, args, c) in live.items():
            times[n].append(_timed(fn, args, c, device))
    for row in rows:
        if row.impl not in live:
            continue
        row.seconds = statistics.median(times[row.impl])
        row.peak_mib = _peak_mib(*live[row.impl], device)
        if case.bytes_moved:
            gbs = case.bytes_moved / row.seconds / 1e9
            row.extra["gbs"] = gbs
            row.rate = f"{gbs:,.0f} GB/s" + (f" ({100 * gbs / copy_gbs:.0f}% of copy)" if copy_gbs else "")
        elif case.flops:
            row.rate = f"{case.flops / row.seconds / 1e12:,.1f} TFLOP/s"
    return rows


# ---- report ---------------------------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    lines = ["| op | shape | implementation | fwd+bwd ms | rate | peak MiB | max diff vs ours |",
             "| --- | --- | --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        if r.seconds is None:
            lines.append(f"| {r.op} | {r.shape} | {r.impl} | {r.note} | | | |")
            continue
        peak = f"{r.peak_mib:,.0f}" if r.peak_mib is not None else "-"
        err = f"{r.max_err:.1e}" if r.max_err is not None else "-"
        lines.append(f"| {r.op} | {r.shape} | {r.impl} | {r.seconds * 1e3:.3f} | {r.rate} | {peak} | {err} |")
    return "\n".join(lines)


def verdicts(rows: list[Row], copy_gbs: float | None) -> list[str]:
    """One line per target of the issue and measured shape: met / not met, with the measured numbers."""
    out = []
    # keyed by shape too: one op may run at several shapes in one run (the delta rule's --dr-seq sweep)
    by = {(r.op, r.shape, r.impl): r for r in rows if r.seconds is not None}

    def shapes(op):  # in run order
        return dict.fromkeys(r.shape for r in rows if r.op == op)

    for op in ("norm", "rotary", "swiglu"):
        for s in shapes(op):
            ours, comp = by.get((op, s, "triton (ours)")), by.get((op, s, "torch.compile"))
            if ours is None:
                continue
            parts = []
            if copy_gbs:
                frac = ours.extra["gbs"] / copy_gbs
                parts.append(f"{100 * frac:.0f}% of copy bandwidth (target >= 85%: {'met' if frac >= 0.85 else 'NOT met'})")
            if comp is not None:
                ratio = comp.seconds / ours.seconds
                parts.append(f"{ratio:.2f}x torch.compile's speed (target > 1: {'met' if ratio > 1 else 'NOT met'})")
            out.append(f"- {op}: " + "; ".join(parts or ["timed (no copy bandwidth or compile peer to compare)"]))
    for s in shapes("cross_entropy"):
        ours, plain = by.get(("cross_entropy", s, "triton (ours, chunked)")), by.get(
            ("cross_entropy", s, "plain (logits + F.cross_entropy)"))
        if ours is not None and plain is not None:
            t = ours.seconds / plain.seconds
            line = f"- cross_entropy: {t:.2f}x the plain path's time (target <= 1.1: {'met' if t <= 1.1 else 'NOT met'})"
            if ours.peak_mib is not None and plain.peak_mib:
                m = ours.peak_mib / plain.peak_mib
                line += f"; {100 * m:.0f}% of its peak memory (target <= 15%: {'met' if m <= 0.15 else 'NOT met'})"
            out.append(line)
    for s in shapes("conv"):
        ours, cc = by.get(("conv", s, "triton (ours)")), by.get(("conv", s, "causal-conv1d"))
        if ours is None:
            continue
        parts = []
        if copy_gbs and "gbs" in ours.extra:
            frac = ours.extra["gbs"] / copy_gbs
            parts.append(f"{100 * frac:.0f}% of copy bandwidth (target >= {100 * CONV_TARGET:.0f}%: "
                         f"{'met' if frac >= CONV_TARGET else 'NOT met'})")
        if cc is not None:
            parts.append(f"{cc.seconds / ours.seconds:.2f}x causal-conv1d's speed")
        out.append(f"- conv {s}: " + "; ".join(parts or ["timed (no copy bandwidth or causal-conv1d to compare)"]))
    dr = [r for r in rows if r.op == "delta_rule"]
    for s in shapes("delta_rule"):
        out.append(_delta_rule_verdict([r for r in dr if r.shape == s]))
    for s in shapes("grouped_gemm"):
        ours, dense = by.get(("grouped_gemm", s, GG_OURS)), by.get(("grouped_gemm", s, GG_DENSE))
        if ours is not None and dense is not None:  # same FLOPs: the rate ratio is the time ratio
            f = dense.seconds / ours.seconds
            line = (f"- grouped_gemm: ours at {100 * f:.0f}% of the dense matmul's TFLOP/s "
                    f"(target >= 80%: {'met' if f >= 0.8 else 'NOT met'})")
            mb = by.get(("grouped_gemm", s, GG_MEGABLOCKS))
            if mb is not None:
                line += f"; megablocks' gmm at {100 * dense.seconds / mb.seconds:.0f}%"
            out.append(line)
    for s in shapes("moe_layer"):
        ours, dense, fp32 = (by.get(("moe_layer", s, n)) for n in (ML_OURS, ML_DENSE, ML_FP32))
        if ours is not None and dense is not None:
            t = ours.seconds / dense.seconds
            line = (f"- moe_layer: {t:.2f}x the dense SwiGLU's time at the same active FLOPs "
                    f"(target <= {ML_TARGET}: {'met' if t <= ML_TARGET else 'NOT met'})")
            if fp32 is not None:
                line += f"; the fp32-expert path {fp32.seconds / ours.seconds:.2f}x ours"
            gathered = by.get(("moe_layer", s, ML_GATHER))
            if gathered is not None and gathered.seconds:
                line += (f"; rows gathered by the gate_up GEMM (model.moe.gather=gemm): "
                         f"{gathered.seconds / dense.seconds:.2f}x the dense's time, {ours.seconds / gathered.seconds:.2f}x "
                         f"ours' speed")
            out.append(line)
    return out + attention_verdicts(rows)


def _delta_rule_verdict(rows: list[Row]) -> str:
    """One shape's line: ours vs fla (not measured, and why, where either has no time)."""
    where = f"- delta_rule {rows[0].shape}"
    x = rows[0].extra
    if "seq" in x and not (x["head_dim"] == DR_HEAD_DIM and DR_SEQS[0] <= x["seq"] <= DR_SEQS[1]
                           and x.get("batch", 1) in DR_BATCHES):
        where += " (outside the target's head dim 128, sequences 4k-16k and batches 1, 4)"
    ours, fla, missing = _timed_pair(rows, DR_OURS, DR_FLA)
    if missing:
        return f"{where}: vs fla not measured ({missing})"
    t = ours.seconds / fla.seconds
    line = f"{where}: {t:.2f}x fla's time (target <= {DR_TARGET}: {'met' if t <= DR_TARGET else 'NOT met'})"
    if FLA_GUARD_LIFTED:
        line += " [fla timed with its Hopper guard lifted (chunk_o.IS_NVIDIA_HOPPER = False): see its max diff]"
    if ours.peak_mib is not None and fla.peak_mib:
        m = ours.peak_mib / fla.peak_mib
        line += f"; {m:.2f}x its peak memory (target <= 1: {'met' if m <= 1 else 'NOT met'})"
    return line


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--tokens", type=int, default=16384, help="rows (batch x sequence) for every op")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--ffn-hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rotary-fraction", type=float, default=0.25)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--ce-tokens", type=int, default=8192, help="rows for the loss (the plain path's logits are "
                                                                 "ce_tokens x vocab x (2 + 4 + 4) bytes)")
    ap.add_argument("--dr-seq", type=int, nargs="+", default=[4096, 8192, 16384],
                    help="sequence lengths of the delta rule (a verdict for each with each batch and --dr-docs)")
    ap.add_argument("--dr-batch", type=int, nargs="+", default=[1, 4], help="delta-rule sequences per call")
    ap.add_argument("--dr-docs", nargs="+", choices=["none", "packed"], default=["none", "packed"],
                    help="packed: the batch's tokens as one row of documents (cu_seqlens), see --dr-doc-len")
    ap.add_argument("--dr-doc-len", type=int, default=512, help="packed documents' mean length (uniform in "
                                                                "[1, 2 x this))")
    ap.add_argument("--dr-heads", type=int, default=16, help="delta-rule heads (q/k and v alike)")
    ap.add_argument("--dr-head-dim", type=int, default=128)
    ap.add_argument("--dr-chunk", type=int, default=64, choices=[16, 32, 64])
    ap.add_argument("--conv-seq", type=int, nargs="+", default=[4096, 8192],
                    help="sequence lengths of the short convolution (each with each --conv-batch, with and without "
                         "documents of --dr-doc-len)")
    ap.add_argument("--conv-batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--conv-dim", type=int, default=6144, help="conv channels: hybrid_1b's in_proj_qkv width "
                                                                "(q, k: 16 x 128 each; v: 16 x 128)")
    ap.add_argument("--conv-size", type=int, default=4)
    ap.add_argument("--moe-d-model", type=int, default=1024, help="model width of the moe_permute and "
                                                                   "grouped_gemm ops (the hybrid_moe preset's, not "
                                                                   "--d-model)")
    ap.add_argument("--moe-experts", type=int, default=32)
    ap.add_argument("--moe-top-k", type=int, default=4)
    ap.add_argument("--moe-hidden", type=int, default=768, help="expert hidden width (grouped_gemm rows: tokens "
                                                                 "x top_k)")
    ap.add_argument("--moe-shared", type=int, default=768, help="shared expert hidden width (moe_layer)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    ap.add_argument("--append", default=str(RESULTS), help="results file to append the table to")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if min(args.dr_batch + args.conv_batch) < 1 or args.dr_doc_len < 1:
        ap.error(f"--dr-batch {args.dr_batch}, --conv-batch {args.conv_batch} and --dr-doc-len {args.dr_doc_len} "
                 f"must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device is visible; timings need a GPU (--device cpu only exercises the script)")
    dtype = getattr(torch, args.dtype)
    ours = backend.triton_unavailable_reason(device) is None
    compile_peers = not args.no_compile
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth(device)
    rows: list[Row] = []
    # op -> its cases, built lazily (generators) so only one case's tensors are alive at a time
    builders = {
        "norm": lambda: [norm_case(args.tokens, args.d_model, dtype, device, compile_peers, ours),
                         gated_norm_case(args.tokens, args.dr_heads, args.dr_head_dim, dtype, device, compile_peers,
                                         ours)],
        "rotary": lambda: [rotary_case(args.tokens, args.heads, args.kv_heads, args.head_dim, args.rotary_fraction,
                                       dtype, device, compile_peers, ours)],
        "swiglu": lambda: [swiglu_case(args.tokens, args.ffn_hidden, dtype, device, compile_peers, ours)],
        "conv": lambda: (conv_case(t, args.conv_dim, args.conv_size, dtype, device, compile_peers, ours, batch=b,
                                   doc_len=args.dr_doc_len if docs == "packed" else None)
                         for t in args.conv_seq for b in args.conv_batch for docs in ("none", "packed")),
        "cross_entropy": lambda: [cross_entropy_case(args.ce_tokens, args.d_model, args.vocab, dtype, device,
                                                     compile_peers, ours)],
        "delta_rule": lambda: (delta_rule_case(t, args.dr_heads, args.dr_head_dim, args.dr_chunk, dtype, device,
                                               compile_peers, ours, batch=b,
                                               doc_len=args.dr_doc_len if docs == "packed" else None)
                               for t in args.dr_seq for b in args.dr_batch for docs in args.dr_docs),
        "moe_permute": lambda: [moe_permute_case(args.tokens, args.moe_d_model, args.moe_experts, args.moe_top_k,
                                                 dtype, device, compile_peers, ours)],
        "grouped_gemm": lambda: [grouped_gemm_case(args.tokens, args.moe_d_model, args.moe_experts, args.moe_top_k,
                                                   args.moe_hidden, dtype, device)],
        "moe_layer": lambda: [moe_layer_case(args.tokens, args.moe_d_model, args.moe_experts, args.moe_top_k,
                                             args.moe_hidden, args.moe_shared, dtype, device)],
    }
    for op in args.ops:
        if op == "attention":
            continue
        for case in builders[op]():
            if not ours:
                case.candidates.setdefault(case.ours,
                                           f"Triton cannot run here: {backend.triton_unavailable_reason(device)}")
            rows += run_case(case, device, args.repeats, args.warmup, copy_gbs)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    body = table(rows)
    if "attention" in args.ops and device.type == "cuda" and ours:
        from hybridtron.bench import kernels_attention

        att = kernels_attention.bench_attention(list(ATT_SEQS), list(ATT_HEAD_DIMS), 16, 4, ["none", "many"], 512,
                                                dtype, args.repeats, device, warmup=args.warmup)
        body += "\n\nGated attention (bench/kernels_attention.py), 16 query / 4 kv heads, one packed row:\n\n"
        body += kernels_attention.report(att)
        rows += att
    lines = verdicts(rows, copy_gbs)
    if "attention" in args.ops and not any(r.op == "attention" for r in rows):
        lines.append("- attention: vs SDPA-flash + gate not measured (needs CUDA and the Triton kernel; see "
                     "bench/kernels_attention.py)")
    bw = f"copy bandwidth {copy_gbs:,.0f} GB/s" if copy_gbs else "copy bandwidth not measured (no GPU)"
    versions = f"torch {torch.__version__}" + (f", triton {_triton_version()}" if backend.triton_installed() else "")
    header = f"Fused kernels, {device_name(device)}, {time.strftime('%Y-%m-%d')} ({versions}; {bw})"
    full = body + ("\n\n" + "\n".join(lines) if lines else "")
    print(header)
    print(full)
    if not args.no_append:
        cmd = "python -m hybridtron.bench.kernels" + ("" if argv is None else " " + " ".join(argv))
        append_results(Path(args.append), header, cmd, full)
        print(f"appended to {args.append}")
    return rows


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
