"""Gated flash attention: the Triton kernel, run by Triton's interpreter on the CPU, against the pure-torch
reference at tiny and odd shapes (T = 1, lengths off the 16-row tiles, head dims that are not powers of
two, one document, many short ones, an empty one), for the output and the gradients of q, k, v and the gate;
the reference against an explicit float64 softmax; bad input; the backend switch; torch.compile; the model."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated (read at decoration)

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridtron.kernels import backend  # noqa: E402
from hybridtron.kernels.backend import BackendError  # noqa: E402
from hybridtron.kernels.gated_attention import (  # noqa: E402
    doc_bounds,
    gated_attention,
    gated_attention_reference,
)
from hybridtron.kernels.testing import assert_within_reference_error  # noqa: E402

from .helpers import lm_loss_and_grads  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not (backend.triton_installed() and backend.interpreter_requested()),
    reason="needs triton and TRITON_INTERPRET=1 (the dev extra installs triton)",
)


def _doc_ids(B: int, T: int, seed: int) -> torch.Tensor:
    """Rows of short documents of random lengths 1..8 (single-token documents included)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths = torch.randint(1, 9, (T,), generator=g)
        rows.append(torch.repeat_interleave(torch.arange(T), lengths)[:T])
    return torch.stack(rows)


# name: (B or None for a packed (N, H, D) q, T or N, H, KV, D, documents, gate)
CASES = {
    "T1_gqa": (2, 1, 2, 1, 16, None, "elementwise"),
    "one_doc_mha_headwise": (1, 50, 3, 3, 32, "one", "headwise"),
    "many_docs_odd_headdim": (2, 37, 4, 2, 24, "many", "elementwise"),
    "packed_cu_seqlens_empty_doc": (None, 45, 4, 1, 64, "cu", None),
    "tile_multiple_headwise": (3, 32, 2, 2, 16, "many", "headwise"),
    "rows_as_docs_d80": (2, 19, 4, 1, 80, None, "elementwise"),
    "d256": (1, 21, 2, 1, 256, "many", "elementwise"),
}
CU_SEQLENS = [0, 7, 7, 30, 31, 45]  # an empty and a one-token document


def _make(case: str, dtype: torch.dtype, seed: int = 0):
    B, T, H, KV, D, docs, gate = CASES[case]
    g = torch.Generator().manual_seed(seed)
    lead = (T,) if B is None else (B, T)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    # q scaled up so the softmax is peaked: large score ranges exercise the running max and the rescaling.
    q, k, v = rand(*lead, H, D, scale=2.0), rand(*lead, KV, D), rand(*lead, KV, D)
    gt = None if gate is None else rand(*lead, H, *(() if gate == "headwise" else (D,)), scale=2.0)
    kw = {}
    if docs == "cu":
        kw["cu_seqlens"] = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    elif docs == "one":
        kw["doc_ids"] = torch.full((B, T), 3)
    elif docs == "many":
        kw["doc_ids"] = _doc_ids(B, T, seed)
    dout = rand(*lead, H, D)
    return [q, k, v, gt], kw, dout


def _run(fn, inputs, kw, dout, dtype=None, **extra):
    """fn's output and the gradients of every non-None input, with inputs cast to ``dtype``."""
    xs = [None if t is None else t.to(dtype or t.dtype).detach().requires_grad_() for t in inputs]
    out = fn(*xs, **kw, **extra)
    leaves = [x for x in xs if x is not None]
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return [out, *grads]


