"""The two delta-rule references against a direct float64 formula and against each other.

The direct formula is written here with explicit matrices, token by token and head by head:
S <- (I - beta k k^T) exp(g) S + beta k v^T, o = S^T q / sqrt(Dk), with q, k L2-normalised.
"""

from __future__ import annotations

import pytest
import torch

from hybridtron.model.delta_rule import delta_rule_chunked, delta_rule_recurrent


def make_inputs(B=2, T=7, Hk=2, Hv=2, Dk=5, Dv=3, n_h=1, beta_max=1.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    q, k, v = r(B, T, Hk, Dk), r(B, T, n_h, Hk, Dk), r(B, T, n_h, Hv, Dv)
    gate = -torch.nn.functional.softplus(r(B, T, Hv)) * 0.5  # log decay <= 0
    beta = beta_max * torch.sigmoid(r(B, T, n_h, Hv))
    return q, k, v, gate, beta


def direct(q, k, v, gate, beta, resets=None, S0=None):
    """Explicit float64 matrices, one head and one token at a time."""
    B, T, n_h, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    out = torch.zeros(B, T, Hv, Dv, dtype=torch.float64)
    finals = torch.zeros(B, Hv, Dk, Dv, dtype=torch.float64)
    eye = torch.eye(Dk, dtype=torch.float64)
    for b in range(B):
        for h in range(Hv):
            hk = h // r
            S = torch.zeros(Dk, Dv, dtype=torch.float64) if S0 is None else S0[b, h].double().clone()
            for t in range(T):
                if resets is not None and resets[b, t]:
                    S = torch.zeros(Dk, Dv, dtype=torch.float64)
                S = torch.exp(gate[b, t, h].double()) * S
                for j in range(n_h):
                    kk = k[b, t, j, hk].double()
                    kk = kk / torch.sqrt(kk @ kk + 1e-6)
                    bt = beta[b, t, j, h].double()
                    S = (eye - bt * torch.outer(kk, kk)) @ S + bt * torch.outer(kk, v[b, t, j, h].double())
                qq = q[b, t, hk].double()
                qq = qq / torch.sqrt(qq @ qq + 1e-6)
                out[b, t, h] = S.T @ qq / Dk**0.5
            finals[b, h] = S
    return out, finals


@pytest.mark.parametrize("n_h", [1, 2])
@pytest.mark.parametrize("Hk, Hv", [(2, 2), (1, 2)])
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_recurrent_and_chunked_match_the_direct_formula(n_h, Hk, Hv, beta_max):
    q, k, v, gate, beta = make_inputs(T=9, Hk=Hk, Hv=Hv, n_h=n_h, beta_max=beta_max)
    S0 = torch.randn(2, Hv, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    resets = torch.zeros(2, 9, dtype=torch.bool)
    resets[0, 4] = resets[1, 1] = resets[1, 2] = True
    want, want_S = direct(q, k, v, gate, beta, resets, S0)
    for fn, kw in ((delta_rule_recurrent, {}), (delta_rule_chunked, {"chunk_size": 4})):
        o, S = fn(q, k, v, gate, beta, resets=resets, initial_state=S0, output_final_state=True, **kw)
        torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S, want_S, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T, chunk", [(1, 8), (7, 8), (37, 8), (37, 16), (16, 16)])
@pytest.mark.parametrize("n_h", [1, 2])
@pytest.mark.parametrize("with_resets", [False, True])
def test_chunked_equals_recurrent_forward_and_gradients_float64(T, chunk, n_h, with_resets):
    q, k, v, gate, beta = make_inputs(B=2, T=T, Hk=1, Hv=2, n_h=n_h, beta_max=2.0, seed=T)
    S0 = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    resets = (torch.rand(2, T, generator=torch.Generator().manual_seed(3)) < 0.2) if with_resets else None
    leaves = [q, k, v, gate, beta, S0]
    grads, outs = [], []
    for fn, kw in ((delta_rule_recurrent, {}), (delta_rule_chunked, {"chunk_size": chunk})):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        o, S = fn(*xs[:5], resets=resets, initial_state=xs[5], output_final_state=True, **kw)
        torch.manual_seed(5)
        w = torch.randn_like(o)
        ws = torch.randn_like(S)
        ((o * w).sum() + (S * ws).sum()).backward()
        outs.append((o.detach(), S.detach()))
        grads.append([x.grad for x in xs])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], *grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=f"grad of {name}")


def test_chunked_float32_error_is_that_of_the_recurrence():
    """In fp32 both forms differ from the float64 truth by rounding only: the chunked form's error is
    within a small multiple of the recurrence's own (the kernels' tolerance rule)."""
    q, k, v, gate, beta = make_inputs(B=1, T=200, Hk=2, Hv=4, Dk=16, Dv=16, beta_max=2.0, seed=1)
    truth, _ = delta_rule_recurrent(q, k, v, gate, beta)
    f32 = [x.float() for x in (q, k, v, gate, beta)]
    err_rec = (delta_rule_recurrent(*f32)[0].double() - truth).abs().max().item()
    err_chunk = (delta_rule_chunked(*f32, chunk_size=64)[0].double() - truth).abs().max().item()
    assert err_rec < 1e-4
    assert err_chunk <= 5 * err_rec + 1e-6, (err_chunk, err_rec)


def test_resets_equal_running_each_document_alone():
    q, k, v, gate, beta = make_inputs(B=1, T=20, Hk=2, Hv=2)
    bounds = [0, 6, 7, 15, 20]
    resets = torch.zeros(1, 20, dtype=torch.bool)
    resets[0, bounds[1:-1]] = True
    packed, _ = delta_rule_chunked(q, k, v, gate, beta, resets=resets, chunk_size=8)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        alone, _ = delta_rule_chunked(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b], chunk_size=8)
        torch.testing.assert_close(packed[:, a:b], alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fn", [delta_rule_recurrent, delta_rule_chunked])
def test_initial_state_continues_a_split_sequence(fn):
    q, k, v, gate, beta = make_inputs(B=2, T=23, n_h=2, beta_max=2.0)
    kw = {"chunk_size": 8} if fn is delta_rule_chunked else {}
    full, S_full = fn(q, k, v, gate, beta, output_final_state=True, **kw)
    t = 10
    first, S = fn(q[:, :t], k[:, :t], v[:, :t], gate[:, :t], beta[:, :t], output_final_state=True, **kw)
    second, S2 = fn(q[:, t:], k[:, t:], v[:, t:], gate[:, t:], beta[:, t:], initial_state=S,
                    output_final_state=True, **kw)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S2, S_full, rtol=1e-10, atol=1e-12)


def test_output_dtype_follows_q_and_state_is_fp32():
    q, k, v, gate, beta = (x.to(torch.bfloat16) for x in make_inputs(T=5))
    o, S = delta_rule_chunked(q, k, v, gate, beta, output_final_state=True, chunk_size=4)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
