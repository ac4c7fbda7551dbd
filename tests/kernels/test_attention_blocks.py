"""The blocks of ring attention (kernels/gated_attention/blocks.py), one process: each backend's forward (output and
log-sum-exp) and backward against float64 explicit-score attention written here, for a causal block within documents
and for a full rectangle; and the property ring attention rests on: key blocks attended to separately and merged by
their log-sum-exp give whole attention, and each block's backward run with the *merged* output and log-sum-exp gives
that block's share of the gradients (they sum to the whole)."""

from __future__ import annotations

import pytest
import torch

from hybridtron.kernels.gated_attention import blocks

IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 4, 4], [5] * 13])


def _explicit(q, k, v, causal, ids=None):
    """(out, lse) in float64 with explicit scores (grouped-query heads repeated)."""
    B, t, H, D = q.shape
    group = H // k.shape[2]
    kh, vh = (x.double().repeat_interleave(group, 2) for x in (k, v))
    s = torch.einsum("bthd,bshd->bhts", q.double(), kh) * D ** -0.5
    if causal:
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        if ids is not None:
            mask = mask & (ids[:, None, :, None] == ids[:, None, None, :])
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), vh), torch.logsumexp(s, -1)


def _inputs(t, s, H, KV, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, t, H, D, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(2, s, KV, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v


def test_docs_runs_are_the_runs_of_equal_ids():
    assert blocks.Docs(IDS).runs() == [[(0, 3), (3, 5), (5, 10), (10, 11), (11, 13)], [(0, 13)]]


# triton: our kernel under the interpreter, float32 (its accumulators are float32 whatever the inputs)
DTYPES = {"reference": (torch.float64, 1e-13), "sdpa": (torch.float64, 1e-13), "triton": (torch.float32, 2e-5)}


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
@pytest.mark.parametrize("causal,docs", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("KV", [1, 2])
def test_block_forward_and_backward_equal_explicit_attention(backend, causal, docs, KV):
    t = 13
    s = t if causal else 9
    dtype, tol = DTYPES[backend]
    q, k, v = _inputs(t, s, 4, KV, 8, dtype)
    ids = IDS if docs else None
    out, lse = blocks.forward(backend, q, k, v, causal=causal, scale=8 ** -0.5,
                              docs=blocks.Docs(ids) if docs else None)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    want, want_lse = _explicit(qr, kr, vr, causal, ids)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=tol)
    dout = torch.randn_like(want)
    (want * dout).sum().backward()
    grads = blocks.backward(backend, dout.to(dtype), q, k, v, out, lse, causal=causal, scale=8 ** -0.5,
                            docs=blocks.Docs(ids) if docs else None)
    for got, ref in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(got.double(), ref.double(), rtol=0, atol=10 * tol)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_blocks_merged_by_log_sum_exp_are_whole_attention_with_its_gradients(backend):
    """Keys split in two full blocks (as ring attention's earlier ranks' blocks): merged outputs and summed block
    gradients (each block's backward with the merged out and lse) equal attention over all keys."""
    q, k, v = _inputs(7, 11, 4, 2, 8, torch.float64, seed=1)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    want, _ = _explicit(qr, kr, vr, causal=False)
    dout = torch.randn_like(want)
    (want * dout).sum().backward()
    parts = [(k[:, :4], v[:, :4]), (k[:, 4:], v[:, 4:])]
    results = [blocks.forward(backend, q, kb, vb, causal=False, scale=8 ** -0.5) for kb, vb in parts]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(o * torch.exp(l_ - lse).transpose(1, 2)[..., None] for o, l_ in results)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-13)
    grads = [blocks.backward(backend, dout, q, kb, vb, out, lse, causal=False, scale=8 ** -0.5) for kb, vb in parts]
    torch.testing.assert_close(grads[0][0] + grads[1][0], qr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 1), kr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 1), vr.grad, rtol=0, atol=1e-12)


def test_empty_blocks_see_nothing():
    q, k, v = _inputs(5, 0, 2, 1, 8, torch.float64)
    out, lse = blocks.forward("sdpa", q, k, v, causal=False, scale=1.0)
    assert out.abs().max() == 0 and torch.isinf(lse).all()


def test_an_unknown_block_backend_is_refused():
    q, k, v = _inputs(3, 3, 2, 1, 8, torch.float64)
    with pytest.raises(blocks.BackendError, match="ring attention runs its blocks on reference, sdpa, triton"):
        blocks.forward("flex", q, k, v, causal=True, scale=1.0)