@needs_interpreter
@pytest.mark.parametrize(
    "case,dtype",
    [(c, d) for c in CASES for d in (torch.float32, torch.bfloat16)] + [("many_docs_odd_headdim", torch.float16)],
    ids=lambda x: str(x).replace("torch.", ""),
)
def test_kernel_matches_reference(case, dtype):
    inputs, kw, dout = _make(case, dtype)
    got = _run(gated_attention, inputs, kw, dout, backend="triton")
    ref_d = _run(gated_attention_reference, inputs, kw, dout)
    ref64 = _run(gated_attention_reference, inputs, kw, dout, dtype=torch.float64)
    names = ["out", "dq", "dk", "dv", "dgate"][: len(got)]
    D = inputs[0].shape[-1]
    for name, a, r, r64 in zip(names, got, ref_d, ref64, strict=True):
        assert a.dtype == dtype
        # Floor: the rule's few ulps of the output dtype, plus ~4 sqrt(D) fp32 ulps for the fp32 dot products
        # over the head dim. That part matters in fp32 only: dS = P (dP - Delta) is exactly 0 for a token
        # alone in its document, so dq there is pure dP rounding (measured at D=256: 2.8e-6 where the CPU
        # reference, computing Delta and dP by identical arithmetic, gets exactly 0 and 4.2e-7 elsewhere).
        # A dq that is exactly 0 (T1_gqa: every token alone) has no scale of its own: there the kernel's error is
        # that fp32 rounding of dP - Delta (~|dout| |v| sqrt(D)) times |k| and the softmax scale.
        scale = r64.abs().max().item()
        cancel = (dout.abs().max() * inputs[1].abs().max() * inputs[2].abs().max()).item() * D**-0.5
        eps32 = torch.finfo(torch.float32).eps
        atol = 4 * scale * (torch.finfo(dtype).eps + D**0.5 * eps32) + 4 * D**0.5 * eps32 * cancel
        assert_within_reference_error(f"{case} {name}", a, r, r64, atol=atol)


@needs_interpreter
def test_tiles_of_other_documents_are_never_read():
    """Documents on tile boundaries (16-row tiles under the interpreter): the middle one is all NaN (q, k, v, gate
    and dout), and the other two must come out finite and right. A key tile of another document that the forward
    or dQ loop visited, or a query tile that dK/dV visited, even fully masked, would turn them NaN (0 * NaN)."""
    N, H, KV, D = 96, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(N, n, D, generator=g) for n in (H, KV, KV))
    gate, dout = torch.randn(N, H, D, generator=g), torch.randn(N, H, D, generator=g)
    cu = torch.tensor([0, 32, 64, 96], dtype=torch.int32)
    mid = slice(32, 64)
    poisoned = [t.clone() for t in (q, k, v, gate, dout)]
    for t in poisoned:
        t[mid] = float("nan")
    got = _run(gated_attention, poisoned[:4], {"cu_seqlens": cu}, poisoned[4], backend="triton")
    ref = _run(gated_attention_reference, [q, k, v, gate], {"cu_seqlens": cu}, dout, dtype=torch.float64)
    keep = torch.cat([torch.arange(32), torch.arange(64, 96)])
    for name, a, r in zip(["out", "dq", "dk", "dv", "dgate"], got, ref, strict=True):
        assert torch.isfinite(a[keep]).all(), f"{name}: a tile of the NaN document was read"
        torch.testing.assert_close(a[keep].double(), r[keep], rtol=1e-4, atol=1e-5, msg=name)
        assert torch.isnan(a[mid]).any(), name  # the poison is real: the middle document's own results are NaN


@needs_interpreter
@pytest.mark.parametrize("split", [1, 2])
def test_dkdv_split_over_query_heads(split, monkeypatch):
    """The dK/dV kernel with one program per kv head (its loop over the 4 query heads of the group) and with
    two (fp32 partial sums added after): the same gradients as the reference. (The interpreter's default is a
    program per query head, which the other tests run.)"""
    from hybridtron.kernels.gated_attention import triton_kernels

    monkeypatch.setattr(triton_kernels, "dkdv_split", lambda *a: split)
    inputs, kw, dout = _make("packed_cu_seqlens_empty_doc", torch.float32)
    got = _run(gated_attention, inputs, kw, dout, backend="triton")
    ref_d = _run(gated_attention_reference, inputs, kw, dout)
    ref64 = _run(gated_attention_reference, inputs, kw, dout, dtype=torch.float64)
    for name, a, r, r64 in zip(["out", "dq", "dk", "dv"], got, ref_d, ref64, strict=True):
        atol = 4 * r64.abs().max().item() * 8 * torch.finfo(torch.float32).eps  # sqrt(D) = 8 fp32 ulps
        assert_within_reference_error(f"split {split} {name}", a, r, r64, atol=atol)


