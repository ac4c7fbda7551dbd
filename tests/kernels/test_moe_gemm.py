"""MoE expert kernels (kernels/moe_gemm) under the interpreter against the float64 reference: the gathered grouped
GEMM's output and the gradients of the token rows and of every expert's weight (an empty expert, one expert with
every token, top-1 and top-2, widths and row counts that are not tile multiples, more experts than a power of two),
in float64, fp32 and bf16; the packed SwiGLU against the dense SwiGLU's reference and kernel, on rows that are a
strided view; no host reads; bad arguments refused by name; the custom ops' registrations."""

from __future__ import annotations

import pytest
import torch

from hybridtron.kernels.moe_gemm import (
    gathered_linear,
    gathered_linear_reference,
    swiglu_packed,
    swiglu_packed_reference,
)
from hybridtron.kernels.moe_permute import sort_assignments
from hybridtron.kernels.swiglu import swiglu

from .helpers import assert_compiled_matches_eager, check_against_reference

pytest.importorskip("triton")


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def plan(flat: torch.Tensor, E: int):
    """order, pos and the int32 running counts (offsets) of the flat expert choices, as MoE.forward makes them."""
    order, pos = sort_assignments(flat)
    counts = torch.zeros(E, dtype=torch.int64).scatter_add(0, flat, torch.ones_like(flat))
    return order, pos, counts.cumsum(0).to(torch.int32)


