"""Gathered sparse attention (kernels/hax_attention) under the interpreter against the float64 reference:
outputs and the gradients of q, k and v at tiny and odd shapes (empty slots, a query with no key at all, a value
width over several tiles); the reference itself against a dense masked softmax; bad inputs refused by name."""

from __future__ import annotations

import pytest
import torch

from hybridtron.kernels.hax_attention import hax_attention, hax_attention_reference

from .helpers import check_against_reference

pytest.importorskip("triton")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def random_lists(B, T, L, S, seed=0, empty=0.3):
    """(B, T, S) distinct key positions per query (a random permutation's first S), a fraction left empty (-1)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(L, generator=g)[:S] for _ in range(T)]) for _ in range(B)])
    return idx.masked_fill(torch.rand(B, T, S, generator=g) < empty, -1)


# (B, T, L, S, D, E): one query; S not a power of two; the value width over several tiles (E > 8192 / BS); keys
# from a longer cache than the queries (L > T).
SHAPES = [(1, 1, 3, 2, 4, 5), (2, 7, 9, 5, 8, 6), (1, 4, 40, 33, 3, 300), (2, 3, 12, 12, 16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,L,S,D,E", SHAPES)
def test_hax_attention_matches_reference(dtype, B, T, L, S, D, E):
    q, k, v = randn(B, T, D, seed=1), randn(B, L, D, seed=2), randn(B, L, E, seed=3)
    idx = random_lists(B, T, L, min(S, L), seed=4)
    idx[0, 0] = -1  # a query with no key: zeros, and no gradient to anything
    check_against_reference(
        "hax_attention",
        lambda q, k, v: hax_attention(q, k, v, idx, 0.7, backend="triton"),
        lambda q, k, v: hax_attention_reference(q, k, v, idx, 0.7),
        [q, k, v], [dtype] * 3)


def test_reference_is_a_masked_dense_softmax():
    """The gathered form equals dense attention whose mask allows exactly each query's listed keys."""
    B, T, L, S, D, E = 2, 6, 10, 4, 5, 3
    q, k, v = randn(B, T, D, seed=5), randn(B, L, D, seed=6), randn(B, L, E, seed=7)
    idx = random_lists(B, T, L, S, seed=8)
    idx[1, 2] = -1
    allowed = torch.zeros(B, T, L + 1, dtype=torch.bool)
    allowed.scatter_(2, idx.where(idx >= 0, L), True)
    allowed = allowed[..., :L]
    logits = (q @ k.transpose(1, 2) * 0.5).masked_fill(~allowed, float("-inf"))
    dense = torch.nan_to_num(torch.softmax(logits, -1)) @ v
    torch.testing.assert_close(hax_attention_reference(q, k, v, idx, 0.5), dense)
    assert hax_attention_reference(q, k, v, idx, 0.5)[1, 2].abs().max() == 0


def test_duplicate_free_gradients_reach_only_listed_keys():
    q, k, v = randn(1, 3, 4, seed=9), randn(1, 8, 4, seed=10).requires_grad_(), randn(1, 8, 2, seed=11).requires_grad_()
    idx = torch.tensor([[[0, 2, -1], [2, 5, -1], [-1, -1, 5]]])
    hax_attention(q, k, v, idx, backend="triton").sum().backward()
    touched = torch.zeros(8, dtype=torch.bool)
    touched[[0, 2, 5]] = True
    assert (v.grad[0].abs().sum(-1) > 0).equal(touched)
    assert k.grad[0, ~touched].abs().max() == 0


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, i: (q[0], k, v, i), "3-D"),
    (lambda q, k, v, i: (q, k[..., :2], v, i), "must be"),
    (lambda q, k, v, i: (q, k, v, i.float()), "integer key positions"),
])
def test_bad_inputs_are_refused(bad, match):
    q, k, v = randn(1, 2, 3), randn(1, 4, 3), randn(1, 4, 5)
    idx = torch.zeros(1, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        hax_attention(*bad(q, k, v, idx), backend="reference")


def hax_model(backend: str):
    from hybridtron.configs import load_config
    from hybridtron.model.lm import GatedLM

    cfg = load_config("tiny_hax").model
    cfg.n_layers, cfg.d_model, cfg.deltanet.sparse_keys = 1, 64, 8  # one mixer; 8 keys of up to 21: sparse
    cfg.kernels.hax = backend
    torch.manual_seed(0)
    model = GatedLM(cfg, 64)
    model.init_weights()
    return model.eval()  # (training adds the ranking loss on a random key sample; the kernel is not in it)


@pytest.mark.slow
def test_tiny_hax_with_the_triton_kernel_matches_the_reference_backend():
    from .helpers import assert_same_loss_and_grads

    ref, tri = hax_model("reference"), hax_model("triton")
    tri.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 21), generator=g)
    docs = torch.tensor([[0] * 8 + [1] * 13, [0] * 21])
    g_tri = assert_same_loss_and_grads(ref, tri, ids, torch.roll(ids, -1, 1), docs)
    assert g_tri["layers.0.linear_attn.hax.qk_proj.weight"].abs().sum() > 0


def test_compiles_without_graph_breaks():
    """The custom ops' fake implementations let torch.compile(fullgraph=True) trace forward and backward."""
    q, k, v = (t.float().requires_grad_() for t in (randn(1, 5, 4, seed=12), randn(1, 7, 4, seed=13),
                                                     randn(1, 7, 3, seed=14)))
    idx = random_lists(1, 5, 7, 3, seed=15)
    fn = torch.compile(lambda q, k, v: hax_attention(q, k, v, idx, backend="triton"), fullgraph=True, backend="aot_eager")
    fn(q, k, v).sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    hax_attention_reference(q, k, v, idx, 4 ** -0.5).sum().backward()
    for w, t in zip(want, (q, k, v), strict=True):
        torch.testing.assert_close(w, t.grad)


@pytest.mark.parametrize("op", ["hax_attention_fwd", "hax_attention_bwd"])
def test_custom_op_registration(op):
    """torch's opcheck (schema, autograd registration, fake implementation, AOT dispatch) on the arguments the
    tiny_hax mixer passes: fp32 q/k/v, int32 key lists with empty slots, a cache longer than the queries."""
    q, k, v = randn(2, 5, 4, seed=16).float(), randn(2, 9, 4, seed=17).float(), randn(2, 9, 6, seed=18).float()
    idx = random_lists(2, 5, 9, 4, seed=19).to(torch.int32)
    args = (q, k, v, idx, 0.5) if op.endswith("fwd") else (randn(2, 5, 6, seed=20).float(), q, k, v, idx, 0.5)
    torch.library.opcheck(getattr(torch.ops.hybridtron, op).default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_bench_hax_runs_at_tiny_shapes(capsys):
    from hybridtron.bench.bench_hax import main

    res = main(["--device", "cpu", "--seq", "12", "--keys", "4", "--dim", "4", "--value-dim", "6", "--dtype", "fp32",
                "--backends", "reference", "triton", "--repeats", "1"])
    assert res["select_ms"] > 0 and res["triton_fwd_bwd_ms"] > 0 and res["reference_fwd_ms"] > 0
    assert res["gathered_gb_fwd"] == 12 * 4 * 10 * 4 / 1e9
    with pytest.raises(SystemExit):
        main(["--keys", "1"])
