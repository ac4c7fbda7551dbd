"""The peer backends of the short convolution (kernels/short_conv/peers.py) on the CPU, against the float64
reference (short_conv_reference), outputs and the gradients of x and the weight, in float32 and bfloat16.

- ``fla``: fla-core's real Triton kernels under the interpreter (its autotuner's benchmarking, which needs a GPU
  driver, neutralised), with the cu_seqlens the adapter builds from doc_ids checked at fla's entry point.
- ``causal-conv1d`` (CUDA-only, not installable here): a stand-in ``causal_conv1d`` package implementing
  ``causal_conv1d_fn``'s contract in pure torch and asserting its input rules (layout (batch, dim, seqlen),
  seq_idx int32 only in the channel-last layout with channels and strides multiples of 8, widths 2-4, dtypes),
  as tests/kernels/test_flash_attn_backend.py does for flash-attn.

Documents inside rows, one continuing across the row boundary (same id at the end of row 0 and the start of row
1: still two documents), odd lengths, widths, non-contiguous x, and the refusals (one line, BackendError)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from hybridtron.kernels.backend import BackendError
from hybridtron.kernels.short_conv.peers import peer_short_conv
from hybridtron.kernels.short_conv.reference import short_conv_reference

from .helpers import check_against_reference

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _stub():
    """A ``causal_conv1d`` package whose ``causal_conv1d_fn`` computes the documented contract in torch (fp32
    accumulation, output in x's dtype) after asserting the rules of causal_conv1d_interface.py and
    csrc/causal_conv1d.cpp; ``calls`` records the layout and seq_idx of each call."""
    mod = types.ModuleType("causal_conv1d")
    mod.__spec__ = importlib.machinery.ModuleSpec("causal_conv1d", None)
    mod.calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        assert activation in (None, "silu", "swish")
        assert x.dim() == 3 and weight.dim() == 2, "x (batch, dim, seqlen), weight (dim, width)"
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        assert weight.shape == (dim, width) and 2 <= width <= 4, "causal_conv1d only supports width between 2 and 4"
        assert x.dtype in FLOATS and weight.dtype in FLOATS
        assert x.stride(2) == 1 or x.stride(1) == 1
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last:
            assert dim % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0
        if seq_idx is not None:
            assert channel_last, "seq_idx is only supported for channel last layout"
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
        assert bias is None and initial_states is None and not return_final_states and final_states_out is None
        mod.calls.append(("channel_last" if channel_last else "contiguous",
                          None if seq_idx is None else seq_idx.tolist()))
        xf, wf = x.float(), weight.float()
        out = torch.zeros_like(xf)
        for w in range(width):  # tap w reads x[t - (width - 1 - w)], only from the same seq_idx
            shift = width - 1 - w
            xs = F.pad(xf, (shift, 0))[..., :seqlen]
            if seq_idx is not None:
                xs = xs * (F.pad(seq_idx, (shift, 0), value=-1)[:, :seqlen] == seq_idx)[:, None]
            out = out + wf[:, w, None] * xs
        if seq_idx is not None:
            out = out * (seq_idx >= 0)[:, None]  # negative seq_idx: padding, output zero
        return (F.silu(out) if activation else out).to(x.dtype)

    mod.causal_conv1d_fn = causal_conv1d_fn
    return mod


@pytest.fixture
def causal_conv1d(monkeypatch):
    mod = _stub()
    monkeypatch.setitem(sys.modules, "causal_conv1d", mod)
    return mod


@pytest.fixture
def fla_conv(monkeypatch):
    """fla's causal_conv1d as it is, its autotuner's benchmarking neutralised (it needs a GPU driver; equal
    timings take the first config) and its calls' cu_seqlens recorded."""
    pytest.importorskip("triton")
    fla_conv1d = pytest.importorskip("fla.modules.causal_conv1d")
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "_bench", lambda self, *args, config=None, **kw: [1.0, 1.0, 1.0])
    real, calls = fla_conv1d.causal_conv1d, []

    def recorded(x, weight, *args, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
        if cu_seqlens is not None:
            assert cu_seqlens.dtype == torch.int64 and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        calls.append((tuple(x.shape), None if cu_seqlens is None else cu_seqlens.tolist()))
        return real(x, weight, *args, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, **kw)

    monkeypatch.setattr(fla_conv1d, "causal_conv1d", recorded)
    return calls


def _doc_ids(B, T, seed=0):
    """Documents of random lengths; row 1 starts with the id row 0 ends with (still a new document there)."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.rand(B, T, generator=g) < 0.15).long().cumsum(1)
    for b in range(1, B):
        ids[b] += ids[b - 1, -1]
    return ids


def _runs(ids):
    """The run index per position (0, 1, ... per row): what causal-conv1d's seq_idx must hold."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts, starts.long().cumsum(1) - 1


# name: (B, T, C, K, documents, x a non-contiguous slice)
CASES = {
    "docs_across_rows_k4": (2, 37, 16, 4, True, False),
    "docs_k2_strided_x": (2, 21, 8, 2, True, True),
    "no_docs_c12_k3": (2, 19, 12, 3, False, False),  # channels not a multiple of 8: causal-conv1d's plain layout
    "no_docs_k4_strided_x": (1, 13, 16, 4, False, True),
}
FLA_CASES = CASES | {
    "docs_k1": (2, 17, 8, 1, True, False),  # fla takes any width
    "docs_k5": (2, 23, 8, 5, True, False),
}


def _inputs(B, T, C, K, docs, strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 2 * C if strided else C, generator=g, dtype=torch.float64)
    w = torch.randn(C, 1, K, generator=g, dtype=torch.float64) / K**0.5
    return x, w, (_doc_ids(B, T, seed) if docs else None)


def _check(backend, case_args, dtype):
    B, T, C, K, docs, strided = case_args
    x, w, ids = _inputs(*case_args)

    def peer(x, w):
        return peer_short_conv(x[..., :C] if strided else x, w, ids, backend=backend)

    def ref(x, w):
        return short_conv_reference(x[..., :C] if strided else x, w, ids)

    check_against_reference(f"{backend} {case_args} {dtype}", peer, ref, [x, w], [dtype, dtype])
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_causal_conv1d(causal_conv1d, case, dtype):
    ids = _check("causal-conv1d", CASES[case], dtype)
    C = CASES[case][2]
    layout = "channel_last" if C % 8 == 0 else "contiguous"  # channel-last is free from (B, T, C) memory
    seq_idx = None if ids is None else _runs(ids)[1].tolist()
    assert causal_conv1d.calls and all(c == (layout, seq_idx) for c in causal_conv1d.calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(FLA_CASES))
def test_fla(fla_conv, case, dtype):
    ids = _check("fla", FLA_CASES[case], dtype)
    B, T, C = FLA_CASES[case][:3]
    if ids is None:
        expected = ((B, T, C), None)  # the rows as a batch
    else:  # one packed row, a sequence starting at every row start and document start
        expected = ((1, B * T, C), [*_runs(ids)[0].flatten().nonzero().flatten().tolist(), B * T])
        assert T in expected[1]  # the row boundary, though row 1 starts with row 0's last id
    assert fla_conv and all(c == expected for c in fla_conv)


@pytest.mark.parametrize("backend", ["causal-conv1d", "fla"])
def test_any_ids_are_documents_by_runs(causal_conv1d, fla_conv, backend):
    """Ids of any sign and size (negative ones would be padding to causal-conv1d, int64 ones overflow its int32)
    mark documents where they change."""
    ids = torch.tensor([[-7, -7, -7, 2**40, 2**40, 3, 3, 3, 3, -1, -1, -1]])
    x = torch.randn(1, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).float()
    w = torch.randn(8, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).float()
    torch.testing.assert_close(peer_short_conv(x, w, ids, backend=backend), short_conv_reference(x, w, ids))
    if backend == "causal-conv1d":
        assert causal_conv1d.calls[-1][1] == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]]


