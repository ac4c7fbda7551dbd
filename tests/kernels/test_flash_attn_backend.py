"""The flash-attn backend of gated_attention (op.py's `_flash_attn`) run on the CPU: a stub ``flash_attn``
package in pure torch (causal attention per document, flash-attn's signatures and input rules) stands in for
the CUDA kernels, and the device check sees CUDA. Checks the path our op takes (dense 4-D, or varlen with
the cu_seqlens it builds from doc_ids), its outputs and gradients against the reference with the gate, and
its refusals."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from hybridtron.kernels import backend
from hybridtron.kernels.backend import BackendError
from hybridtron.kernels.gated_attention import doc_bounds, gated_attention, gated_attention_reference
from hybridtron.kernels.testing import assert_within_reference_error


def _attend(q, k, v, scale):
    """(L, H, D) queries, (L, KV, D) keys/values of one sequence: causal softmax attention in fp32."""
    L, H = q.shape[:2]
    k, v = (t.float().repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)


def _flash_rules(q, k, v, dropout_p, causal):
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, "flash-attn: fp16/bf16 only"
    assert q.shape[-2] % k.shape[-2] == 0 and dropout_p == 0.0 and causal


def _stub():
    mod = types.ModuleType("flash_attn")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # what find_spec (flash_attn_installed) reads
    mod.calls = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        _flash_rules(q, k, v, dropout_p, causal)
        assert q.dim() == 4
        mod.calls.append(("func", None, None))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return torch.stack([_attend(q[b], k[b], v[b], scale) for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        _flash_rules(q, k, v, dropout_p, causal)
        assert q.dim() == 3 and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32  # as flash-attn requires
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
        cu = cu_seqlens_q.tolist()
        lengths = [e - s for s, e in zip(cu, cu[1:], strict=False)]
        assert max_seqlen_q >= max(lengths), "flash-attn sizes its grid by max_seqlen: a smaller one drops tokens"
        mod.calls.append(("varlen", cu, max_seqlen_q))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return torch.cat([_attend(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(cu, cu[1:], strict=False)])

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return mod


@pytest.fixture
def flash_attn(monkeypatch):
    """The stub installed, CUDA 'available', and CPU tensors seen as CUDA by the backend switch."""
    mod = _stub()
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_device_type", lambda device: "cuda")
    backend.clear_cache()
    yield mod
    backend.clear_cache()


def test_stub_makes_flash_attn_resolvable(flash_attn):
    assert backend.flash_attn_installed()
    assert backend.resolve("attention", "flash-attn", "cpu") == "flash-attn"


def _doc_ids_across_rows():
    # row 0 ends with document 5 and row 1 starts with it: the row boundary still splits it
    return torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 5, 5, 5], [5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8]])


# name: (lead shape, H, KV, D, gate, documents)
CASES = {
    "dense_gqa": ((2, 11), 4, 2, 16, "elementwise", None),
    "doc_ids_gqa_headwise": ((2, 11), 4, 1, 24, "headwise", "doc_ids"),
    "cu_seqlens_packed_mha": ((20,), 2, 2, 32, "elementwise", [0, 7, 7, 12, 13, 20]),  # empty + 1-token doc
    "cu_seqlens_4d_across_rows": ((2, 10), 4, 2, 16, None, [0, 4, 15, 20]),
    "packed_one_doc": ((9,), 2, 1, 8, "elementwise", None),
}


def _make(case):
    lead, H, KV, D, gate, docs = CASES[case]
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    xs = [rand(*lead, H, D, scale=2.0), rand(*lead, KV, D), rand(*lead, KV, D)]
    xs.append(None if gate is None else rand(*lead, H, *((D,) if gate == "elementwise" else ()), scale=2.0))
    kw = {}
    if docs == "doc_ids":
        kw["doc_ids"] = _doc_ids_across_rows()
    elif docs is not None:
        kw["cu_seqlens"] = torch.tensor(docs, dtype=torch.int64)  # int64: the op casts to flash-attn's int32
    return xs, kw, rand(*lead, H, D)


def _run(fn, inputs, kw, dout, dtype, **extra):
    xs = [None if t is None else t.to(dtype).requires_grad_() for t in inputs]
    out = fn(*xs, **kw, **extra)
    leaves = [x for x in xs if x is not None]
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_with_gate(flash_attn, case):
    inputs, kw, dout = _make(case)
    got = _run(gated_attention, inputs, kw, dout, torch.bfloat16, backend="flash-attn")
    ref = _run(gated_attention_reference, inputs, kw, dout, torch.bfloat16)
    ref64 = _run(gated_attention_reference, inputs, kw, dout, torch.float64)
    for name, a, r, r64 in zip(["out", "dq", "dk", "dv", "dgate"], got, ref, ref64, strict=False):
        assert a.dtype == torch.bfloat16 and a.shape == r64.shape
        assert_within_reference_error(f"{case} {name}", a, r, r64)
    # the path taken: flash_attn_func for (B, T, H, D) without documents, else varlen over the documents
    lead = CASES[case][0]
    if len(lead) == 2 and not kw:
        assert flash_attn.calls == [("func", None, None)]
        return
    N = lead[0] if len(lead) == 1 else lead[0] * lead[1]
    if "doc_ids" in kw:
        start, _ = doc_bounds(*lead, doc_ids=kw["doc_ids"])
        cu = [*(start == torch.arange(N)).nonzero().flatten().tolist(), N]
        assert 11 in cu  # the row boundary
    else:
        cu = kw["cu_seqlens"].tolist() if "cu_seqlens" in kw else [0, N]
    assert flash_attn.calls == [("varlen", cu, max(e - s for s, e in zip(cu, cu[1:], strict=False)))]


def test_refusals(flash_attn):
    def qkv(D, dtype):
        return [torch.randn(1, 6, 2, D, dtype=dtype) for _ in range(3)]

    with pytest.raises(BackendError, match=r"flash-attn computes in float16/bfloat16 only; got q torch.float32, "
                                           r"k torch.float32, v torch.float32. Run under autocast"):
        gated_attention(*qkv(16, torch.float32), backend="flash-attn")
    with pytest.raises(BackendError, match=r"head_dim=20 is not supported by flash-attn \(a multiple of 8 up to "
                                           r"256\)"):
        gated_attention(*qkv(20, torch.bfloat16), backend="flash-attn")
    with pytest.raises(BackendError, match=r"head_dim=264 is not supported"):
        gated_attention(*qkv(264, torch.bfloat16), backend="flash-attn")
    assert flash_attn.calls == []
    # what the fp32 refusal suggests: under autocast the inputs reach flash-attn in the autocast dtype
    q, k, v = qkv(16, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gated_attention(q, k, v, torch.randn(1, 6, 2), backend="flash-attn")
    assert out.dtype == torch.bfloat16 and flash_attn.calls == [("func", None, None)]
