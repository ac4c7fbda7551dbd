"""The fla backend of the gated delta rule (kernels/gated_delta_rule/fla_backend.py) on the CPU.

fla-core's chunked Triton kernels do not run under the interpreter (their index arithmetic casts Python ints
with ``.to(tl.int64)``), so at the point where fla's public functions hand over to their kernels -- the
``apply`` of ``ChunkGatedDeltaRuleFunction`` and ``ChunkGatedDeltaProductFunction`` -- a stand-in runs fla's
own pure-torch recurrences (``naive_recurrent_gated_delta_rule``, ``naive_recurrent_gated_delta_product``) per
packed sequence, after the l2norm fla applies. fla's public functions and their argument checks run unchanged on
what the adapter passes, so its layouts and flags (flattened documents, cu_seqlens, per-sequence initial states,
GVA, DeltaProduct's sub-step order, l2norm, scale) are tested against our float64 reference, outputs and every
input's gradient, in float32 and bfloat16; fla's own l2norm kernel is compared with ours; what fla cannot take is
refused before it is called."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.kernels.backend import BackendError
from hybridtron.kernels.gated_delta_rule.fla_backend import fla_gated_delta_rule
from hybridtron.kernels.gated_delta_rule.reference import delta_rule_chunked, l2_normalize

from .helpers import Bf16MatmulOperands, check_against_reference

pytest.importorskip("fla")
pytest.importorskip("triton")


@pytest.fixture
def no_autotune(monkeypatch):
    """Triton's autotuner benchmarks configs on a GPU driver the interpreter lacks; equal timings make it take
    the first config (any config computes the same)."""
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "_bench", lambda self, *args, config=None, **kw: [1.0, 1.0, 1.0])


def _l2norm(x):
    """What fla's kernels do under use_qk_l2norm_in_kernel (fla.modules.l2norm.l2norm_fwd): x * rsqrt(sum x^2 +
    1e-6) in fp32, stored in x's dtype. In torch, not fla's Triton kernel: Triton's interpreter rounds fp32 to bf16
    toward zero where the GPU rounds to nearest even, and the biased keys (|k| < 1) would stand for an error fla
    does not make."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _sequences(cu_seqlens, T):
    cu = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    return list(zip(cu, cu[1:], strict=False))


@pytest.fixture
def fla_stub(monkeypatch):
    """fla's two chunked autograd Functions replaced by stand-ins on fla's naive recurrences; returns the list of
    calls (which function, cu_seqlens, number of initial states, B) for the tests to check the path taken."""
    from fla.ops.gated_delta_product.chunk import ChunkGatedDeltaProductFunction
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    calls = []

    def record(name, q, cu_seqlens, cu_seqlens_cpu, initial_state):
        if cu_seqlens is not None:  # what fla's chunk-index preparation expects
            assert cu_seqlens.dtype == torch.int64 and cu_seqlens_cpu is not None
            assert cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        calls.append((name, None if cu_seqlens is None else cu_seqlens.tolist(),
                      None if initial_state is None else initial_state.shape[0], q.shape[0]))

    def gdn(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
            chunk_indices, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, cp_context, chunk_size):
        """Stands in for ChunkGatedDeltaRuleFunction.apply (fla's chunked Gated DeltaNet kernels): l2norm, then
        fla's token-by-token recurrence per packed sequence (each from its own initial state), value head i
        reading key head i // (HV // H) as fla's kernels index it; o in q's dtype, final states in fp32."""
        assert not (state_v_first or use_gate_in_kernel or use_beta_sigmoid_in_kernel or allow_neg_eigval)
        assert cp_context is None and chunk_indices is None and chunk_size in (16, 32, 64)
        record("gdn", q, cu_seqlens, cu_seqlens_cpu, initial_state)
        out_dtype = q.dtype
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        r = v.shape[2] // k.shape[2]
        qr, kr = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        outs, finals = [], []
        for b in range(q.shape[0]):
            for i, (s, e) in enumerate(_sequences(cu_seqlens, q.shape[1])):
                n = b if cu_seqlens is None else i
                o, h = naive_recurrent_gated_delta_rule(
                    qr[b:b + 1, s:e], kr[b:b + 1, s:e], v[b:b + 1, s:e], beta[b:b + 1, s:e], g[b:b + 1, s:e], scale,
                    None if initial_state is None else initial_state[n:n + 1], output_final_state=True)
                outs.append(o)
                finals.append(h)
        o = torch.cat(outs, 1).reshape(v.shape).to(out_dtype)
        return o, (torch.cat(finals).float() if output_final_state else None)

    def gdp(q, k, v, g, beta, scale, num_householder, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, cu_seqlens_cpu, cp_context):
        """Stands in for ChunkGatedDeltaProductFunction.apply (fla's chunked DeltaProduct kernels): l2norm, then
        fla's DeltaProduct recurrence (it walks the packed sequences itself); final states in fp32."""
        assert cp_context is None
        record("gdp", q, cu_seqlens, cu_seqlens_cpu, initial_state)
        out_dtype = q.dtype
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        o, h = naive_recurrent_gated_delta_product(q, k, v, g, beta, scale, cu_seqlens=cu_seqlens,
                                                   initial_state=initial_state, num_householder=num_householder)
        return o.to(out_dtype), (h.float() if output_final_state else None)

    monkeypatch.setattr(ChunkGatedDeltaRuleFunction, "apply", gdn)
    monkeypatch.setattr(ChunkGatedDeltaProductFunction, "apply", gdp)
    return calls


