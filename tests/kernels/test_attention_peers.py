"""The attention backends beside our Triton kernel (torch SDPA, flex attention) and the fused sigmoid gate they
share, against the float64 reference (`gated_attention_reference` on double inputs) with the accuracy rule of
kernels/testing.py: outputs and gradients, at tiny and odd shapes (T = 37, D = 24, H = 3), MHA and GQA 4:2 /
4:1, no gate / per head / elementwise, without documents, doc_ids rows and packed cu_seqlens (a document
crossing the batch split included). flex runs forward only on the CPU (its backward is refused, by us first);
its block mask is compared block for block with torch's create_block_mask, and its cache with builds counted."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated (read at decoration)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from hybridtron.kernels import backend  # noqa: E402
from hybridtron.kernels.backend import BackendError  # noqa: E402
from hybridtron.kernels.gated_attention import flex, gate  # noqa: E402
from hybridtron.kernels.gated_attention.flex import document_block_mask, flex_gated_attention  # noqa: E402
from hybridtron.kernels.gated_attention.gate import sigmoid_gate  # noqa: E402
from hybridtron.kernels.gated_attention.reference import (  # noqa: E402
    apply_gate,
    doc_bounds,
    gated_attention_reference,
)
from hybridtron.kernels.gated_attention.sdpa import sdpa_gated_attention  # noqa: E402
from hybridtron.kernels.testing import reference_errors  # noqa: E402

from .helpers import assert_compiled_matches_eager, check_against_reference  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not (backend.triton_installed() and backend.interpreter_requested()),
    reason="needs triton and TRITON_INTERPRET=1 (the dev extra installs triton)",
)
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------- the gate kernel

@needs_interpreter
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["elementwise", "headwise"])
def test_gate_kernel_matches_reference(kind, dtype):
    g = torch.Generator().manual_seed(1)
    attn = torch.randn(2, 37, 3, 24, generator=g, dtype=torch.float64)
    # gate spread over +-8: sigmoid near 0 and 1 too, where s (1 - s) cancels
    gt = torch.randn(*((2, 37, 3, 24) if kind == "elementwise" else (2, 37, 3)), generator=g, dtype=torch.float64) * 4
    check_against_reference(f"gate {kind} {dtype}", sigmoid_gate, apply_gate, [attn, gt], [DT[dtype]] * 2)


@needs_interpreter
def test_gate_kernel_runs_and_keeps_each_inputs_dtype(monkeypatch):
    """The Triton path is the one taken (the launcher is reached), the output is in attn's dtype and each
    gradient in its input's; a mixed bf16 attn / fp32 gate still matches the formula."""
    from hybridtron.kernels.gated_attention import gate_kernels

    launched = []
    real = gate_kernels.gate_fwd
    monkeypatch.setattr(gate_kernels, "gate_fwd", lambda *a: launched.append(1) or real(*a))
    attn = torch.randn(5, 3, 24, dtype=torch.bfloat16, requires_grad=True)
    gt = torch.randn(5, 3, dtype=torch.float32, requires_grad=True)
    out = sigmoid_gate(attn, gt)
    assert launched and out.dtype == torch.bfloat16
    da, dg = torch.autograd.grad(out, (attn, gt), torch.ones_like(out))
    assert da.dtype == torch.bfloat16 and dg.dtype == torch.float32
    a64, g64 = attn.detach().double(), gt.detach().double()
    s = torch.sigmoid(g64)
    # one bf16 ulp (2^-7 relative at most), not half: triton 3.7.1's interpreter casts fp32 to bf16 by
    # truncation (round toward zero), the GPU to nearest even
    torch.testing.assert_close(out.double(), a64 * s[..., None], rtol=2**-7, atol=0)
    torch.testing.assert_close(dg.double(), (a64.sum(-1) * s * (1 - s)), rtol=1e-5, atol=1e-6)


def test_gate_falls_back_to_the_reference_without_triton(monkeypatch):
    """Where Triton cannot run, reference.apply_gate computes the same (and the kernels are not imported)."""
    monkeypatch.setattr(backend, "triton_unavailable_reason", lambda device=None, **_: "no triton here")
    monkeypatch.setattr(gate.SigmoidGateFunction, "apply", lambda *a: pytest.fail("the Triton path was taken"))
    attn, gt = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    torch.testing.assert_close(sigmoid_gate(attn, gt), apply_gate(attn, gt))
    assert sigmoid_gate(attn, None) is attn


