"""The fused recurrent gated delta rule (kernels/gated_delta_rule/recurrent.py, the decoding kernel) under the
interpreter against the float64 reference: outputs and final states at tiny and odd shapes (one token and
seven; head dims that are not powers of two; grouped value heads; DeltaProduct sub-steps; beta up to 2; many
short documents; with and without a cached state); decoding token by token through the returned state gives
one pass over the sequence; the tolerance is far below what dropping a reset or the decay changes; bad inputs
are refused by name, and inputs requiring grad are refused (forward only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.kernels.testing import assert_within_reference_error, max_err
from hybridtron.model.delta_rule import delta_rule_recurrent

pytest.importorskip("triton")

from hybridtron.kernels.gated_delta_rule.recurrent import recurrent_gated_delta_rule  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def inputs(B, T, Hk, r, n_h, Dk, Dv, beta_max=1.0, reset_p=0.0, init=False, seed=0):
    """float64 q, k, v, g (log decays in (-inf, 0)), beta in (0, beta_max), resets (a new document at each
    position with probability reset_p; None for 0) and an initial state (or None)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    Hv = Hk * r
    x = dict(q=randn(B, T, Hk, Dk), k=randn(B, T, n_h, Hk, Dk), v=randn(B, T, n_h, Hv, Dv),
             g=F.logsigmoid(randn(B, T, Hv) + 2),  # decays exp(g) mostly in (0.5, 1)
             beta=torch.rand(B, T, n_h, Hv, generator=gen, dtype=torch.float64) * beta_max)
    x["resets"] = torch.rand(B, T, generator=gen) < reset_p if reset_p else None
    x["initial_state"] = randn(B, Hv, Dk, Dv) if init else None
    return x


def cast(x, dtype):
    """The run in ``dtype``: q, k, v and beta in it (the activations); g and the state stay fp32, as a model
    keeps them. dtype float64: everything in float64 (the same rounded values)."""
    low = {"q", "k", "v", "beta"}
    return {n: t if t is None or t.dtype == torch.bool else t.to(dtype if n in low or dtype == torch.float64
                                                                  else torch.float32) for n, t in x.items()}


def run(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], resets=x["resets"], initial_state=x["initial_state"],
              output_final_state=True, **kw)


# (B, T, Hk, r, n_h, Dk, Dv, beta_max, reset_p, init): T=1 is the decode step (from a cached state); Dk/Dv of
# 24 pad to 32 (masks), Dv 24 and 32 span two 16-wide value tiles; r=2 is grouped value attention (with Hk=2,
# so that the key head serving each value head matters); n_h=2 DeltaProduct; beta up to 2 (negative
# eigenvalues); reset_p 0.4 makes documents of ~2.5 tokens.
CASES = [
    (1, 1, 2, 1, 1, 16, 16, 1.0, 0.0, True),
    (2, 1, 1, 2, 2, 24, 24, 2.0, 0.5, True),
    (2, 7, 2, 1, 1, 32, 32, 1.0, 0.4, False),
    (1, 7, 1, 2, 2, 24, 16, 2.0, 0.4, True),
    (2, 7, 2, 2, 1, 16, 24, 2.0, 0.0, True),
    (1, 7, 2, 1, 2, 24, 32, 1.0, 0.0, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hk,r,n_h,Dk,Dv,beta_max,reset_p,init", CASES)
def test_matches_the_float64_reference(dtype, B, T, Hk, r, n_h, Dk, Dv, beta_max, reset_p, init):
    x = cast(inputs(B, T, Hk, r, n_h, Dk, Dv, beta_max, reset_p, init, seed=T * 10 + Dk), dtype)
    o, state = run(recurrent_gated_delta_rule, x)
    o_ref, state_ref = run(delta_rule_recurrent, x)
    o_64, state_64 = run(delta_rule_recurrent, cast(x, torch.float64))
    assert o.dtype == dtype and state.dtype == torch.float32
    assert_within_reference_error("o", o, o_ref, o_64)
    assert_within_reference_error("final state", state, state_ref, state_64)


def test_without_output_final_state_gives_none():
    x = cast(inputs(1, 2, 1, 1, 1, 8, 8, init=True), torch.float32)
    o, state = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])
    assert state is None
    torch.testing.assert_close(o, run(delta_rule_recurrent, x)[0])


@pytest.mark.parametrize("split", [[1] * 7, [4, 1, 2]], ids=["token-by-token", "prefill-then-decode"])
def test_decoding_through_the_state_equals_one_pass(split):
    """Each call's final state is the next call's initial state: the pieces reproduce the whole sequence
    (documents, grouped value heads and DeltaProduct included)."""
    x = cast(inputs(2, 7, 2, 2, 2, 24, 24, beta_max=2.0, reset_p=0.3, init=True, seed=3), torch.float32)
    o_all, state_all = run(recurrent_gated_delta_rule, x)
    state, t0, outs = x["initial_state"], 0, []
    for n in split:
        piece = {name: t if name == "initial_state" else t[:, t0:t0 + n] for name, t in x.items()}
        o, state = run(recurrent_gated_delta_rule, piece | {"initial_state": state})
        outs.append(o)
        t0 += n
    torch.testing.assert_close(torch.cat(outs, 1), o_all)
    torch.testing.assert_close(state, state_all)


