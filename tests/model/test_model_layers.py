"""Norm, rotary and attention checked against formulas written out here, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtron.configs import ModelConfig
from hybridtron.model import GatedAttention, RMSNorm, RotaryEmbedding, apply_rotary, doc_causal_mask


@pytest.fixture(autouse=True)
def float64_default():
    # Tolerances here are float64 ones; restore the default so other test files are unaffected.
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32, rope_theta=100.0)
    base.update(kw)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_matches_formula(zero_centered):
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-5, zero_centered=zero_centered)
    assert torch.all(norm.weight == (0.0 if zero_centered else 1.0))
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 6)
    w = norm.weight.detach()
    gain = 1 + w if zero_centered else w
    expected = torch.empty_like(x)
    for i in range(3):
        for j in range(5):
            v = x[i, j]
            expected[i, j] = v / math.sqrt(float((v * v).sum()) / 6 + 1e-5) * gain
    torch.testing.assert_close(norm(x), expected)


def test_rmsnorm_low_precision_input_is_computed_in_fp32():
    torch.manual_seed(0)
    norm = RMSNorm(64, zero_centered=True).float()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 64, dtype=torch.float32) * 30
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    # One bf16 rounding of the output (rel 2^-8) plus the input's own rounding.
    torch.testing.assert_close(y.float(), norm(x.bfloat16().float()), rtol=2**-7, atol=1e-2)


# ---------------------------------------------------------------- rotary


def rotate_by_pairs(x: torch.Tensor, pos: int, rot_dim: int, theta: float) -> torch.Tensor:
    """One head vector x (D,) at position pos: pair (i, i + rot/2) turned by an explicit 2x2 matrix."""
    out = x.clone()
    half = rot_dim // 2
    for i in range(half):
        a = pos * theta ** (-2 * i / rot_dim)
        r = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
        out[[i, i + half]] = r @ x[[i, i + half]]
    return out


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_rotary_matches_explicit_rotations(fraction):
    torch.manual_seed(0)
    D, T, theta = 16, 7, 50.0
    rope = RotaryEmbedding(D, fraction, max_seq_len=10, theta=theta).double()
    rot = int(D * fraction)
    x = torch.randn(2, T, 3, D)  # (B, T, H, D)
    y = apply_rotary(x, *rope(T))
    for b in range(2):
        for t in range(T):
            for h in range(3):
                torch.testing.assert_close(y[b, t, h], rotate_by_pairs(x[b, t, h], t, rot, theta))
    assert torch.equal(y[..., rot:], x[..., rot:])  # the tail is passed through bit for bit


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    D, T = 8, 12
    rope = RotaryEmbedding(D, 0.5, max_seq_len=T, theta=100.0).double()
    q, k = torch.randn(D), torch.randn(D)
    qs = apply_rotary(q.expand(1, T, 1, D), *rope(T))[0, :, 0]  # q placed at every position
    ks = apply_rotary(k.expand(1, T, 1, D), *rope(T))[0, :, 0]

    def score(m, n):
        return qs[m] @ ks[n]

    for delta in (0, 1, 3):
        ref = score(delta, 0)
        for m in range(delta, T):
            torch.testing.assert_close(score(m, m - delta), ref)
    assert not torch.allclose(score(3, 0), score(4, 0))  # the position does matter


def test_rotary_refuses_positions_beyond_table():
    rope = RotaryEmbedding(8, 1.0, max_seq_len=4, theta=10.0)
    rope(4)
    with pytest.raises(ValueError, match="max_seq_len=4"):
        rope(5)


def test_rotary_rejects_odd_rotated_width():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(6, 0.5, max_seq_len=4, theta=10.0)


# ---------------------------------------------------------------- attention


def reference_attention(attn: GatedAttention, cfg: ModelConfig, x: torch.Tensor, allowed) -> torch.Tensor:
    """Written from the spec with the module's weights: repeat kv heads, naive softmax per query."""
    B, T, _ = x.shape
    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim()
    rot = int(D * cfg.rotary_fraction)
    q_all = x @ attn.q_proj.weight.T
    if cfg.attn_gate == "elementwise":
        per_head = q_all.view(B, T, H, 2 * D)  # Qwen3-Next layout: [query | gate] per head
        q, gate = per_head[..., :D], per_head[..., D:]
    else:
        q = q_all.view(B, T, H, D)
    k = (x @ attn.k_proj.weight.T).view(B, T, KV, D)
    v = (x @ attn.v_proj.weight.T).view(B, T, KV, D)

    def rms(t, w):
        g = 1 + w if cfg.norm_type == "rmsnorm_zero_centered" else w
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * g

    if cfg.qk_norm:
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q = torch.stack([torch.stack([rotate_by_pairs(q[b, t, h], t, rot, cfg.rope_theta) for h in range(H)])
                     for b in range(B) for t in range(T)]).view(B, T, H, D)
    k = torch.stack([torch.stack([rotate_by_pairs(k[b, t, h], t, rot, cfg.rope_theta) for h in range(KV)])
                     for b in range(B) for t in range(T)]).view(B, T, KV, D)
    k = k.repeat_interleave(H // KV, dim=2)  # query head h reads kv head h // (H / KV)
    v = v.repeat_interleave(H // KV, dim=2)

    out = torch.zeros(B, T, H, D)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [s for s in range(T) if allowed(b, s, t)]
                scores = torch.stack([q[b, t, h] @ k[b, s, h] for s in keys]) / math.sqrt(D)
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                out[b, t, h] = sum(p[i] * v[b, s, h] for i, s in enumerate(keys))
    if cfg.attn_gate == "elementwise":
        out = out * torch.sigmoid(gate)
    elif cfg.attn_gate == "headwise":
        out = out * torch.sigmoid(x @ attn.gate_proj.weight.T)[..., None]
    return out.reshape(B, T, H * D) @ attn.o_proj.weight.T


def random_attention(cfg: ModelConfig) -> GatedAttention:
    attn = GatedAttention(cfg).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5)  # norm gains too, so a wrong gain form would show
    return attn


def rotary_for(cfg: ModelConfig):
    return RotaryEmbedding(cfg.resolved_head_dim(), cfg.rotary_fraction, cfg.max_seq_len, cfg.rope_theta).double()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(attn_gate="elementwise"),
        dict(attn_gate="headwise"),
        dict(attn_gate="none"),
        dict(attn_gate="elementwise", qk_norm=False, rotary_fraction=0.5, norm_type="rmsnorm_zero_centered"),
        dict(attn_gate="headwise", n_kv_heads=1, rotary_fraction=0.25),
        dict(attn_gate="none", n_kv_heads=4),
    ],
    ids=["elementwise", "headwise", "none", "elementwise-partial-zc", "headwise-mqa", "none-mha"],
)
def test_attention_matches_naive_causal_reference(overrides):
    torch.manual_seed(0)
    cfg = tiny_cfg(**overrides)
    attn, rope = random_attention(cfg), rotary_for(cfg)
    x = torch.randn(2, 6, cfg.d_model)
    expected = reference_attention(attn, cfg, x, lambda b, s, t: s <= t)
    torch.testing.assert_close(attn(x, *rope(6)), expected)