def choices(N: int, k: int, E: int, seed: int = 0, only: int | None = None) -> torch.Tensor:
    """(N k,) distinct experts per token from the first E - 1 (the last expert gets no rows); ``only``: every
    token's first choice is that expert (with k = 1: one expert holds every row)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])
    if only is not None:
        idx[:, 0] = only
    return idx.flatten()


# (N, d, out, k, E, only): rows N k = 74 and 19 (not multiples of the 16-row tile), d and out not multiples
# of 16, nine experts (the tile map pads them to 16), top-1 with one expert holding every row (four row tiles).
CASES = [(37, 40, 36, 2, 5, None), (19, 24, 48, 1, 9, None), (53, 32, 20, 1, 4, 2), (11, 17, 33, 2, 3, None)]
IDS = ["top2-E5", "top1-E9", "top1-one-expert-has-all", "top2-E3-odd-widths"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gathered_linear_float64_equals_reference(case):
    N, d, out, k, E, only = case
    order, pos, offsets = plan(choices(N, k, E, seed=1, only=only), E)
    x, w = randn(N, d, seed=2).requires_grad_(), randn(E, out, d, seed=3, scale=d ** -0.5).requires_grad_()
    y = gathered_linear(x, order, pos, k, w, offsets, backend="triton")
    ref = gathered_linear_reference(x, order, k, w, offsets)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    dy = randn(*y.shape, seed=4)
    grads = torch.autograd.grad(y, (x, w), dy)
    for a, b in zip(grads, torch.autograd.grad(ref, (x, w), dy), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(grads[1][E - 1], torch.zeros(out, d, dtype=torch.float64))  # the expert without rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[:3], ids=IDS[:3])
def test_gathered_linear_within_reference_error(case, dtype):
    N, d, out, k, E, only = case
    order, pos, offsets = plan(choices(N, k, E, seed=5, only=only), E)
    check_against_reference(
        f"gathered_linear[{dtype}]",
        lambda x, w: gathered_linear(x, order, pos, k, w, offsets, backend="triton"),
        lambda x, w: gathered_linear_reference(x, order, k, w, offsets),
        [randn(N, d, seed=6), randn(E, out, d, seed=7, scale=d ** -0.5)], [dtype, dtype])


def test_gathered_linear_with_no_tokens_and_the_reference_backend():
    E = 3
    order, pos, offsets = plan(torch.zeros(0, dtype=torch.int64), E)
    x, w = torch.zeros(0, 8, requires_grad=True), torch.randn(E, 6, 8, requires_grad=True)
    y = gathered_linear(x, order, pos, 2, w, offsets, backend="triton")
    assert y.shape == (0, 6)
    (y.sum() + 0 * w.sum()).backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))
    # backend="reference" is the reference function itself
    order, pos, offsets = plan(choices(5, 2, E, seed=8), E)
    x = randn(5, 8, seed=9)
    torch.testing.assert_close(gathered_linear(x, order, pos, 2, w.double(), offsets, backend="reference"),
                               gathered_linear_reference(x, order, 2, w.double(), offsets), rtol=0, atol=0)


def test_gathered_linear_reads_nothing_back_to_the_host(monkeypatch):
    """The launchers size the grid from the shapes alone: the per-expert offsets stay on the device (here any
    .tolist() or .item() of a tensor would raise)."""
    order, pos, offsets = plan(choices(21, 2, 6, seed=10), 6)
    x, w = randn(21, 16, seed=11).requires_grad_(), randn(6, 32, 16, seed=12).requires_grad_()

    def refuse(*a, **k):
        raise AssertionError("a device-to-host read in the gathered GEMM")

    with monkeypatch.context() as m:
        for name in ("tolist", "item"):
            m.setattr(torch.Tensor, name, refuse)
        y = gathered_linear(x, order, pos, 2, w, offsets, backend="triton")
        y.pow(2).sum().backward()
    torch.testing.assert_close(y, gathered_linear_reference(x, order, 2, w, offsets), rtol=1e-12, atol=1e-12)


def test_bad_arguments_are_refused_by_name():
    order, pos, offsets = plan(choices(4, 2, 3), 3)
    x, w = torch.zeros(4, 8), torch.zeros(3, 6, 8)
    with pytest.raises(ValueError, match=r"weight \(3, 6, 7\) \(E, out, d\) with the same d"):
        gathered_linear(x, order, pos, 2, w[..., :7], offsets, backend="triton")
    with pytest.raises(ValueError, match=r"N \* top_k = 4 \* 1 assignments"):
        gathered_linear(x, order, pos, 1, w, offsets, backend="triton")
    with pytest.raises(ValueError, match=r"running row count of each of the 3 experts"):
        gathered_linear(x, order, pos, 2, w, offsets[:2], backend="triton")
    with pytest.raises(ValueError, match=r"cast the weight to the rows' dtype"):
        gathered_linear(x, order, pos, 2, w.double(), offsets, backend="triton")
    with pytest.raises(ValueError, match=r"\(rows, 2 \* hidden\)"):
        swiglu_packed(torch.zeros(3, 5), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_packed_within_reference_error(dtype):
    check_against_reference(f"swiglu_packed[{dtype}]", lambda h: swiglu_packed(h, backend="triton"),
                            swiglu_packed_reference, [randn(45, 2 * 40, seed=13)], [dtype])


def test_swiglu_packed_is_the_dense_swiglu_on_strided_halves_without_copies():
    """The gate_up projection's output (rows, 2 I) as it lies, here a column slice of a wider tensor (row stride
    3 I): the same bits as the dense SwiGLU kernel on the two halves made contiguous, and one (rows, 2 I)
    gradient equal to the dense kernel's two."""
    wide = randn(29, 3 * 24, seed=14).to(torch.bfloat16)
    h = wide[:, :48].requires_grad_()
    assert not h.is_contiguous()
    y = swiglu_packed(h, backend="triton")
    gate, up = (t.detach().contiguous().requires_grad_() for t in h.chunk(2, -1))
    dense = swiglu(gate, up, backend="triton")
    assert torch.equal(y, dense)
    dy = randn(*y.shape, seed=15).to(torch.bfloat16)
    (dh,) = torch.autograd.grad(y, h, dy)
    dg, du = torch.autograd.grad(dense, (gate, up), dy)
    assert torch.equal(dh, torch.cat([dg, du], -1))
    torch.testing.assert_close(swiglu_packed(h.detach().double(), backend="triton"),
                               swiglu_packed_reference(h.detach().double()), rtol=1e-14, atol=1e-15)
    assert swiglu_packed(torch.zeros(0, 8), backend="triton").shape == (0, 4)


def test_custom_op_registrations():
    """torch's opcheck (schema, fake implementation, AOT dispatch) on each op, as the tiny models' opcheck does for
    the other kernels."""
    order, pos, offsets = plan(choices(7, 2, 4, seed=16), 4)
    x, w, h = randn(7, 16, seed=17).float(), randn(4, 32, 16, seed=18).float(), randn(14, 32, seed=19).float()
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    ops = torch.ops.hybridtron
    for op, args in ((ops.moe_grouped_mm, (x, order, w, offsets, 2, True)),
                     (ops.moe_grouped_mm, (h, None, w, offsets, 1, False)),
                     (ops.moe_grouped_wgrad, (h, x, order, offsets, 2)),
                     (ops.moe_swiglu_fwd, (h,)),
                     (ops.moe_swiglu_bwd, (h[:, :16].contiguous(), h))):
        torch.library.opcheck(op, args, test_utils=utils)


def test_compiles_without_graph_breaks():
    order, pos, offsets = plan(choices(9, 2, 4, seed=20), 4)
    x, w = randn(9, 16, seed=21).float().requires_grad_(), randn(4, 32, 16, seed=22).float().requires_grad_()

    def f(x, w):
        return swiglu_packed(gathered_linear(x, order, pos, 2, w, offsets, backend="triton"), backend="triton")

    assert_compiled_matches_eager(f, x, w)
