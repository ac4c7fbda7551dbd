"""The chunked gated delta rule on Triton kernels (kernels/gated_delta_rule/chunk.py) under the interpreter
against the float64 reference: outputs, final states and the gradients of q, k, v, g, beta and the initial
state (the final state with its own cotangent) at tiny and odd shapes: one token; lengths that are not a
multiple of the chunk; chunks of 16, 32 and 64; head dims that are not powers of two and value dims over two
tiles; grouped value heads; DeltaProduct sub-steps; beta up to 2; many short documents (resets inside chunks,
on chunk boundaries and at the first token). In float64 the kernels equal the token-by-token recurrence to
rounding; the tolerance rule fails a kernel that drops the resets or the decay; bad inputs are refused by name;
torch.compile traces forward and backward without graph breaks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.kernels.gated_delta_rule import chunk_gated_delta_rule, delta_rule_chunked, delta_rule_recurrent

from .helpers import Bf16MatmulOperands, check_against_reference

pytest.importorskip("triton")


def inputs(B, T, Hk, r, n_h, Dk, Dv, beta_max=1.0, reset_p=0.0, init=False, seed=0):
    """float64 q, k, v, g (decays exp(g) mostly in (0.5, 1)), beta in (0, beta_max), resets (a document
    starts at each position with probability reset_p; None for 0) and an initial state (or None)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    Hv = Hk * r
    x = dict(q=randn(B, T, Hk, Dk), k=randn(B, T, n_h, Hk, Dk), v=randn(B, T, n_h, Hv, Dv),
             g=F.logsigmoid(randn(B, T, Hv) + 2),
             beta=torch.rand(B, T, n_h, Hv, generator=gen, dtype=torch.float64) * beta_max)
    x["resets"] = torch.rand(B, T, generator=gen) < reset_p if reset_p else None
    x["initial_state"] = randn(B, Hv, Dk, Dv) if init else None
    return x


def call(fn, x, final=True, **kw):
    """fn on the inputs dict; (o, final state) with final, else o alone."""
    o, S = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], resets=x["resets"], initial_state=x["initial_state"],
              output_final_state=final, **kw)
    return (o, S) if final else o


# name: (B, T, Hk, r, n_h, Dk, Dv, chunk, beta_max, reset_p, initial state, final state returned)
CASES = {
    "one_token": (1, 1, 2, 1, 1, 16, 16, 16, 1.0, 0.0, True, True),
    "odd_T_Dk_gva": (2, 19, 1, 2, 1, 24, 20, 16, 2.0, 0.3, True, True),
    "delta_product": (1, 11, 1, 2, 2, 32, 24, 16, 2.0, 0.3, False, True),
    "delta_product_gva_state": (2, 9, 2, 2, 2, 16, 16, 16, 2.0, 0.4, True, True),
    "many_docs": (2, 34, 2, 1, 1, 16, 32, 16, 1.0, 0.3, True, True),
    "chunk32_no_docs": (1, 40, 1, 1, 1, 32, 16, 32, 2.0, 0.0, False, False),
    "chunk64_two_v_tiles": (1, 70, 1, 1, 1, 16, 80, 64, 1.0, 0.1, True, True),
}


# Each case in fp32 and bf16; "bfloat16_all" also puts g and the initial state in bf16.
RUNS = [(c, d) for c in CASES for d in (torch.float32, torch.bfloat16)]
RUNS += [("odd_T_Dk_gva", "bfloat16_all"), ("many_docs", "bfloat16_all")]


@pytest.mark.parametrize("case,dtype", RUNS)
def test_chunk_gated_delta_rule(case, dtype):
    B, T, Hk, r, n_h, Dk, Dv, chunk, beta_max, reset_p, init, final = CASES[case]
    x = inputs(B, T, Hk, r, n_h, Dk, Dv, beta_max, reset_p, init)
    if case == "many_docs":  # documents starting on chunk boundaries, right after one, and at the first token
        x["resets"][0, [0, 15, 16, 32]] = True
        x["resets"][1, [16, 17]] = True
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if init else [])
    # The activations in dtype; g and the state stay fp32 in bf16 runs, as a model keeps them.
    low = ("q", "k", "v", "beta", "g", "initial_state") if dtype == "bfloat16_all" else ("q", "k", "v", "beta")
    dtype = torch.bfloat16 if dtype == "bfloat16_all" else dtype
    dts = [dtype if n in low else torch.float32 for n in names]
    resets = x["resets"]

    def run(fn, **kw):
        def f(*ts):
            return call(fn, {"resets": resets, "initial_state": None} | dict(zip(names, ts, strict=True)), final, **kw)
        return f

    # With bf16 q the kernels multiply bf16 operands (at the tensor cores' full rate, as fla does;
    # kernels/gated_delta_rule/chunk_kernels.py), so every result carries bf16 operand rounding, those returned
    # in fp32 too (the final state, the gradients of fp32 g, beta and initial state). The reference's own error is
    # then taken with bf16 operands in its matrix products as well: the kernels are held to 3x the error that bf16
    # operands make in the reference's algorithm. fp32 runs: the reference as it is.
    check_against_reference(f"chunk_gated_delta_rule[{case}]", run(chunk_gated_delta_rule, chunk_size=chunk),
                            run(delta_rule_chunked, chunk_size=chunk), [x[n] for n in names], dts,
                            ref_mode=Bf16MatmulOperands if dtype == torch.bfloat16 else None)


