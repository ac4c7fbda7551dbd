"""Gated attention's Triton kernel (no gate) under flash-attention's own accuracy rule, on a grid in the manner of
flash-attention's tests/test_flash_attn.py (``test_flash_attn_output``, ``test_flash_attn_varlen_output``).

The rule, for the output and each input gradient, on bf16 inputs:

    max|ours - ref_fp32| <= 2 * max|ref_bf16 - ref_fp32| + 1e-5

ref_fp32 is the plain softmax attention computed in float32 on the same bf16 inputs, and ref_bf16 the same
computed in bf16 with the scale moved from q to k (flash-attention's ``attention_ref(upcast=False,
reorder_ops=True)``); both come back in bf16, as flash-attention's do (their gradients flow to bf16 leaves).

The grid: causal self-attention (equal query and key lengths); 6 query heads over 6 (MHA), 2 (GQA) or 1 (MQA) kv
heads; head dims 32 to 128 with the odd 40, 59 and 111; lengths 1 to 339 in batch rows, and packed documents
(cu_seqlens, flash-attn's varlen) -- 216 cases.

What it caught: Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even), so every
bf16 rounding of the kernels -- the probabilities and dS fed to the dot products, the stored outputs and
gradients -- was biased by up to a whole ulp under the interpreter, twice the GPU's error. 4 of the 216 cases
failed the rule (dq in three, dk in one, 1.19-2.00x the bound) and 122 more sat exactly on it; the kernels now round
to nearest under the interpreter too (`triton_kernels._round`, `_dot_rounded`; the GPU's code is unchanged), and all
216 pass, the four at 0.5x. The CI runs the failing cases and a spread of the others (`CI_CASES`, about half a
minute); the whole grid is opt-in (``HYBRIDTRON_FULL_GRID=1``, about 40 minutes on 2 cores).
"""

from __future__ import annotations

import itertools
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated (read at decoration)

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridtron.kernels import backend  # noqa: E402
from hybridtron.kernels.gated_attention import gated_attention  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not (backend.triton_installed() and backend.interpreter_requested()),
    reason="needs triton and TRITON_INTERPRET=1 (the dev extra installs triton)",
)

HEADS = 6
KV_HEADS = {"mha": 6, "gqa": 2, "mqa": 1}
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128)
# name: (batch rows, length) -- each row one document -- or the document lengths of one packed sequence (varlen)
LAYOUTS = {
    "T1": (2, 1), "T17": (2, 17), "T64": (2, 64), "T113": (2, 113), "T203": (1, 203), "T339": (1, 339),
    "docs_a": (113, 1, 96, 129), "docs_b": (1, 2, 3, 57, 200, 76), "docs_c": (17, 64, 31, 15, 80, 2),
}
GRID = [f"d{d}-{mha}-{layout}" for d, mha, layout in itertools.product(HEAD_DIMS, KV_HEADS, LAYOUTS)]

# The CI's share of the grid (about half a minute): every case that failed before the fix, and a spread of the others
# (MHA / GQA / MQA, the odd head dims, lengths 1, 17, 64, 203, 339, documents). (case, query heads or None for all):
# where a case's failure sat in some heads, only those run, with their kv heads -- the kernel's results for them are
# bit for bit the whole case's (heads are independent programs; compared when this list was made), the bound can only
# be tighter, and a head of a 339-token case costs a sixth of it.
CI_CASES = [
    ("d40-mha-T339", (3,)),  # failed: dq 1.19x the bound (head 3: dk, dv 1.5x)
    ("d80-mha-T339", (2,)),  # failed: dq 1.19x (head 2: dk 1.44x)
    ("d111-gqa-T64", (0, 1, 2)),  # failed: dq 2.00x (kv head 0's group)
    ("d128-mqa-T203", None),  # failed: dk 1.20x (MQA: dk sums every head, all run)
    ("d32-mha-T1", None),
    ("d59-gqa-T17", None),
    ("d32-mqa-docs_c", None),
]