REFUSALS = {
    "k5": ("causal-conv1d", dict(K=5), r"causal-conv1d takes filter widths 2-4, not K=5"),
    "k1": ("causal-conv1d", dict(K=1), r"causal-conv1d takes filter widths 2-4, not K=1"),
    "float64": ("causal-conv1d", dict(dtype=torch.float64), r"causal-conv1d takes float32, float16 or bfloat16, "
                                                            r"not x torch.float64 and weight torch.float64"),
    "docs_c12": ("causal-conv1d", dict(C=12, docs=True), r"causal-conv1d takes documents \(seq_idx\) only in its "
                                                         r"channel-last layout, which needs the channels to be a "
                                                         r"multiple of 8, not C=12"),
}


def _small(C=8, K=4, docs=False, dtype=torch.float32):
    x = torch.randn(2, 6, C, dtype=dtype)
    return x, torch.randn(C, 1, K, dtype=dtype), (torch.tensor([[0, 0, 1, 1, 1, 2]] * 2) if docs else None)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(causal_conv1d, case):
    backend, kw, msg = REFUSALS[case]
    with pytest.raises(BackendError, match=msg) as err:
        peer_short_conv(*_small(**kw), backend=backend)
    assert "\n" not in str(err.value) and str(err.value).endswith("choose model.kernels.conv=triton or reference")
    assert causal_conv1d.calls == []


def test_not_installed_and_unknown_peer(monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # import fails, as on a machine without the package
    with pytest.raises(BackendError, match=r"causal-conv1d is not installed .*; choose model.kernels.conv=triton or "
                                           r"reference$"):
        peer_short_conv(*_small(), backend="causal-conv1d")
    with pytest.raises(BackendError, match=r"backend='mamba' is not a peer of the short convolution; choose one of "
                                           r"\['causal-conv1d', 'fla'\]"):
        peer_short_conv(*_small(), backend="mamba")
    with pytest.raises(ValueError, match=r"weight has shape \(8, 4\); it must be \(8, 1, K\)"):
        peer_short_conv(torch.randn(1, 3, 8), torch.randn(8, 4), backend="fla")


def test_not_traced_by_torch_compile():
    assert getattr(peer_short_conv, "_torchdynamo_disable", False)