def make(B, T, Hk, r, n_h, Dk, Dv, beta_max=1.0, resets=(), init=False, seed=0):
    """float64 inputs: decays exp(g) mostly in (0.5, 1), beta in (0, beta_max), resets True at the given (row,
    position) pairs (None for none), an initial state or None."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    Hv = Hk * r
    x = dict(q=randn(B, T, Hk, Dk), k=randn(B, T, n_h, Hk, Dk), v=randn(B, T, n_h, Hv, Dv),
             g=F.logsigmoid(randn(B, T, Hv) + 2), beta=torch.rand(B, T, n_h, Hv, generator=gen, dtype=torch.float64)
             * beta_max)
    x["resets"] = None
    if resets:
        x["resets"] = torch.zeros(B, T, dtype=torch.bool)
        for b, t in resets:
            x["resets"][b, t] = True
    x["initial_state"] = randn(B, Hv, Dk, Dv) if init else None
    return x


# name: (B, T, Hk, r, n_h, Dk, Dv, beta_max, resets (row, position), initial state, final state returned, chunk)
CASES = {
    # documents inside both rows (a reset at t = 0, which callers do not set, drops row 0's initial state, as in
    # the reference), grouped value heads, negative eigenvalues, odd length, initial and final state
    "docs_gva_negeig_state": (2, 37, 1, 2, 1, 16, 8, 2.0, [(0, 0), (0, 5), (0, 6), (0, 30), (1, 17)], True, True,
                              16),
    # no reset inside a row: a plain batch (row 1's state dropped by its reset at t = 0)
    "batch_gva_state": (2, 21, 2, 2, 1, 8, 16, 1.0, [(1, 0)], True, True, 32),
    "docs_no_state": (1, 29, 2, 1, 1, 16, 16, 2.0, [(0, 11), (0, 28)], False, False, 64),
    "delta_product_docs_gva_state": (2, 19, 1, 2, 2, 16, 8, 2.0, [(0, 7), (1, 1), (1, 12)], True, True, 64),
    "delta_product_batch_gva": (2, 13, 2, 2, 3, 8, 8, 2.0, [], False, True, 64),
}
RUNS = [(c, d) for c in CASES for d in (torch.float32, torch.bfloat16) if not (CASES[c][4] > 1 and d == torch.float32)]


def _expected_call(case, x):
    """(function, cu_seqlens, number of initial states, rows) the adapter must hand to fla."""
    B, T, n_h = x["k"].shape[:3]
    name = "gdn" if n_h == 1 else "gdp"
    n0 = None if x["initial_state"] is None else B
    if not CASES[case][8] or not x["resets"][:, 1:].any():
        return name, None, n0, B
    starts = x["resets"].clone()
    starts[:, 0] = True
    cu = [*starts.flatten().nonzero().flatten().tolist(), B * T]
    return name, cu, None if n0 is None else len(cu) - 1, 1


@pytest.mark.parametrize("case,dtype", RUNS)
def test_matches_reference(fla_stub, case, dtype):
    B, T, Hk, r, n_h, Dk, Dv, beta_max, resets, init, final, chunk = CASES[case]
    x = make(B, T, Hk, r, n_h, Dk, Dv, beta_max, resets, init)
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if init else [])
    # activations in dtype; the log decays and the state stay fp32, as a model keeps them
    dts = [dtype if n in ("q", "k", "v", "beta") else torch.float32 for n in names]

    def run(fn, **kw):
        def f(*ts):
            a = {"initial_state": None} | dict(zip(names, ts, strict=True))
            o, S = fn(a["q"], a["k"], a["v"], a["g"], a["beta"], resets=x["resets"], initial_state=a["initial_state"],
                      output_final_state=final, **kw)
            assert (S is None) != final
            return (o, S) if final else o
        return f

    # In bf16 fla multiplies bf16 operands (and stores the normalised q, k in bf16), so every result carries bf16
    # operand rounding, those returned in fp32 too (the final state, the gradients of g and of the initial state):
    # the reference's own error is taken with bf16 operands in its matrix products as well, as
    # tests/kernels/test_gated_delta_rule.py does for our kernels. fp32 runs: the reference as it is.
    check_against_reference(f"fla {case} {dtype}", run(fla_gated_delta_rule, chunk_size=chunk),
                            run(delta_rule_chunked, chunk_size=chunk), [x[n] for n in names], dts,
                            ref_mode=Bf16MatmulOperands if dtype == torch.bfloat16 else None)
    expected = _expected_call(case, x)
    assert fla_stub and all(c == expected for c in fla_stub), (fla_stub, expected)
    if final:  # the final state is fp32 whatever the activations' dtype
        low = {n: x[n].to(d) for n, d in zip(names, dts, strict=True)}
        _, S = fla_gated_delta_rule(**{"initial_state": None} | low, resets=x["resets"], output_final_state=True,
                                    chunk_size=chunk)
        assert S.dtype == torch.float32 and S.shape == (B, Hk * r, Dk, Dv)


def test_fla_l2norm_matches_ours(no_autotune):
    """fla normalises with x / sqrt(sum x^2 + 1e-6), as our l2_normalize (eps inside the root): tiny vectors,
    where the placements differ (x / (|x| + eps) would be off by 3%), agree to float32 rounding."""
    from fla.modules.l2norm import l2norm_fwd

    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0)) * 1e-3
    y, _ = l2norm_fwd(x)
    torch.testing.assert_close(y, l2_normalize(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y, x / (x.norm(dim=-1, keepdim=True) + 1e-6), rtol=1e-3, atol=0)


def _small(B=1, T=6, Hk=1, r=1, n_h=1, Dk=8, Dv=8, dtype=torch.bfloat16, grad=False):
    x = make(B, T, Hk, r, n_h, Dk, Dv)
    return {n: x[n].to(dtype if n != "g" else torch.float32).requires_grad_(grad) for n in ("q", "k", "v", "g", "beta")}


REFUSALS = {
    "chunk_size": (dict(), dict(chunk_size=128), r"fla's chunked gated delta rule takes chunk_size 16, 32 or 64, "
                                                 r"not 128"),
    "head_dim": (dict(Dk=264), dict(), r"takes key head dims up to 256, not Dk=264"),
    "delta_product_fp32": (dict(n_h=2, dtype=torch.float32), dict(),
                           r"chunk_gated_delta_product \(DeltaProduct, n_h=2\) refuses float32 q; run it in bfloat16"),
    "odd_dims_bf16_backward": (dict(Dk=9, grad=True), dict(), r"backward takes even head dims in torch.bfloat16, "
                                                              r"not Dk=9, Dv=8"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(fla_stub, case):
    shape, kw, msg = REFUSALS[case]
    with pytest.raises(BackendError, match=msg) as err:
        fla_gated_delta_rule(**_small(**shape), **kw)
    assert "\n" not in str(err.value) and str(err.value).endswith("choose model.kernels.delta_rule=triton or "
                                                                  "reference")
    assert fla_stub == []  # refused before fla was called


def test_odd_dims_without_gradients_run(fla_stub):
    """The odd-dim refusal is about fla's backward only: a forward without gradients (prefill) goes to fla."""
    with torch.no_grad():
        o, _ = fla_gated_delta_rule(**_small(Dk=9, grad=True))
    assert o.shape == (1, 6, 1, 8) and o.dtype == torch.bfloat16 and len(fla_stub) == 1


def test_not_traced_by_torch_compile():
    """torch.compile must not trace into fla's autograd.Functions: the adapter is a graph break."""
    assert getattr(fla_gated_delta_rule, "_torchdynamo_disable", False)