@pytest.mark.parametrize("change", ["no resets", "no decay"])
def test_the_tolerance_catches_a_dropped_reset_or_decay(change):
    """A kernel that ignored the document resets or the decay would fail the accuracy rule by far: the
    kernel itself, run without them, lands more than 100 times the allowed error away from the reference."""
    x = cast(inputs(2, 7, 1, 2, 1, 16, 16, reset_p=0.4, init=True, seed=4), torch.float32)
    o, state = run(recurrent_gated_delta_rule, x)
    o_ref, state_ref = run(delta_rule_recurrent, x)
    o_64, state_64 = run(delta_rule_recurrent, cast(x, torch.float64))
    assert_within_reference_error("o", o, o_ref, o_64)  # the right inputs pass ...
    wrong = x | ({"resets": None} if change == "no resets" else {"g": torch.zeros_like(x["g"])})
    o_w, state_w = run(recurrent_gated_delta_rule, wrong)
    for name, out, ref, ref64 in (("o", o_w, o_ref, o_64), ("final state", state_w, state_ref, state_64)):
        with pytest.raises(AssertionError, match="exceeds"):  # ... the wrong ones fail it
            assert_within_reference_error(name, out, ref, ref64)
        allowed = 3 * max_err(ref, ref64) + 4 * torch.finfo(torch.float32).eps * ref64.abs().max().item()
        assert max_err(out, ref64) > 100 * allowed, name


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(2, 3, 2)), r"q has shape \(2, 3, 2\); it must be \(B, T, Hk, Dk\)"),
    (dict(k=torch.zeros(2, 3, 1, 2, 7)), r"k has shape \(2, 3, 1, 2, 7\); it must be .*= \(2, 3, n_h, 2, 8\)"),
    (dict(k=torch.zeros(2, 3, 0, 2, 8)), r"k has shape .* with n_h >= 1"),
    (dict(v=torch.zeros(2, 3, 2, 4, 8)), r"v has shape \(2, 3, 2, 4, 8\); it must be .*= \(2, 3, 1, Hv, Dv\)"),
    (dict(v=torch.zeros(2, 3, 1, 3, 8)), r"v has 3 value heads and q and k 2 key heads"),
    (dict(g=torch.zeros(2, 3, 2)), r"g has shape \(2, 3, 2\); it must be .*= \(2, 3, 4\)"),
    (dict(beta=torch.zeros(2, 3, 4)), r"beta has shape \(2, 3, 4\); it must be .*= \(2, 3, 1, 4\)"),
    (dict(beta=torch.zeros(2, 3, 1, 4, dtype=torch.long)), r"beta is torch.int64; it must be floating point"),
    (dict(resets=torch.zeros(2, 4, dtype=torch.bool)), r"resets is torch.bool of shape \(2, 4\); it must be bool of shape"),
    (dict(resets=torch.zeros(2, 3)), r"resets is torch.float32 of shape \(2, 3\); it must be bool"),
    (dict(initial_state=torch.zeros(2, 4, 8, 5)), r"initial_state has shape \(2, 4, 8, 5\); it must be .*= \(2, 4, 8, 6\)"),
])
def test_bad_inputs_are_refused_by_name(bad, match):
    args = dict(q=torch.zeros(2, 3, 2, 8), k=torch.zeros(2, 3, 1, 2, 8), v=torch.zeros(2, 3, 1, 4, 6),
                g=torch.zeros(2, 3, 4), beta=torch.zeros(2, 3, 1, 4), resets=None, initial_state=None) | bad
    with pytest.raises(ValueError, match=match):
        recurrent_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"], resets=args["resets"],
                                   initial_state=args["initial_state"])


@pytest.mark.parametrize("arg", ["q", "v", "initial_state"])
def test_inputs_requiring_grad_are_refused_but_run_under_no_grad(arg):
    x = cast(inputs(1, 1, 1, 1, 1, 8, 8, init=True), torch.float32)
    x[arg] = x[arg].requires_grad_()
    with pytest.raises(RuntimeError, match="forward only .* use the chunked gated delta rule kernel or the reference"):
        run(recurrent_gated_delta_rule, x)
    with torch.no_grad():  # decoding with a model's parameters: fine
        o, _ = run(recurrent_gated_delta_rule, x)
    with torch.no_grad():
        torch.testing.assert_close(o, run(delta_rule_recurrent, x)[0])


def test_compiles_without_graph_breaks():
    """The custom op's fake implementation lets torch.compile(fullgraph=True) trace a decode step."""
    x = cast(inputs(1, 1, 1, 2, 1, 8, 8, reset_p=0.5, init=True, seed=5), torch.float32)
    eager = run(recurrent_gated_delta_rule, x)
    compiled = torch.compile(lambda x: run(recurrent_gated_delta_rule, x), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)