@needs_interpreter
@pytest.mark.parametrize("case", ["many_docs_odd_headdim", "packed_cu_seqlens_empty_doc"])
def test_kernel_without_tma_matches_reference(case, monkeypatch):
    """The pointer loads the kernels fall back to where tensor descriptors are unavailable (before Hopper, or
    misaligned K/V); the other tests take the descriptor path (the interpreter runs it)."""
    from hybridtron.kernels.gated_attention import triton_kernels

    inputs, kw, dout = _make(case, torch.bfloat16)
    assert triton_kernels.use_tma(inputs[1], inputs[2])
    monkeypatch.setattr(triton_kernels, "TMA", False)
    assert not triton_kernels.use_tma(inputs[1], inputs[2])
    got = _run(gated_attention, inputs, kw, dout, backend="triton")
    ref_d = _run(gated_attention_reference, inputs, kw, dout)
    ref64 = _run(gated_attention_reference, inputs, kw, dout, dtype=torch.float64)
    for name, a, r, r64 in zip(["out", "dq", "dk", "dv", "dgate"][: len(got)], got, ref_d, ref64, strict=True):
        assert_within_reference_error(f"no TMA {case} {name}", a, r, r64)


def test_tma_needs_16_byte_rows():
    pytest.importorskip("triton")
    from hybridtron.kernels.gated_attention.triton_kernels import use_tma

    kv = torch.zeros(8, 2, 16, dtype=torch.bfloat16)  # rows of 64 bytes, heads of 32
    assert use_tma(kv, kv)
    narrow = torch.zeros(8, 1, 4, dtype=torch.bfloat16)  # rows of 8 bytes: TMA cannot step them
    assert not use_tma(narrow, narrow)
    assert not use_tma(kv, kv[:, :, 2:])  # a view 4 bytes into its rows: base address not 16-byte aligned


def test_tile_orders_put_the_longest_tiles_first():
    """Two batch rows of 64 tokens in 32-row super-tiles: query tiles ending a row see 64 keys, the others 32;
    key tiles starting a row are seen by 64 queries. Heaviest first, ties in index order."""
    pytest.importorskip("triton")
    from hybridtron.kernels.gated_attention.triton_kernels import tile_orders

    start, end = doc_bounds(2, 64)
    q_order, k_order = tile_orders(start, end, 32)
    assert q_order.tolist() == [1, 3, 0, 2] and k_order.tolist() == [0, 2, 1, 3]
    start, end = doc_bounds(1, 80, cu_seqlens=torch.tensor([0, 10, 80]))  # a short last super-tile (16 rows)
    q_order, k_order = tile_orders(start, end, 32)
    # query work: [0,32) 32 - 0 = 32, [32,64) 64 - 10 = 54, [64,80) 80 - 10 = 70; key work: 80, 48, 16
    assert q_order.tolist() == [2, 1, 0] and k_order.tolist() == [0, 1, 2]
    assert q_order.dtype == torch.int32


def _dense_reference64(q, k, v, gate, start):
    """float64 softmax with the block-diagonal causal mask built explicitly (N x N: tests only)."""
    N, H, D = q.shape
    kv = torch.arange(H) // (H // k.shape[1])
    s = torch.einsum("nhd,mhd->hnm", q, k[:, kv]) / D**0.5
    idx = torch.arange(N)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[None, :] >= start[:, None].long())
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.einsum("hnm,mhd->nhd", p, v[:, kv])
    return out * torch.sigmoid(gate)


def test_reference_matches_explicit_softmax():
    """The reference (per-document SDPA) against a masked softmax written out, for doc_ids and cu_seqlens."""
    inputs, kw, _ = _make("many_docs_odd_headdim", torch.float64)
    B, T = 2, 37
    flat = [t.reshape(B * T, *t.shape[2:]) for t in inputs]
    start, end = doc_bounds(B, T, doc_ids=kw["doc_ids"])
    expected = _dense_reference64(*flat, start)
    got = gated_attention_reference(*inputs, **kw).reshape(B * T, *inputs[0].shape[2:])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    # the same documents given as cu_seqlens over the flattened tokens, q packed to (N, H, D)
    cu = torch.cat([(start == torch.arange(B * T)).nonzero().flatten(), torch.tensor([B * T])])
    got_cu = gated_attention_reference(*flat, cu_seqlens=cu)
    torch.testing.assert_close(got_cu, expected, rtol=1e-10, atol=1e-12)
    # and documents matter: without them the result is different
    assert (gated_attention_reference(*inputs) - got.view_as(inputs[0])).abs().max() > 1e-2