@pytest.mark.parametrize("gate", ["elementwise", "headwise", "none"])
def test_attention_with_doc_mask_matches_block_diagonal_reference(gate):
    torch.manual_seed(0)
    cfg = tiny_cfg(attn_gate=gate)
    attn, rope = random_attention(cfg), rotary_for(cfg)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 7]])
    x = torch.randn(2, 7, cfg.d_model)
    expected = reference_attention(attn, cfg, x, lambda b, s, t: s <= t and doc_ids[b, s] == doc_ids[b, t])
    torch.testing.assert_close(attn(x, *rope(7), doc_causal_mask(doc_ids)), expected)


def test_doc_causal_mask_layout():
    mask = doc_causal_mask(torch.tensor([[3, 3, 4]]))
    expected = torch.tensor([[True, False, False], [True, True, False], [False, False, True]])
    assert mask.shape == (1, 1, 3, 3) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)


def test_gate_parameter_shapes():
    d, H, KV, D = 16, 4, 2, 8
    ew = GatedAttention(tiny_cfg(attn_gate="elementwise"))
    hw = GatedAttention(tiny_cfg(attn_gate="headwise"))
    ng = GatedAttention(tiny_cfg(attn_gate="none"))
    assert ew.q_proj.weight.shape == (H * 2 * D, d) and not hasattr(ew, "gate_proj")
    assert hw.q_proj.weight.shape == (H * D, d) and hw.gate_proj.weight.shape == (H, d)
    assert ng.q_proj.weight.shape == (H * D, d) and not hasattr(ng, "gate_proj")
    assert ew.k_proj.weight.shape == ew.v_proj.weight.shape == (KV * D, d)
