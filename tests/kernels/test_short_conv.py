"""Short causal depthwise convolution + SiLU (kernels/short_conv) under the interpreter against the float64
reference: outputs and the gradients of x, the filter and the decoding inputs (past) at tiny and odd shapes,
documents included; bad inputs refused by name; and the tiny_hybrid model with the Triton convolution gives
the reference backend's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import load_config
from hybridtron.kernels.short_conv import short_conv, short_conv_reference
from hybridtron.model.lm import GatedLM

from .helpers import assert_same_loss_and_grads, check_against_reference

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def docs(B, T, p, seed=0):
    """(B, T) document ids with a new document starting at each position with probability p."""
    return torch.cumsum(torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < p, 1)


# (B, T, C, K): one position; T over two program groups (the interpreter walks chunks of 4 rows, 4 chunks a
# program) and not a multiple of either; C over two channel blocks of 128; K = 3, 2 and 1 (no past rows at all).
SHAPES = [(1, 1, 3, 4), (2, 19, 5, 4), (1, 18, 130, 4), (1, 37, 9, 3), (3, 17, 6, 2), (2, 5, 3, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,K", SHAPES)
@pytest.mark.parametrize("mode", ["plain", "docs", "past", "docs+past"])
def test_short_conv(dtype, B, T, C, K, mode):
    x, w = randn(B, T, C, seed=1), randn(C, 1, K, seed=2) * 0.5
    inputs, dts = [x, w], [dtype, dtype]
    ids = docs(B, T, 0.4, seed=3) if "docs" in mode else None  # many short documents (mean length 2.5)
    if "past" in mode:
        inputs.append(randn(B, K - 1, C, seed=4))
        dts.append(dtype)
    check_against_reference(
        f"short_conv[{mode}]",
        lambda x, w, *p: short_conv(x, w, ids, p[0] if p else None, backend="triton"),
        lambda x, w, *p: short_conv_reference(x, w, ids, p[0] if p else None),
        inputs, dts)
    if mode == "docs+past" and K > 1:  # past feeds x's first document, so the check above compared real gradients
        p = inputs[2].to(dtype).requires_grad_()
        short_conv(x.to(dtype), w.to(dtype), ids, p, backend="triton").sum().backward()
        assert p.grad[:, -1].abs().min() > 0  # the last past row feeds position 0 (always x's first document)


def test_every_position_its_own_document_reads_only_itself():
    """doc_ids all different: out[t] = silu(w[K-1] x[t]) for t > 0, nothing from its neighbours or past;
    position 0 continues the cached document and reads past."""
    x, w, p = randn(2, 9, 4, seed=5), randn(4, 1, 4, seed=6), randn(2, 3, 4, seed=7)
    ids = torch.arange(18).view(2, 9)
    out = short_conv(x, w, ids, p, backend="triton")
    torch.testing.assert_close(out[:, 1:], torch.nn.functional.silu(x[:, 1:] * w[:, 0, -1]))
    torch.testing.assert_close(out[:, :1], short_conv(x[:, :1], w, past=p, backend="triton"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("prefix_ids", [[1] * 6, [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]],
                         ids=["one_doc", "doc_starts_at_the_window", "doc_starts_inside_the_window"])
def test_past_continues_the_first_document(backend, prefix_ids):
    """One pass over [prefix ; x] equals a pass over x with past = the prefix's last K-1 inputs, those of
    other documents than x's first zeroed (what the decoding cache keeps): x's first document continues the
    prefix's last one; later documents of x read nothing before their start."""
    K, C = 4, 5
    prefix, x, w = randn(2, 6, C, seed=13), randn(2, 7, C, seed=14), randn(C, 1, K, seed=15)
    pre_ids = torch.tensor([prefix_ids] * 2)
    ids = torch.tensor([[1, 1, 2, 2, 2, 3, 3], [1] * 7])  # row 1: one document throughout
    whole = short_conv(torch.cat([prefix, x], 1), w, torch.cat([pre_ids, ids], 1), backend=backend)
    past = prefix[:, -(K - 1):] * (pre_ids[:, -(K - 1):] == ids[:, :1])[..., None]
    torch.testing.assert_close(short_conv(x, w, ids, past, backend=backend), whole[:, 6:])


