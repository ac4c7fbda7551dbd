"""Every Triton kernel under the interpreter against its float64 reference, at tiny and odd shapes: outputs and
the gradients of all inputs, with the error bound set by the reference's own error in the same dtype."""

from __future__ import annotations

import pytest
import torch

from hybridtron.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from hybridtron.kernels.norm import rms_norm, rms_norm_reference
from hybridtron.kernels.rotary import rotary_qk, rotary_qk_reference
from hybridtron.kernels.swiglu import swiglu, swiglu_reference
from hybridtron.model.scale import md_vector

from .helpers import check_against_reference

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]
F32 = torch.float32


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# ---- RMSNorm -----------------------------------------------------------------------------------------------
# (leading shape, D): one row (T = 1), odd widths, a row block that is partly past the end, and more row
# blocks than the backward's persistent programs (300 rows of 8: 5 blocks of 64 over 4 programs).
NORM_SHAPES = [((1, 1), 7), ((2, 5), 33), ((3,), 130), ((300,), 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,D", NORM_SHAPES)
@pytest.mark.parametrize("form", ["plain", "zero_centered", "gainless", "magnitude_direction"])
def test_rms_norm(dtype, lead, D, form):
    x = randn(*lead, D, seed=1)
    if form == "magnitude_direction":  # the gain is built by autograd from (m, d): gradients reach both
        m, d = randn(1, seed=2).abs() + 0.5, randn(D, seed=3)
        check_against_reference(
            f"rms_norm[{form}]",
            lambda x, m, d: rms_norm(x, md_vector(m, d), 1e-6, backend="triton"),
            lambda x, m, d: rms_norm_reference(x, md_vector(m, d), 1e-6),
            [x, m, d], [dtype, F32, F32])
        return
    w = None if form == "gainless" else randn(D, seed=2) * 0.3 + (0.0 if form == "zero_centered" else 1.0)
    offset = 1.0 if form == "zero_centered" else 0.0
    inputs, dts = ([x], [dtype]) if w is None else ([x, w], [dtype, F32])
    check_against_reference(
        f"rms_norm[{form}]",
        lambda x, *w: rms_norm(x, w[0] if w else None, 1e-6, offset=offset, backend="triton"),
        lambda x, *w: rms_norm_reference(x, w[0] if w else None, 1e-6, offset),
        inputs, dts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,D", NORM_SHAPES)
def test_rms_norm_residual(dtype, lead, D):
    """The residual add fused in: both outputs (norm and the new stream) and the gradients of x, residual and
    w. The stream is fp32 while the branch output is in the compute dtype, as under autocast."""
    x, r, w = randn(*lead, D, seed=4), randn(*lead, D, seed=5) * 2, randn(D, seed=6) * 0.3
    check_against_reference(
        "rms_norm[residual, zero-centred]",
        lambda x, r, w: rms_norm(x, w, 1e-5, offset=1.0, residual=r, backend="triton"),
        lambda x, r, w: rms_norm_reference(x, w, 1e-5, 1.0, r),
        [x, r, w], [dtype, F32, F32])


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("lead,D", [((2, 5), 33), ((300,), 8)])
def test_rms_norm_writes_the_autocast_dtype(residual, lead, D):
    """out_dtype: an fp32 stream normalised straight into bf16 (what each projection's autocast cast would
    round it to), the new stream h staying fp32; the gradients come back through the bf16 output."""
    x, r, w = randn(*lead, D, seed=4), randn(*lead, D, seed=5) * 2, randn(D, seed=6) * 0.3
    bf = torch.bfloat16

    def ours(x, w, *r):
        return rms_norm(x, w, 1e-5, offset=1.0, residual=r[0] if r else None, out_dtype=bf, backend="triton")

    def ref(x, w, *r):
        return rms_norm_reference(x, w, 1e-5, 1.0, r[0] if r else None, out_dtype=bf)

    inputs, dts = ([x, w, r], [F32, F32, F32]) if residual else ([x, w], [F32, F32])
    check_against_reference("rms_norm[out bf16]", ours, ref, inputs, dts)
    y = ours(*(t.float() for t in inputs))
    y = y[0] if residual else y
    assert y.dtype == bf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,D", [((1, 1, 2), 8), ((2, 3, 3), 12), ((70,), 5)])
def test_gated_rms_norm(dtype, lead, D):
    """norm(o) * silu(z), the delta-rule mixer's output norm: gradients of o, z and w."""
    o, z, w = randn(*lead, D, seed=7), randn(*lead, D, seed=8) * 2, randn(D, seed=9) * 0.3 + 1
    check_against_reference(
        "rms_norm[gated]",
        lambda o, z, w: rms_norm(o, w, 1e-6, z=z, backend="triton"),
        lambda o, z, w: rms_norm_reference(o, w, 1e-6, z=z),
        [o, z, w], [dtype, dtype, F32])


# ---- rotary (+ QK-norm) ------------------------------------------------------------------------------------
# (B, T, H, KV, D, rot): T = 1 with all channels rotated, partial rotary with odd head counts, a quarter
# rotated (Qwen3.5's fraction) with 8 pass-through channels.
ROTARY_SHAPES = [(1, 1, 3, 1, 8, 8), (2, 5, 3, 1, 10, 6), (1, 3, 4, 2, 16, 4)]


def _tables(T, rot, seed=10):
    ang = randn(T, rot // 2, seed=seed) * 3
    return ang.cos().float(), ang.sin().float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
@pytest.mark.parametrize("norm", ["none", "plain", "zero_centered", "gainless"])
def test_rotary_qk(dtype, shape, norm):
    B, T, H, KV, D, rot = shape
    cos, sin = _tables(T, rot)
    # q arrives as a strided view of the fused [query | gate] projection, as in gated attention.
    qg, k = randn(B, T, H, 2 * D, seed=11), randn(B, T, KV, D, seed=12)
    kw = dict(norm=norm != "none", offset=1.0 if norm == "zero_centered" else 0.0, eps=1e-6)
    if norm in ("plain", "zero_centered"):
        qw, kw_ = randn(D, seed=13) * 0.3 + 1, randn(D, seed=14) * 0.3 + 1
        inputs, dts = [qg, k, qw, kw_], [dtype, dtype, F32, F32]
    else:
        inputs, dts = [qg, k], [dtype, dtype]

    def run(fn, backend):
        def f(qg, k, *w):
            c, s = (cos, sin) if qg.dtype != torch.float64 else (cos.double(), sin.double())
            extra = dict(q_weight=w[0], k_weight=w[1]) if w else {}
            args = dict(backend=backend) if backend else {}
            return fn(qg[..., :D], k, c, s, **kw, **extra, **args)
        return f

    check_against_reference(f"rotary_qk[{norm}]", run(rotary_qk, "triton"), run(rotary_qk_reference, None),
                            inputs, dts)


# ---- SwiGLU ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (1031,), (2, 3, 5), (3, 700)])
def test_swiglu(dtype, shape):
    g, u = randn(*shape, seed=15) * 2, randn(*shape, seed=16)
    check_against_reference("swiglu", lambda g, u: swiglu(g, u, backend="triton"), swiglu_reference, [g, u],
                            [dtype, dtype])


# ---- fused linear + cross-entropy --------------------------------------------------------------------------
# (N, d, V, chunk, z_loss, labels): one row; chunks that do not divide N with masked rows; the default chunk;
# a vocabulary over two of the kernel's 4096-wide blocks; a single counted row among ignored ones; many chunks.
CE_CASES = [
    (1, 8, 5, 0, 0.0, "all"),
    (13, 16, 37, 4, 0.0, "some_masked"),
    (20, 12, 70, 0, 1e-3, "some_masked"),
    (3, 8, 4100, 2, 1e-4, "all"),
    (9, 8, 33, 4, 1e-2, "one_counted"),
    (24, 8, 50, 1, 0.0, "some_masked"),  # one row per chunk: dW rounded to its dtype 24 times
]


def _labels(N, V, kind, seed=17):
    lab = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed))
    if kind == "some_masked":
        lab[::3] = -100
    elif kind == "one_counted":
        lab[:] = -100
        lab[N // 2] = V - 1
    return lab


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CE_CASES)
def test_linear_cross_entropy(dtype, case):
    N, d, V, chunk, z, kind = case
    h, w, lab = randn(N, d, seed=18), randn(V, d, seed=19) * 0.5, _labels(N, V, kind)
    check_against_reference(
        f"linear_cross_entropy[{case}]",
        lambda h, w, lab: linear_cross_entropy(h, w, lab, z_loss=z, chunk_size=chunk, backend="triton"),
        lambda h, w, lab: linear_cross_entropy_reference(h, w, lab, z_loss=z),
        [h, w, lab], [dtype, dtype, None])


def test_cross_entropy_no_grad_skips_the_gradient_and_nothing_counted_is_nan():
    h, w = randn(5, 8, seed=20).float(), randn(11, 8, seed=21).float()
    lab = _labels(5, 11, "all")
    with torch.no_grad():
        got = linear_cross_entropy(h, w, lab, backend="triton")
    assert torch.allclose(got, linear_cross_entropy_reference(h, w, lab), rtol=1e-5)
    lab[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, lab, backend="triton"))
    assert torch.isnan(linear_cross_entropy_reference(h, w, lab))


def test_bad_shapes_are_named():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\); it must be \(8,\)"):
        rms_norm(x, torch.ones(7), backend="triton")
    with pytest.raises(ValueError, match="gate .* and up .* must have the same shape"):
        swiglu(x, torch.randn(2, 9), backend="triton")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(x, torch.randn(5, 8), torch.zeros(3, dtype=torch.long), backend="triton")
    with pytest.raises(ValueError, match="must be \\(T=3, rot/2\\)"):
        rotary_qk(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.ones(4, 2), torch.ones(4, 2),
                  backend="triton")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_magnitude_direction_gain_saves_no_extra_activations_on_the_kernel(backend):
    """The reparameterised gain reaches the norm as one (D,) vector: what backward keeps beyond the plain
    gain's norm is a few vectors, never another activation-sized tensor."""
    from hybridtron.model.norm import RMSNorm

    D, x = 128, randn(8, 32, 128, seed=3).float()

    def saved_bytes(norm):
        norm.kernel_backend = backend
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            norm(x.clone().requires_grad_(True)).sum()
        return sum(sizes)

    plain = saved_bytes(RMSNorm(D))
    extra = saved_bytes(RMSNorm(D, magnitude_direction=True)) - plain
    assert plain >= x.numel() * 4  # the hook sees the norm's own activations
    assert 0 <= extra <= 8 * D * 4, extra  # a few (D,) vectors (m, d, their norm), far below one activation
