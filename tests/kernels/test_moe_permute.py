"""MoE token permute / unpermute (kernels/moe_permute) under the interpreter against the float64 reference:
outputs and the gradients of the token rows, the expert outputs and the combine weights, at tiny and odd
shapes (one token, N k not a multiple of the row tile, d over several strips, experts with no tokens);
bad plans refused by name; and the tiny_moe model with the Triton permute gives the reference backend's
loss and gradients."""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import load_config
from hybridtron.kernels.moe_permute import (
    moe_permute,
    moe_unpermute,
    permute_reference,
    sort_assignments,
    unpermute_reference,
)
from hybridtron.model.lm import GatedLM

from .helpers import assert_compiled_matches_eager, assert_same_loss_and_grads, check_against_reference

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def top_k_experts(N, k, E, seed=0):
    """(N k,) distinct experts per token, drawn from the first E - 1 of E experts: the last expert gets none."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)]).flatten()


# (N, d, k, E): one token; N k = 39 and 150 rows (not multiples of the row tile); d = 300 spans two strips
# of 256; top-1; in every case the last expert has no tokens.
SHAPES = [(1, 5, 2, 4), (13, 7, 3, 6), (75, 33, 2, 9), (6, 300, 2, 3), (10, 16, 1, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,d,k,E", SHAPES)
def test_permute(dtype, N, d, k, E):
    order, pos = sort_assignments(top_k_experts(N, k, E, seed=1))
    check_against_reference(
        "moe_permute",
        lambda x: moe_permute(x, order, pos, k, backend="triton"),
        lambda x: permute_reference(x, order, k),
        [randn(N, d, seed=2)], [dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,d,k,E", SHAPES)
def test_unpermute(dtype, N, d, k, E):
    order, pos = sort_assignments(top_k_experts(N, k, E, seed=3))
    w = randn(N, k, seed=5).softmax(-1)
    check_against_reference(
        "moe_unpermute",
        lambda ys, w: moe_unpermute(ys, order, pos, w, k, backend="triton"),
        lambda ys, w: unpermute_reference(ys, order, w, k),
        [randn(N * k, d, seed=4), w], [dtype, torch.float32])


def test_permute_then_unpermute_with_unit_weights_sums_each_token_k_times():
    order, pos = sort_assignments(top_k_experts(9, 3, 5, seed=6))
    x = randn(9, 11, seed=7)
    xs = moe_permute(x, order, pos, 3, backend="triton")
    assert torch.equal(xs, x[order // 3])  # a gather is exact
    y = moe_unpermute(xs, order, pos, torch.ones(27, dtype=torch.float64), 3, backend="triton")
    torch.testing.assert_close(y, 3 * x)


def test_bad_plans_are_refused_by_name():
    order, pos = sort_assignments(top_k_experts(4, 2, 5))
    x, ys, w = torch.zeros(4, 3), torch.zeros(8, 3), torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"5 rows of tokens, but 8 assignments at top_k=2 need 4"):
        moe_permute(torch.zeros(5, 3), order, pos, 2, backend="triton")
    with pytest.raises(ValueError, match=r"order is torch.float32 .* 1-d integer tensor"):
        moe_permute(x, order.float(), pos, 2, backend="triton")
    with pytest.raises(ValueError, match=r"order \(8,\) and pos \(6,\) must have the same length"):
        moe_unpermute(ys, order, pos[:6], w, 2, backend="triton")
    with pytest.raises(ValueError, match=r"weights is torch.float32 \(4, 1\); it must hold one float per assignment"):
        moe_unpermute(ys, order, pos, w[:, :1], 2, backend="triton")
    with pytest.raises(ValueError, match=r"ys has shape \(8,\)"):
        moe_unpermute(ys[:, 0], order, pos, w, 2, backend="triton")


def moe_lm(moe_backend: str) -> GatedLM:
    cfg = load_config("tiny_moe").model
    cfg.n_layers, cfg.d_model, cfg.moe.expert_hidden = 2, 32, 32  # one dense layer, one MoE layer
    cfg.kernels.moe = moe_backend
    torch.manual_seed(0)
    model = GatedLM(cfg, 64)
    model.init_weights()
    return model


def test_tiny_moe_with_the_triton_permute_matches_the_reference_backend():
    ref, tri = moe_lm("reference"), moe_lm("triton")
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))
    g_tri = assert_same_loss_and_grads(ref, tri, ids, torch.roll(ids, -1, 1))
    assert g_tri["layers.1.mlp.gate.weight"].abs().sum() > 0  # the router learns through the combine weights


def test_compiles_without_graph_breaks():
    """The custom ops' fake implementations let torch.compile(fullgraph=True) trace forward and backward."""
    flat = top_k_experts(6, 2, 4, seed=8)
    x, w = randn(6, 5, seed=9).float().requires_grad_(), randn(6, 2, seed=10).float().requires_grad_()

    def f(x, w):
        order, pos = sort_assignments(flat)
        xs = moe_permute(x, order, pos, 2, backend="triton")
        return moe_unpermute(xs * xs, order, pos, w, 2, backend="triton")

    assert_compiled_matches_eager(f, x, w)