def test_doc_bounds():
    start, end = doc_bounds(2, 3, doc_ids=torch.tensor([[4, 4, 9], [1, 1, 1]]))
    assert start.tolist() == [0, 0, 2, 3, 3, 3] and end.tolist() == [2, 2, 3, 6, 6, 6]
    start, end = doc_bounds(1, 6, cu_seqlens=torch.tensor([0, 2, 2, 3, 6]))  # an empty document is skipped
    assert start.tolist() == [0, 0, 2, 3, 3, 3] and end.tolist() == [2, 2, 3, 6, 6, 6]
    start, end = doc_bounds(2, 2)  # no documents: each row is one
    assert start.tolist() == [0, 0, 2, 2] and end.tolist() == [2, 2, 4, 4]
    # a document id that recurs after another one is a new document (ids are runs, not labels)
    start, _ = doc_bounds(1, 4, doc_ids=torch.tensor([[0, 1, 0, 0]]))
    assert start.tolist() == [0, 1, 2, 2]


def _qkv(B=1, T=5, H=2, KV=1, D=16, dtype=torch.float32):
    return torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, T, KV, D, dtype=dtype), torch.randn(B, T, KV, D, dtype=dtype)


@pytest.mark.parametrize("which", ["reference", "triton"])
def test_bad_input_is_named(which):
    if which == "triton" and not (backend.triton_installed() and backend.interpreter_requested()):
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    q, k, v = _qkv()
    call = lambda *a, **kw: gated_attention(*a, backend=which, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"end at the number of tokens N=5"):
        call(q, k, v, cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"start at 0, never decrease.*1 decreasing"):
        call(q, k, v, cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        call(q, k, v, cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match=r"gate has shape \(1, 5, 2, 8\)"):
        call(q, k, v, torch.randn(1, 5, 2, 8))
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
        call(torch.randn(1, 5, 3, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16))
    with pytest.raises(ValueError, match=r"doc_ids has shape \(1, 4\)"):
        call(q, k, v, doc_ids=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="not both"):
        call(q, k, v, doc_ids=torch.zeros(1, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"k and v must be q's shape"):
        call(q, k, v[:, :4])


@needs_interpreter
def test_kernel_refuses_dtype_and_head_dim():
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"one dtype of float16, bfloat16, float32.*backend='reference'"):
        gated_attention(q, k, v, backend="triton")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"got q torch.float32, k torch.bfloat16"):
        gated_attention(q, k.bfloat16(), v, backend="triton")
    q, k, v = _qkv(D=272)
    with pytest.raises(ValueError, match=r"head_dim=272 is above the kernel's maximum 256"):
        gated_attention(q, k, v, backend="triton")


def test_backends_that_cannot_run_are_refused(no_interpreter):
    q, k, v = _qkv()
    with pytest.raises(BackendError, match="flash-attn runs on CUDA GPUs only"):
        gated_attention(q, k, v, backend="flash-attn")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        gated_attention(q, k, v, backend="triton")
    # auto on the CPU is the reference, whatever is installed
    torch.testing.assert_close(gated_attention(q, k, v), gated_attention_reference(q, k, v))


