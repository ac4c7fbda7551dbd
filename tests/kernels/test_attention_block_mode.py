"""The gated-attention kernels' non-causal rectangle mode (``causal=False``), for ring attention's cross-block steps:
q (Nq, H, D) against k, v (Nk, KV, D) of another length, every query attending every key, no gate. Run by Triton's
interpreter at tiny odd shapes (lengths off the 16-row tiles, head dim 24, MQA / GQA / MHA) against an explicit
float64 softmax written here: the output, the log-sum-exp (base 2 in the kernel), dq, dk, dv; the backward fed the
*final* out and lse merged over key blocks (flash-attention's rule), whose per-block gradients must add up to the
whole; empty query and key sets; the causal mode through the same launchers.

float64 is not a kernel dtype (op.KERNEL_DTYPES; the log-sum-exp and the accumulators are fp32 whatever the
inputs), so the kernels run fp32 and bf16 and the reference float64."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated (read at decoration)

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridtron.kernels import backend  # noqa: E402
from hybridtron.kernels.testing import Bf16MatmulOperands, assert_within_reference_error  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (backend.triton_installed() and backend.interpreter_requested()),
    reason="needs triton and TRITON_INTERPRET=1 (the dev extra installs triton)",
)

LN2 = math.log(2.0)
EPS32 = torch.finfo(torch.float32).eps


def _tk():
    from hybridtron.kernels.gated_attention import triton_kernels

    return triton_kernels


def _inputs(Nq: int, Nk: int, H: int, KV: int, D: int, seed: int = 0):
    """float64 q (scaled up: a peaked softmax exercises the running max), k, v, dout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Nq, H, D, generator=g, dtype=torch.float64) * 2.0
    k, v = (torch.randn(Nk, KV, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(Nq, H, D, generator=g, dtype=torch.float64)


def _reference(q, k, v, dout, scale):
    """Explicit scores, softmax and logsumexp in q's dtype, every key visible: out (Nq, H, D), lse (H, Nq) natural
    log, dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("mhd,nhd->hmn", q, kk) * scale
    out = torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), vv)
    lse = torch.logsumexp(s, -1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return [out.detach(), lse.detach(), dq, dk, dv]


def _reference_in(dtype, inputs, scale):
    """The reference run as the kernel computes in ``dtype``: fp32 as it is; bf16 as fp32 softmax whose products
    take bf16 operands (tensor-core dots), results rounded to bf16 (a bf16-arithmetic softmax, its scores rounded
    to bf16, is an order of magnitude further off and would make the rule's bound loose)."""
    low = [t.to(dtype) for t in inputs]
    if dtype == torch.float32:
        return _reference(*low, scale)
    with Bf16MatmulOperands():
        ref = _reference(*(t.float() for t in low), scale)
    return [t if i == 1 else t.to(dtype) for i, t in enumerate(ref)]


def _check(what, got, inputs, dtype, scale):
    """got = [out, lse (natural), dq, dk, dv] against the reference in ``dtype`` and in float64 (the accuracy rule,
    with the gated-attention tests' floor: a few ulps of the dtype plus ~sqrt(D) fp32 ulps of the dots)."""
    q, k, v, dout = inputs
    ref_d = _reference_in(dtype, inputs, scale)
    ref64 = _reference(q, k, v, dout.to(dtype).double(), scale)
    D = q.shape[-1]
    for name, a, r, r64 in zip(["out", "lse", "dq", "dk", "dv"], got, ref_d, ref64, strict=True):
        assert a.dtype == (torch.float32 if name == "lse" else dtype), (name, a.dtype)
        eps = EPS32 if name == "lse" else torch.finfo(dtype).eps
        atol = 4 * r64.abs().max().item() * (eps + D**0.5 * EPS32)
        assert_within_reference_error(f"{what} {name}", a, r, r64, atol=atol)


def _fwd(q, k, v, scale):
    out, attn, lse = _tk().attn_fwd(q, k, v, None, None, scale, causal=False)
    assert attn.numel() == 0
    return out, lse


def _bwd(dout, q, k, v, out, lse, scale, split=None):
    dq, dk, dv, dgate = _tk().attn_bwd(dout, q, k, v, None, out, lse, None, None, scale, split=split, causal=False)
    assert dgate.numel() == 0
    return dq, dk, dv


# name: (Nq, Nk, H, KV, D, dtype, dK/dV split (None: the launcher's: the interpreter's is one program per query
# head, fp32 partial sums), K/V through tensor descriptors)
CASES = {
    "mqa_tiny_fp32": (5, 3, 4, 1, 16, torch.float32, None, True),
    "gqa_d24_bf16": (37, 19, 4, 2, 24, torch.bfloat16, None, True),
    "mha_pointers_fp32": (20, 41, 4, 4, 16, torch.float32, None, False),
    "gqa_one_program_per_kv_head_bf16": (18, 20, 4, 2, 16, torch.bfloat16, 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rectangle_matches_reference(case, monkeypatch):
    Nq, Nk, H, KV, D, dtype, split, tma = CASES[case]
    monkeypatch.setattr(_tk(), "TMA", tma)
    inputs = _inputs(Nq, Nk, H, KV, D)
    q, k, v, dout = (t.to(dtype) for t in inputs)
    scale = D**-0.5
    out, lse = _fwd(q, k, v, scale)
    assert out.shape == (Nq, H, D) and lse.shape == (H, Nq) and lse.dtype == torch.float32
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, scale, split)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    _check(case, [out, lse * LN2, dq, dk, dv], inputs, dtype, scale)


def test_backward_with_merged_out_and_lse():
    """Ring attention's use: the keys in blocks (one of them empty), a forward per block, the outputs merged by
    their log-sum-exp; then each block's backward, given the merged out and lse, returns its share: the dq summed
    over blocks and the dk, dv concatenated are the gradients of attention over all the keys. (fp32: the property
    is the same in every dtype, and the rectangle cases run bf16.)"""
    dtype = torch.float32
    Nq, H, KV, D = 19, 4, 1, 16
    cuts = [0, 13, 13, 29]  # 13 keys, none, 16
    inputs = _inputs(Nq, cuts[-1], H, KV, D, seed=1)
    q, k, v, dout = (t.to(dtype) for t in inputs)
    scale = D**-0.5
    blocks = [(k[a:b], v[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    parts = [_fwd(q, kb, vb, scale) for kb, vb in blocks]
    empty_out, empty_lse = parts[1]
    assert (empty_out == 0).all() and torch.isneginf(empty_lse).all()
    lse = (torch.stack([p[1] for p in parts]) * LN2).logsumexp(0) / LN2  # base 2; -inf parts weigh 0
    out = sum(p[0].float() * torch.exp2(p[1] - lse).T[..., None] for p in parts).to(dtype)
    grads = [_bwd(dout, q, kb, vb, out, lse, scale) for kb, vb in blocks]
    empty_dq = grads[1][0]
    assert (empty_dq == 0).all() and grads[1][1].shape == (0, KV, D)
    dq = sum(g[0].float() for g in grads).to(dtype)
    dk, dv = (torch.cat([g[i] for g in grads]) for i in (1, 2))
    _check(f"merged {dtype}", [out, lse * LN2, dq, dk, dv], inputs, dtype, scale)


# The interpreter's numpy reports the overflow before the mask zeroes it, and the inf * 0 in the dK/dV rows past
# Nk (never stored); the GPU computes the same without a word.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2", "ignore:invalid value encountered in matmul")
def test_far_negative_scores_on_a_ragged_key_tile():
    """Every score below -128 / log2(e) (log-sum-exp < -128 in base 2): for the key rows past Nk, which the tiles
    read as zeros (score 0), exp2(0 - lse) overflows fp32 to inf, and inf * 0 would turn dq NaN unless the ragged
    tile's row mask zeroes P first."""
    Nq, Nk, H, KV, D = 7, 5, 4, 2, 16
    q, k, v, dout = _inputs(Nq, Nk, H, KV, D, seed=3)
    q, k = q * 0.3 + 6.0, k * 0.3 - 6.0  # q.k about -576: scores about -144
    inputs = [q, k, v, dout]
    low = [t.float() for t in inputs]
    scale = D**-0.5
    out, lse = _fwd(*low[:3], scale)
    assert (lse < -128).all()
    dq, dk, dv = _bwd(low[3], *low[:3], out, lse, scale)
    _check("far negative", [out, lse * LN2, dq, dk, dv], inputs, torch.float32, scale)


def test_empty_query_or_key_sets():
    tk = _tk()
    q, k, v, dout = _inputs(7, 5, 4, 2, 16)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    out, _, lse = tk.attn_fwd(q[:0], k, v, None, None, 0.25, causal=False)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    dq, dk, dv, _ = tk.attn_bwd(dout[:0], q[:0], k, v, None, out, lse, None, None, 0.25, causal=False)
    assert dq.shape == (0, 4, 16) and (dk == 0).all() and (dv == 0).all() and dk.shape == k.shape
    out, _, lse = tk.attn_fwd(q, k[:0], v[:0], None, None, 0.25, causal=False)
    assert (out == 0).all() and out.shape == q.shape and torch.isneginf(lse).all() and lse.shape == (4, 7)
    dq, dk, dv, _ = tk.attn_bwd(dout, q, k[:0], v[:0], None, out, lse, None, None, 0.25, causal=False)
    assert (dq == 0).all() and dq.shape == q.shape and dk.shape == dv.shape == (0, 2, 16)


def test_rectangle_refuses_a_gate():
    q, k, v, _ = (t.float() for t in _inputs(5, 3, 4, 2, 16))
    with pytest.raises(ValueError, match="no gate"):
        _tk().attn_fwd(q, k, v, torch.zeros(5, 4), None, 0.25, causal=False)


def test_causal_mode_unchanged():
    """The default (causal) mode through the same launchers: packed documents, the kernels' causal and document
    masks, against the same explicit softmax with the mask applied (the full coverage is test_gated_attention.py)."""
    from hybridtron.kernels.gated_attention import doc_bounds

    N, H, KV, D = 19, 4, 2, 16
    q, k, v, dout = (t.float() for t in _inputs(N, N, H, KV, D, seed=2))
    cu = torch.tensor([0, 6, 19], dtype=torch.int32)
    start, end = doc_bounds(1, N, cu_seqlens=cu)
    tk = _tk()
    out, _, lse = tk.attn_fwd(q, k, v, None, start, D**-0.5)
    dq, dk, dv, _ = tk.attn_bwd(dout, q, k, v, None, out, lse, start, end, D**-0.5)
    # Reference: each document on its own, causal
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    rows = torch.arange(N)
    visible = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= start.long()[:, None])
    s = torch.einsum("mhd,nhd->hmn", qq, kk.repeat_interleave(H // KV, 1)) * D**-0.5
    s = s.masked_fill(~visible, float("-inf"))
    ref = torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), vv.repeat_interleave(H // KV, 1))
    grads = torch.autograd.grad(ref, (qq, kk, vv), dout.double())
    for name, a, r in zip(["out", "lse", "dq", "dk", "dv"], [out, lse * LN2, dq, dk, dv],
                          [ref, torch.logsumexp(s, -1), *grads], strict=True):
        torch.testing.assert_close(a.double(), r.detach(), rtol=1e-5, atol=2e-5, msg=name)