def grads(fn, x, **kw):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None and t.is_floating_point()}
    o, S = call(fn, x | leaves, **kw)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=S.dtype)).sum()
    return [o, S, *torch.autograd.grad(loss, list(leaves.values()))]


def test_float64_equals_the_recurrence():
    """In float64 the chunked kernels and the token-by-token recurrence (a different algorithm) agree to
    rounding, outputs and every gradient: no formula is only approximately right."""
    x = inputs(2, 21, 1, 2, 2, 24, 20, beta_max=2.0, reset_p=0.3, init=True, seed=3)
    got = grads(chunk_gated_delta_rule, x, chunk_size=16)
    want = grads(delta_rule_recurrent, x)
    for name, a, b in zip(["o", "final state", "q", "k", "v", "g", "beta", "initial_state"], got, want,
                          strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("bv,warps", [(16, 4), (64, 4)])
def test_every_state_tile_width_the_gpu_may_pick_gives_the_recurrence(bv, warps, monkeypatch):
    """On the GPU the two state passes are autotuned over their value-tile width (chunk_kernels.STATE_TUNE); the
    interpreter runs one. Forced to each other width, with value dims over several tiles (80 = 16 x 5 = 64 + 16)
    and the decay's S * dS' partial sums spread over a different number of slots, the kernels still equal the
    token-by-token recurrence in float64, every gradient included."""
    import triton

    from hybridtron.kernels.gated_delta_rule import chunk_kernels as ck

    for kernel in (ck._state_fwd_kernel, ck._state_bwd_kernel):
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BV": bv}, num_warps=warps, num_stages=1)])
    x = inputs(1, 19, 1, 2, 1, 16, 80, beta_max=2.0, reset_p=0.2, init=True, seed=5)
    got = grads(chunk_gated_delta_rule, x, chunk_size=16)
    want = grads(delta_rule_recurrent, x)
    for name, a, b in zip(["o", "final state", "q", "k", "v", "g", "beta", "initial_state"], got, want,
                          strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11, msg=lambda m, name=name: f"BV {bv}, {name}: {m}")


def test_state_tile_pruning():
    """No candidate wider than the (padded) value head dim is launched; the narrowest is kept whatever Dv is."""
    import triton

    from hybridtron.kernels.gated_delta_rule.chunk_kernels import _prune_state_tiles

    configs = [triton.Config({"BV": bv}) for bv in (16, 32, 64)]
    assert [c.kwargs["BV"] for c in _prune_state_tiles(configs, {}, DV=20)] == [16, 32]
    assert [c.kwargs["BV"] for c in _prune_state_tiles(configs, {}, DV=8)] == [16]
    assert [c.kwargs["BV"] for c in _prune_state_tiles(configs, {}, DV=128)] == [16, 32, 64]


@pytest.mark.parametrize("wrong", ["no_resets", "no_decay"])
def test_the_tolerance_fails_a_kernel_that_drops_resets_or_the_decay(wrong):
    """The comparison can fail: measured against a reference that ignores the documents (or the decay), the
    kernel's outputs and gradients are far outside the tolerance."""
    x = inputs(1, 20, 1, 1, 1, 16, 16, reset_p=0.3, init=True, seed=4)
    assert x["resets"][0, 1:].any()
    names = ["q", "k", "v", "g", "beta", "initial_state"]

    def kernel(*ts):
        return call(chunk_gated_delta_rule, dict(zip(names, ts, strict=True), resets=x["resets"]), chunk_size=16)

    def wrong_ref(*ts):
        y = dict(zip(names, ts, strict=True), resets=None if wrong == "no_resets" else x["resets"])
        if wrong == "no_decay":
            y["g"] = torch.zeros_like(y["g"])
        return call(delta_rule_chunked, y, chunk_size=16)

    with pytest.raises(AssertionError, match="exceeds"):
        check_against_reference("wrong reference", kernel, wrong_ref, [x[n] for n in names], [torch.float32] * 6)


def test_dtypes_and_final_state_flag():
    """o in q's dtype, the state in fp32; without output_final_state the same o and no state."""
    x = inputs(1, 5, 1, 1, 1, 16, 16, init=True)
    x = {n: t if t is None or t.dtype == torch.bool else t.to(torch.bfloat16) for n, t in x.items()}
    o, S = call(chunk_gated_delta_rule, x, chunk_size=16)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 5, 1, 16)
    assert S.dtype == torch.float32 and S.shape == (1, 1, 16, 16)
    o2, none = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16,
                                      initial_state=x["initial_state"])
    assert none is None and torch.equal(o2, o)