@needs_interpreter
@pytest.mark.parametrize("docs", ["doc_ids", "cu_seqlens"])
def test_compiles_without_graph_breaks(docs):
    """fullgraph=True fails on any graph break; the compiled forward and backward run the same kernels."""
    inputs, kw, dout = _make("many_docs_odd_headdim", torch.float32)
    if docs == "cu_seqlens":
        start, _ = doc_bounds(2, 37, doc_ids=kw.pop("doc_ids"))
        kw["cu_seqlens"] = torch.cat([(start == torch.arange(74)).nonzero().flatten(), torch.tensor([74])])
    torch._dynamo.reset()

    def fn(q, k, v, g, **kw):
        return gated_attention(q, k, v, g, backend="triton", **kw)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager = _run(fn, inputs, kw, dout)
    got = _run(compiled, inputs, kw, dout)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autotune_tables_cover_every_dtype_and_head_dim_within_shared_memory():
    """The GPU's autotune tables, without compiling: every dtype and head dim the op accepts has candidates; the
    pruner hands the autotuner exactly its (dtype, head-dim block) row (fp16 shares bf16's, fp32 has its own); the
    tiles divide the 128-row launch-order super-tiles; and each candidate's shared-memory bound is under an H100
    block's limit. (Registers and spills need ptxas: the slow sm_90a compile test and bench/compile_report.py.)"""
    from hybridtron.kernels.gated_attention import triton_kernels as tk
    from hybridtron.kernels.gated_attention.op import KERNEL_DTYPES, MAX_HEAD_DIM

    block_ds = sorted({max(16, 1 << (d - 1).bit_length()) for d in range(1, MAX_HEAD_DIM + 1)})
    keys = {tk.table_key(torch.empty(0, dtype=dt), bd) for dt in KERNEL_DTYPES for bd in block_ds}
    assert keys == {(e, d) for e in (2, 4) for d in (64, 128, 256)}
    for name, table in tk.TABLES.items():
        assert set(table) == keys, name
        every = [tk._cfg(*row) for row in sorted({row for rows in table.values() for row in rows})]
        prune = tk._pruner(table)
        for dt in KERNEL_DTYPES:
            for bd in block_ds:
                key = tk.table_key(torch.empty(0, dtype=dt), bd)
                kept = prune(every, {"Q": torch.empty(0, dtype=dt)}, BLOCK_D=bd)
                got = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}
                assert got == set(table[key]) and len(kept) == len(table[key]), (name, dt, bd)
        for (elem, block_d), rows in table.items():
            assert rows and len(set(rows)) == len(rows), (name, elem, block_d)
            for row in rows:
                bm, bn, warps, stages = row
                assert 128 % bm == 0 and 128 % bn == 0 and bm >= 16 and bn >= 16, (name, row)
                assert warps in (4, 8) and 1 <= stages <= 4, (name, row)
                need = tk.shared_bytes(name, row, block_d, elem)
                assert need <= tk.SHARED_LIMIT, f"{name} {elem}-byte D{block_d} {row}: up to {need} B of shared memory"


# What triton 3.7.1 allocated for sm_90a (bench/compile_report.py, 2026-11-25): (kernel, row, block_d, operand
# bytes, shared bytes), the candidates closest to the bound among those compiled, and the fp32 ones that were over
# the limit (pruned since).
_SHARED_COMPILED = [
    ("dq", (64, 32, 8, 3), 256, 2, 164864),
    ("dq", (64, 32, 8, 3), 256, 4, 327696),
    ("dq", (128, 64, 8, 2), 128, 4, 262152),
    ("fwd", (64, 64, 8, 2), 256, 2, 164864),
    ("fwd", (128, 128, 8, 2), 128, 4, 262168),
    ("fwd", (128, 64, 8, 4), 64, 4, 163904),
    ("dkdv", (16, 128, 8, 3), 128, 2, 90368),
    ("dkdv", (32, 128, 8, 1), 128, 4, 180224),
    ("dkdv", (64, 32, 8, 1), 256, 2, 131072),
]


@pytest.mark.parametrize("kernel,row,block_d,elem,compiled", _SHARED_COMPILED)
def test_shared_memory_bound_covers_what_triton_allocated(kernel, row, block_d, elem, compiled):
    from hybridtron.kernels.gated_attention.triton_kernels import shared_bytes

    assert compiled <= shared_bytes(kernel, row, block_d, elem) <= 2 * compiled