def test_decoding_one_token_at_a_time_equals_the_whole_sequence():
    """past carries the last K-1 inputs: T=1 steps reproduce one pass over the sequence."""
    x, w = randn(2, 7, 5, seed=8), randn(5, 1, 4, seed=9)
    whole = short_conv(x, w, backend="triton")
    past = x.new_zeros(2, 3, 5)
    for t in range(7):
        step = short_conv(x[:, t:t + 1], w, past=past, backend="triton")
        torch.testing.assert_close(step, whole[:, t:t + 1])
        past = torch.cat([past, x[:, t:t + 1]], 1)[:, 1:]


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(2, 5)), r"x has shape \(2, 5\); it must be \(B, T, C\)"),
    (dict(weight=torch.zeros(3, 4)), r"weight has shape \(3, 4\); it must be \(3, 1, K\)"),
    (dict(doc_ids=torch.zeros(2, 4, dtype=torch.long)), r"doc_ids .* it must be integer document ids of shape \(2, 5\)"),
    (dict(doc_ids=torch.zeros(2, 5)), r"doc_ids is torch.float32"),
    (dict(past=torch.zeros(2, 2, 3)), r"past has shape \(2, 2, 3\); it must be \(2, 3, 3\)"),
])
def test_bad_inputs_are_refused_by_name(bad, match):
    args = dict(x=torch.zeros(2, 5, 3), weight=torch.zeros(3, 1, 4), doc_ids=None, past=None) | bad
    with pytest.raises(ValueError, match=match):
        short_conv(args["x"], args["weight"], args["doc_ids"], args["past"], backend="triton")


def test_wider_filters_go_to_the_reference_or_are_refused():
    """The Triton kernel carries a window of K-1 <= 3 rows: auto takes the reference for K = 5, triton says why."""
    x, w = randn(1, 6, 3, seed=10), randn(3, 1, 5, seed=11)
    torch.testing.assert_close(short_conv(x, w, backend="auto"), short_conv_reference(x, w))
    with pytest.raises(ValueError, match="filter widths 1-4, not 5"):
        short_conv(x, w, backend="triton")


def hybrid(conv_backend: str) -> GatedLM:
    cfg = load_config("tiny_hybrid").model
    cfg.n_layers, cfg.layer_pattern = 2, "LA"  # one Gated DeltaNet layer and one attention layer suffice
    cfg.kernels.conv = conv_backend
    torch.manual_seed(0)
    model = GatedLM(cfg, 64)
    model.init_weights()
    return model


def test_tiny_hybrid_with_the_triton_conv_matches_the_reference_backend():
    ref, tri = hybrid("reference"), hybrid("triton")
    tri.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 21), generator=g)
    g_tri = assert_same_loss_and_grads(ref, tri, ids, torch.roll(ids, -1, 1), docs(2, 21, 0.15, seed=2))
    assert g_tri["layers.0.linear_attn.conv1d.weight"].abs().sum() > 0


def test_compiles_without_graph_breaks():
    """The custom ops' fake implementations let torch.compile(fullgraph=True) trace forward and backward."""
    x, w, p = (t.float().requires_grad_() for t in (randn(2, 6, 4, seed=10), randn(4, 1, 4, seed=11),
                                                     randn(2, 3, 4, seed=12)))
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])

    def f(x, w, p):
        return short_conv(x, w, ids, p, backend="triton")

    eager = f(x, w, p)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, p)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(eager.sum(), (x, w, p)), torch.autograd.grad(compiled.sum(), (x, w, p)),
                    strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cu_seqlens_is_the_same_as_doc_ids(backend):
    """Packed sequences given as cumulative lengths (an empty one included) are the documents doc_ids give; the
    cache continues the first; a batch of rows or both forms at once are refused."""
    gen = torch.Generator().manual_seed(7)
    x, w, past = torch.randn(1, 19, 6, generator=gen), torch.randn(6, 1, 4, generator=gen), torch.randn(1, 3, 6)
    cu = torch.tensor([0, 5, 5, 12, 19], dtype=torch.int32)
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 7])
    got = short_conv(x, w, past=past, cu_seqlens=cu, backend=backend)
    torch.testing.assert_close(got, short_conv(x, w, ids, past, backend=backend), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one packed row"):
        short_conv(x.expand(2, -1, -1), w, cu_seqlens=cu, backend=backend)
    with pytest.raises(ValueError, match="rise from 0 to the packed length T=19"):
        short_conv(x, w, cu_seqlens=torch.tensor([0, 5, 18]), backend=backend)
