"""What the kernel benchmarks share: a result row, one timed forward + backward (CUDA events on a GPU), its peak
memory, and the attention target's verdict. bench/kernels.py (every op) and bench/kernels_attention.py (gated
attention against its peers) both build on it; neither imports the other's internals."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

ATT_OURS, ATT_SDPA_FLASH = "triton", "sdpa-flash+gate"  # the attention candidates the target compares
ATT_TARGET = 1.1  # ours at >= 1.1x SDPA-flash + gate's speed ...
ATT_HEAD_DIMS, ATT_SEQS = (128, 256), (4096, 8192)  # ... at these head dims, sequences in this range


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    seconds: float | None = None
    peak_mib: float | None = None
    max_err: float | None = None
    rate: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _fwd_bwd(fn, inputs, cotangents=None):
    """One forward + backward; returns outputs and input gradients (detached)."""
    leaves = [t for t in inputs if t.requires_grad]
    for t in leaves:
        t.grad = None
    outs = _tuple(fn(*inputs))
    cot = cotangents or [torch.ones_like(o) / o.numel() ** 0.5 for o in outs]
    torch.autograd.backward(outs, cot)
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _timed(fn, inputs, cot, device) -> float:
    for t in inputs:
        if t.requires_grad:
            t.grad = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.backward(_tuple(fn(*inputs)), cot)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    torch.autograd.backward(_tuple(fn(*inputs)), cot)
    return time.perf_counter() - t0


def _peak_mib(fn, inputs, cot, device) -> float | None:
    if device.type != "cuda":
        return None
    for t in inputs:
        if t.requires_grad:
            t.grad = None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    torch.autograd.backward(_tuple(fn(*inputs)), cot)
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _timed_pair(rows: list[Row], ours: str, peer: str) -> tuple[Row | None, Row | None, str]:
    """One shape's rows of ``ours`` and ``peer``, and why either has no time ("" when both were timed)."""
    by = {r.impl: r for r in rows}
    pair = by.get(ours), by.get(peer)
    missing = [f"{n}: {r.note if r else 'not run'}" for n, r in zip((ours, peer), pair, strict=True)
               if r is None or r.seconds is None]
    return *pair, "; ".join(missing)


def _attention_verdict(rows: list[Row]) -> str:
    x = rows[0].extra
    where = f"- attention seq {x['seq']}, head dim {x['head_dim']}, {'no documents' if x['docs'] == 'none' else 'documents'}"
    if not (x["head_dim"] in ATT_HEAD_DIMS and ATT_SEQS[0] <= x["seq"] <= ATT_SEQS[1]):
        where += " (outside the target's head dims 128/256 and sequences 4k-8k)"
    ours, sdpa, missing = _timed_pair(rows, ATT_OURS, ATT_SDPA_FLASH)
    if missing:
        return f"{where}: vs SDPA-flash + gate not measured ({missing})"
    s = sdpa.seconds / ours.seconds
    return f"{where}: {s:.2f}x SDPA-flash + gate's speed (target >= {ATT_TARGET}: {'met' if s >= ATT_TARGET else 'NOT met'})"


def attention_verdicts(rows: list[Row]) -> list[str]:
    """One line per (seq, head dim, documents) of the attention rows, in run order."""
    att = [r for r in rows if r.op == "attention"]
    return [_attention_verdict([r for r in att if r.shape == shape]) for shape in dict.fromkeys(r.shape for r in att)]