def good(B=2, T=5, Hk=1, r=2, n_h=1, Dk=24, Dv=8):
    x = inputs(B, T, Hk, r, n_h, Dk, Dv, reset_p=0.3, init=True)
    return {n: t if t is None or t.dtype == torch.bool else t.float() for n, t in x.items()}


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(2, 5, 24)), r"q has shape \(2, 5, 24\); it must be \(B, T, Hk, Dk\)"),
    (dict(k=torch.zeros(2, 5, 1, 1, 16)), r"k has shape \(2, 5, 1, 1, 16\); it must be .*\(2, 5, n_h, 1, 24\)"),
    (dict(v=torch.zeros(2, 5, 2, 2, 8)), r"v has shape \(2, 5, 2, 2, 8\); it must be .*\(2, 5, 1, Hv, Dv\)"),
    (dict(k=torch.zeros(2, 5, 1, 3, 24), q=torch.zeros(2, 5, 3, 24)), r"v has \d+ value heads and q and k 3 key heads"),
    (dict(g=torch.zeros(2, 5, 1)), r"g has shape \(2, 5, 1\); it must be \(B, T, Hv\) = \(2, 5, 2\)"),
    (dict(beta=torch.zeros(2, 5, 2)), r"beta has shape \(2, 5, 2\); it must be \(B, T, n_h, Hv\) = \(2, 5, 1, 2\)"),
    (dict(resets=torch.zeros(2, 4, dtype=torch.bool)), r"resets is torch.bool of shape \(2, 4\); it must be bool "
                                                       r"of shape \(B, T\) = \(2, 5\)"),
    (dict(resets=torch.zeros(2, 5)), r"resets is torch.float32"),
    (dict(initial_state=torch.zeros(2, 2, 8, 24)), r"initial_state has shape \(2, 2, 8, 24\); it must be "
                                                   r"\(B, Hv, Dk, Dv\) = \(2, 2, 24, 8\)"),
    (dict(q=torch.zeros(2, 5, 1, 24, dtype=torch.long)), r"q is torch.int64"),
    (dict(chunk_size=48), r"chunk_size=48; the kernels take one of \(16, 32, 64\)"),
    (dict(q=torch.zeros(2, 5, 1, 300), k=torch.zeros(2, 5, 1, 1, 300), initial_state=None), r"Dk=300"),
])
def test_bad_inputs_are_refused_by_name(bad, match):
    x = good() | {n: t for n, t in bad.items() if n != "chunk_size"}
    with pytest.raises(ValueError, match=match):
        call(chunk_gated_delta_rule, x, chunk_size=bad.get("chunk_size", 16))


def test_compiles_without_graph_breaks():
    """The custom ops' fake implementations let torch.compile(fullgraph=True) trace forward and backward."""
    x = good(B=1, T=6)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    leaves = [x[n].requires_grad_() for n in names]

    def f(*ts):
        return call(chunk_gated_delta_rule, dict(zip(names, ts, strict=True), resets=x["resets"]), chunk_size=16)

    eager = f(*leaves)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b)
    loss = [o.sum() + 0.5 * S.sum() for o, S in (eager, compiled)]
    for a, b in zip(torch.autograd.grad(loss[0], leaves), torch.autograd.grad(loss[1], leaves), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cu_seqlens_is_the_same_as_resets(backend):
    """Packed sequences as cumulative lengths reset the state where each sequence after the first starts; the
    first continues the initial state."""
    from hybridtron.kernels.gated_delta_rule import gated_delta_rule

    x = {k: (t.float() if t is not None else None) for k, t in inputs(1, 21, 1, 2, 1, 16, 16, init=True).items()}
    cu = torch.tensor([0, 6, 6, 16, 21], dtype=torch.int32)
    resets = torch.zeros(1, 21, dtype=torch.bool)
    resets[0, [6, 16]] = True

    def run(**kw):
        return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                output_final_state=True, chunk_size=16, backend=backend, **kw)

    for a, b in zip(run(cu_seqlens=cu), run(resets=resets), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="in place of resets"):
        run(cu_seqlens=cu, resets=resets)