def _ci_id(ci) -> str:
    case, heads = ci
    return case if heads is None else f"{case}:h{','.join(map(str, heads))}"


def _fa_reference(q, k, v, cu: list[int], upcast: bool, reorder_ops: bool) -> torch.Tensor:
    """flash-attention's attention_ref, causal, per document of the packed (N, H, D) q: in float32 (``upcast``) or
    in the inputs' dtype; ``reorder_ops`` scales k instead of q (same math, other roundings). Returns q's dtype."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    outs = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        qs, ks, vs = q[s:e], k[s:e], v[s:e]
        scores = torch.einsum("thd,shd->hts", qs, ks * scale) if reorder_ops else \
            torch.einsum("thd,shd->hts", qs * scale, ks)
        future = torch.ones(e - s, e - s, dtype=torch.bool).triu(1)
        p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).to(vs.dtype)
        outs.append(torch.einsum("hts,shd->thd", p, vs))
    return torch.cat(outs).to(dtype)


def errors_and_bounds(case: str, heads: tuple[int, ...] | None = None) -> dict[str, tuple[float, float]]:
    """{out, dq, dk, dv: (max|ours - ref_fp32|, 2 max|ref_bf16 - ref_fp32| + 1e-5)} of one grid case, or of the
    case's query ``heads`` only, with the kv heads they read (the same number of them from each)."""
    d_name, mha, layout = case.split("-")
    d = int(d_name[1:])
    spec = LAYOUTS[layout]
    g = torch.Generator().manual_seed(d * 101 + 7 * list(KV_HEADS).index(mha) + list(LAYOUTS).index(layout))
    if layout.startswith("T"):  # (B, T, H, D), each row a document
        B, T = spec
        lead, cu, kw = (B, T), list(range(0, B * T + 1, T)), {}
    else:  # packed (N, H, D) with cu_seqlens
        cu = [0, *itertools.accumulate(spec)]
        lead, kw = (cu[-1],), {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    q, k, v, dout = (torch.randn(*lead, n, d, generator=g).to(torch.bfloat16)
                     for n in (HEADS, KV_HEADS[mha], KV_HEADS[mha], HEADS))
    if heads is not None:
        group = HEADS // KV_HEADS[mha]
        kv = sorted({h // group for h in heads})
        assert list(heads) == sorted(heads) and len(heads) % len(kv) == 0, heads
        assert [h // group for h in heads] == [j for j in kv for _ in range(len(heads) // len(kv))], heads
        q, dout, k, v = q[..., heads, :], dout[..., heads, :], k[..., kv, :], v[..., kv, :]
    N = cu[-1]

    def run(fn):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        return [out.detach(), *torch.autograd.grad(out, xs, dout)]

    def reference(upcast, reorder_ops):
        def fn(q, k, v):
            flat = (t.reshape(N, *t.shape[-2:]) for t in (q, k, v))
            return _fa_reference(*flat, cu, upcast, reorder_ops).view(q.shape)
        return fn

    ours = run(lambda q, k, v: gated_attention(q, k, v, backend="triton", **kw))
    ref32 = run(reference(True, False))
    ref16 = run(reference(False, True))
    result = {}
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref32, ref16, strict=True):
        assert a.dtype == r.dtype == p.dtype == torch.bfloat16, name
        err = (a.float() - r.float()).abs().max().item()
        result[name] = (err, 2 * (p.float() - r.float()).abs().max().item() + 1e-5)
    return result


def _check(case: str, heads: tuple[int, ...] | None = None) -> None:
    result = errors_and_bounds(case, heads)
    bad = {n: eb for n, eb in result.items() if not eb[0] <= eb[1]}
    assert not bad, f"{_ci_id((case, heads))}: " + ", ".join(
        f"{n} max error {e:.3e} > 2 x the bf16 reference's + 1e-5 = {b:.3e} ({e / b:.2f}x)" for n, (e, b) in bad.items())


if backend.triton_installed():
    import triton
    import triton.language as tl

    from hybridtron.kernels.gated_attention import triton_kernels as _tk

    @triton.jit
    def _rounding_kernel(X, EYE, Y, Z, DOT, n, BLOCK: tl.constexpr):
        """fp32 X to bf16 Y and fp32 Z through `_round`'s interpreter path; DOT: X's (BLOCK / 16, 16) rows times the
        bf16 identity through `_dot_rounded`'s, which is X rounded to bf16, in fp32."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + i, mask=i < n)
        tl.store(Y + i, _tk._round(x, Y.dtype.element_ty, True), mask=i < n)
        tl.store(Z + i, _tk._round(x, Z.dtype.element_ty, True), mask=i < n)
        rows = tl.program_id(0) * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
        cols = tl.arange(0, 16)
        tile = rows[:, None] * 16 + cols[None, :]
        a = tl.load(X + tile, mask=tile < n, other=0.0)
        eye = tl.load(EYE + cols[:, None] * 16 + cols[None, :])
        tl.store(DOT + tile, _tk._dot_rounded(a, eye, "ieee", True), mask=tile < n)


def test_grid_and_ci_cases():
    assert len(GRID) == len(set(GRID)) == 216
    assert {case for case, _ in CI_CASES} <= set(GRID)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy on inf and NaN
def test_interpreter_bf16_rounding_is_to_nearest_even():
    """The kernels' bf16 rounding under the interpreter (`_round`, `_dot_rounded`) against torch's (to nearest,
    ties to even), bit for bit, on random fp32 bit patterns below 2^111 in magnitude, ties and near-ties, zeros;
    inf and NaN pass; fp32 passes through untouched. (The interpreter's own cast, truncating, gets about half of
    these wrong. fp32 subnormals are left out: the interpreter converts those wrongly either way, at magnitudes
    below 1.2e-38.)"""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    near = torch.randn(1 << 12, generator=g).to(torch.bfloat16).float().view(torch.int32) + 0x8000
    near = near + torch.randint(-2, 3, near.shape, generator=g, dtype=torch.int32)  # ties, and 1-2 fp32 ulps off
    specials = torch.tensor([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8, 2.0**110 * 1.7, float("inf"), -float("inf"),
                             float("nan")])
    x = torch.cat([bits.view(torch.float32), near.view(torch.float32), specials])
    finite = torch.isfinite(x)
    x = x[~finite | (x == 0) | ((x.abs() >= torch.finfo(torch.float32).tiny) & (x.abs() < 2.0**111))]
    n = x.numel()
    y = torch.empty(n, dtype=torch.bfloat16)
    z, dot = torch.empty_like(x), torch.full_like(x, 7.0)
    eye = torch.eye(16, dtype=torch.bfloat16)
    _rounding_kernel[(triton.cdiv(n, 4096),)](x, eye, y, z, dot, n, BLOCK=4096)
    want = x.to(torch.bfloat16)
    nan, finite = torch.isnan(x), torch.isfinite(x)
    assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.isnan(y[nan]).all() and nan.any()
    assert torch.equal(z[~nan], x[~nan])
    clean = torch.cat([finite, finite.new_ones(-n % 16)]).view(-1, 16).all(1).repeat_interleave(16)[:n]
    assert clean.sum() > n // 2 and torch.equal(dot[clean], want[clean].float())  # rows with inf or NaN: NaN


@needs_interpreter
@pytest.mark.parametrize("ci", CI_CASES, ids=_ci_id)
def test_flash_attn_rule(ci):
    _check(*ci)


if os.environ.get("HYBRIDTRON_FULL_GRID") == "1":  # opt-in, not collected otherwise (about 40 min on 2 cores):
    # HYBRIDTRON_FULL_GRID=1 python -m pytest -p no:xdist tests/kernels/test_attention_fa_rule.py
    @needs_interpreter
    @pytest.mark.parametrize("case", [c for c in GRID if (c, None) not in CI_CASES])
    def test_flash_attn_rule_full_grid(case):
        _check(case)