@needs_interpreter
def test_gate_ops_pass_opcheck():
    """Schema, fake implementations and AOT dispatch of both custom ops (what torch.compile relies on)."""
    attn, gt = torch.randn(6, 24), torch.randn(6)
    torch.library.opcheck(torch.ops.hybridtron.sigmoid_gate_fwd.default, (attn, gt))
    torch.library.opcheck(torch.ops.hybridtron.sigmoid_gate_bwd.default, (torch.randn(6, 24), attn, gt))
    torch.library.opcheck(torch.ops.hybridtron.sigmoid_gate_bwd.default, (attn, attn, torch.randn(6, 24)))


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_gate_bad_input_is_named(bad):
    attn = torch.randn(2, 3, 8)
    gt = torch.randn(2, 4) if bad == "shape" else torch.ones(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(2, 3, 8\) \(elementwise\) or \(2, 3\)" if bad == "shape" else "int32"):
        sigmoid_gate(attn, gt)


# ------------------------------------------------------------------------------------------ SDPA and flex cases

HEADS = {"mha": (4, 4), "gqa42": (4, 2), "gqa41": (4, 1)}
LAYOUTS = ("none", "doc_ids", "cu_seqlens", "cu_across_rows")
GATES = (None, "headwise", "elementwise")
# Every layout with every head grouping; the gate kinds rotate so each meets each layout and each grouping.
CASES = [(lay, heads, GATES[(i + j) % 3]) for i, lay in enumerate(LAYOUTS) for j, heads in enumerate(HEADS)]
CU_SEQLENS = [0, 7, 7, 30, 31, 45]  # an empty and a one-token document
CU_ACROSS = [0, 15, 27, 40]  # over a (2, 20) batch: the second document crosses the split of the rows


def _case(layout: str, heads: str, gate_kind: str | None, seed: int = 0):
    """float64 inputs [q, k, v(, gate)] and the document keywords."""
    H, KV = HEADS[heads]
    D = 24
    g = torch.Generator().manual_seed(seed)
    lead = {"none": (2, 37), "doc_ids": (2, 37), "cu_seqlens": (45,), "cu_across_rows": (2, 20)}[layout]
    # q scaled up so the softmax is peaked (large score ranges); the gate over +-4
    q = torch.randn(*lead, H, D, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(*lead, KV, D, generator=g, dtype=torch.float64) for _ in range(2))
    inputs = [q, k, v]
    if gate_kind is not None:
        inputs.append(torch.randn(*lead, H, *((D,) if gate_kind == "elementwise" else ()), generator=g,
                                  dtype=torch.float64) * 2)
    kw: dict = {}
    if layout == "doc_ids":  # runs of random lengths 1..12, single-token documents included
        lengths = torch.randint(1, 13, (2, 37), generator=g)
        kw["doc_ids"] = torch.stack([torch.repeat_interleave(torch.arange(37), n)[:37] for n in lengths])
    elif layout == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    elif layout == "cu_across_rows":
        kw["cu_seqlens"] = torch.tensor(CU_ACROSS, dtype=torch.int64)
        kw["scale"] = 0.3  # and a scale of the caller's
    return inputs, kw


def _bind(fn, kw):
    def call(q, k, v, gt=None):
        return fn(q, k, v, gt, **kw)
    return call


def _ids(case):
    return "-".join(str(c) for c in case)


# fp32 floor: torch's CPU flash kernel runs a document-masked row of 37 keys in key blocks, rescaling its running
# softmax, where the per-document reference (documents of <= 12 tokens) takes one block: measured up to 8.3e-6 in
# dk (the reference's own error 1.7e-6, the rule's 4-ulp floor 1.8e-6). 1e-5 is the attention tuner's floor too
# (kernels/tune_cases.py, flash-attention's); a wrong mask, grouping or gate errs by 1e-1 and more.
ATOL = {"fp32": 1e-5, "bf16": None}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_sdpa_matches_reference(case, dtype):
    inputs, kw = _case(*case)
    errors = reference_errors(f"sdpa {_ids(case)} {dtype}", _bind(sdpa_gated_attention, kw),
                              _bind(gated_attention_reference, kw), inputs, [DT[dtype]] * len(inputs), atol=ATOL[dtype])
    assert not errors, "; ".join(errors)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_flex_forward_matches_reference(case, dtype):
    inputs, kw = _case(*case)
    errors = reference_errors(f"flex {_ids(case)} {dtype}", _bind(flex_gated_attention, kw),
                              _bind(gated_attention_reference, kw), inputs, [DT[dtype]] * len(inputs), grad=False)
    assert not errors, "; ".join(errors)


def test_flex_backward_on_the_cpu_is_refused_first():
    inputs, kw = _case("doc_ids", "gqa42", "headwise")
    q, k, v, gt = (t.float() for t in inputs)
    with pytest.raises(BackendError, match="backward needs CUDA.*attention=reference"):
        flex_gated_attention(q, k.requires_grad_(), v, gt, **kw)
    with torch.no_grad():  # evaluation: fine, leaves requiring grad or not
        flex_gated_attention(q.requires_grad_(), k, v, gt, **kw)
    gt.requires_grad_()  # only the gate's gradient: our kernel's backward, not flex's
    out = flex_gated_attention(q.detach(), k.detach(), v, gt, **kw)
    (dg,) = torch.autograd.grad(out.sum(), gt)
    assert torch.isfinite(dg).all() and dg.abs().sum() > 0


@pytest.mark.parametrize("fn", [sdpa_gated_attention, flex_gated_attention], ids=["sdpa", "flex"])
def test_bad_input_is_named(fn):
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match="share one dtype; got q torch.float32, k torch.bfloat16"):
        fn(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        fn(q, torch.randn(1, 5, 3, 8), torch.randn(1, 5, 3, 8))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        fn(q, k, v, cu_seqlens=torch.tensor([0, 3, 4]))


# ------------------------------------------------------------------------------------------- flex's block mask

BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("T,block,p_new", [(37, 8, 0.05), (64, 8, 0.02), (100, 16, 0.01), (96, 8, 0.0), (45, 128, 0.1),
                                           (1, 8, 0.0)])
@pytest.mark.parametrize("with_docs", [True, False], ids=["docs", "causal"])
def test_block_mask_equals_create_block_mask(T, block, p_new, with_docs):
    """Built from document bounds, the same partial and full blocks (and their order) as torch's
    create_block_mask evaluating the mask_mod on the whole grid: long documents give full blocks, short ones
    partial, T off the block size a short last block."""
    g = torch.Generator().manual_seed(T)
    ids = torch.cumsum(torch.rand(3, T, generator=g) < p_new, 1)
    start, _ = doc_bounds(3, T, doc_ids=ids)
    docs = start.view(3, T) if with_docs else None
    ours = document_block_mask(docs, 3, T, "cpu", block=block)

    def mask_mod(b, h, q_idx, kv_idx):
        same = (start.view(3, T)[b, q_idx] == start.view(3, T)[b, kv_idx]) if with_docs else True
        return (kv_idx <= q_idx) & same

    theirs = create_block_mask(mask_mod, 3 if with_docs else None, None, T, T, device="cpu", BLOCK_SIZE=block)
    for f in BLOCK_FIELDS:
        assert torch.equal(getattr(ours, f), getattr(theirs, f)), f
    if T >= 4 * block:
        assert ours.full_kv_num_blocks.sum() > 0 and ours.kv_num_blocks.sum() > 0  # both kinds exercised
    # and its mask_mod is the mask: on every (q, kv) pair
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for b in range(3 if with_docs else 1):
        want = (ki <= qi) & ((start.view(3, T)[b][:, None] == start.view(3, T)[b][None, :]) if with_docs else True)
        assert torch.equal(ours.mask_mod(torch.tensor(b), torch.tensor(0), qi, ki), want)


def test_block_mask_is_built_once_per_layout(monkeypatch):
    builds = []
    real = flex.document_block_mask
    monkeypatch.setattr(flex, "document_block_mask", lambda *a, **k: builds.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(flex, "_last", {})
    inputs, kw = _case("doc_ids", "gqa42", None)
    q, k, v = (t.float() for t in inputs)
    ids = kw["doc_ids"]
    ref = gated_attention_reference(q, k, v, doc_ids=ids)
    for _ in range(3):  # the layers of one forward: one build
        torch.testing.assert_close(flex_gated_attention(q, k, v, doc_ids=ids), ref)
    assert builds == [(2, 37)]
    flex_gated_attention(q, k, v, doc_ids=ids.clone())  # another tensor (the next batch), equal or not
    assert len(builds) == 2
    ids2 = ids.clone()
    flex_gated_attention(q, k, v, doc_ids=ids2)
    ids2[:, 20:] = 99  # written in place: its version moves on, the mask is rebuilt and right
    torch.testing.assert_close(flex_gated_attention(q, k, v, doc_ids=ids2),
                               gated_attention_reference(q, k, v, doc_ids=ids2))
    assert len(builds) == 4
    flex_gated_attention(q, k, v)  # no documents: the causal mask, reused while B and T stay
    flex_gated_attention(q, k, v)
    flex_gated_attention(q[:, :30], k[:, :30], v[:, :30])
    assert builds[4:] == [(2, 37), (2, 30)]


def test_compile_without_graph_breaks():
    """Both backends inside a model's torch.compile(fullgraph=True) (aot_eager): SDPA with its gradients, flex
    forward (no gradients on the CPU); the block mask is then built in the graph, the gate's ops traced opaque."""
    inputs, kw = _case("doc_ids", "gqa42", "headwise")
    q, k, v, gt = (t.float()[:, :16].contiguous() for t in inputs)
    ids = kw["doc_ids"][:, :16]
    assert_compiled_matches_eager(lambda *a: sdpa_gated_attention(*a, doc_ids=ids), q.requires_grad_(),
                                  k.requires_grad_(), v.requires_grad_(), gt.requires_grad_())
    with torch.no_grad():
        f = lambda *a: flex_gated_attention(*a, doc_ids=ids)  # noqa: E731
        torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, gt), f(q, k, v, gt))