# Compiles gated attention's kernels for an H100 (bench/compile_report.py's stand-in driver: triton's bundled
# ptxas, no GPU), every autotune candidate the pruner keeps, at head dims 128 and 256, bf16, elementwise gate.
_COMPILE_SM90 = """
import json, sys, torch
from hybridtron.bench.compile_report import compile_only
from hybridtron.kernels.gated_attention import gated_attention
sink, label = {}, ["attention"]
with compile_only("90a", sink, label):
    for D in (128, 256):
        q, k, v = (torch.empty(1, 256, n, D, dtype=torch.bfloat16, requires_grad=True) for n in (4, 1, 1))
        gate = torch.empty(1, 256, 4, D, dtype=torch.bfloat16, requires_grad=True)
        docs = torch.cumsum(torch.rand(1, 256) < 0.05, 1)
        out = gated_attention(q, k, v, gate, doc_ids=docs, backend="triton")
        out.backward(torch.empty_like(out))
json.dump([dict(name=k.name, params=k.params, warps=k.warps, stages=k.stages, local=k.local, shared=k.shared,
                over=k.over_shared, hgmma=k.ops["HGMMA"], hmma=k.ops["HMMA"]) for k in sink.values()], sys.stdout)
"""


@pytest.mark.slow
def test_autotune_candidates_compile_for_sm90_without_spills():
    """Every candidate config the GPU's autotuner may pick, at head dims 128 and 256: no register spills (stack
    frame 0), within an H100 block's shared memory, and the dot products on warpgroup MMA (HGMMA), except dK/dV
    at 256 on mma.sync (HMMA; why: the tables' comment in triton_kernels.py). A spilling or oversized candidate
    would be timed (or refused) on the GPU; one added to a table must pass this."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = json.loads(proc.stdout)
    tuned = {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
    seen = {(k["name"], k["params"]["BLOCK_D"]) for k in kernels}
    assert seen >= {(n, d) for n in tuned for d in (128, 256)}, seen
    for k in kernels:
        what = f"{k['name']} D{k['params']['BLOCK_D']} {k['params'].get('BLOCK_M')}x{k['params'].get('BLOCK_N')} " \
               f"{k['warps']} warps {k['stages']} stages"
        assert k["local"] == 0, f"{what}: spills ({k['local']} B of stack a thread)"
        assert not k["over"], f"{what}: {k['shared']} B of shared memory, over an H100 block's"
        if k["name"] == "_bwd_dkdv_kernel" and k["params"]["BLOCK_D"] == 256:
            assert k["hmma"] > 0, f"{what}: no tensor-core MMA"
        elif k["name"] in tuned:
            assert k["hgmma"] > 0, f"{what}: no warpgroup MMA"


# ---------------------------------------------------------------------------------------------------------
# the model


def _lm_loss_and_grads(attention: str, gate: str, doc_ids: torch.Tensor | None):
    from hybridtron.configs import load_config
    from hybridtron.model import GatedLM

    cfg = load_config("tiny", [("model.kernels.attention", attention), ("model.attn_gate", gate),
                               ("model.n_layers", "2"), ("model.d_model", "64")]).model
    torch.manual_seed(0)
    model = GatedLM(cfg, 97)
    model.init_weights()
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    return lm_loss_and_grads(model, ids, ids, doc_ids)


def test_doc_ids_from_mask_inverts_doc_causal_mask():
    from hybridtron.model.attention import doc_causal_mask, doc_ids_from_mask

    ids = torch.tensor([[5, 5, 2, 2, 2, 7], [0, 1, 2, 3, 3, 3]])
    back = doc_ids_from_mask(doc_causal_mask(ids))
    assert back.tolist() == [[1, 1, 2, 2, 2, 3], [1, 2, 3, 4, 4, 4]]
    assert torch.equal(doc_causal_mask(back), doc_causal_mask(ids))


@needs_interpreter
@pytest.mark.parametrize("gate", ["elementwise", "headwise", "none"])
def test_model_triton_backend_matches_reference(gate):
    """model.kernels.attention=triton changes nothing but how attention is computed: same parameters, same
    loss and gradients (fp32) as the SDPA path, with packed documents; and the documents reach the kernel."""
    doc_ids = torch.tensor([[0] * 4 + [1] * 17, [0] * 10 + [1] + [2] * 10])
    ref_loss, ref_grads = _lm_loss_and_grads("reference", gate, doc_ids)
    loss, grads = _lm_loss_and_grads("triton", gate, doc_ids)
    assert grads.keys() == ref_grads.keys()
    torch.testing.assert_close(loss, ref_loss)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")
    no_docs_loss, _ = _lm_loss_and_grads("triton", gate, None)
    assert (no_docs_loss - loss).abs() > 1e-4
