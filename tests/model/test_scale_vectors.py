"""Scale vectors (model.scale): the scaled projection and magnitude-direction formulas, exact folding into
the plain layout under each switch and all together, placement, init, the weight-decay rule, training."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hybridtron.configs import ModelConfig, TrainConfig
from hybridtron.configs.model import ScaleVectorConfig
from hybridtron.model import GatedLM
from hybridtron.model.lm import OUT_PROJ_NAMES
from hybridtron.model.scale import ScaledLinear, fold_scale_vectors
from hybridtron.train.optim import build_optimizer, param_groups

V = 64
SWITCHES = {
    "branch_specific": dict(branch_specific=True),
    "two_sided": dict(two_sided=True),
    "magnitude_direction": dict(magnitude_direction=True),
    "all": dict(branch_specific=True, two_sided=True, magnitude_direction=True, decay_rule=True),
}


def tiny_cfg(scale: dict | None = None, **kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64)
    base.update(kw)
    return ModelConfig(scale=ScaleVectorConfig(**(scale or {})), **base)


def build(cfg: ModelConfig, seed: int = 0, dtype=torch.float64) -> GatedLM:
    model = GatedLM(cfg, V)
    torch.manual_seed(seed)
    model.init_weights()
    return model.to(dtype)


def md(m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The magnitude-direction vector written out: m * d / ||d||_2 * sqrt(n), in float64."""
    d = d.double()
    return m.double() * d / d.pow(2).sum().sqrt() * math.sqrt(d.numel())


@torch.no_grad()
def randomise_vectors(model: torch.nn.Module, seed: int = 5) -> None:
    """Every 1-D parameter (scales, magnitudes, directions, norm gains) away from its init."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.ndim == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=g, dtype=p.dtype))


# ---------------------------------------------------------------- formulas


@pytest.mark.parametrize("magnitude_direction", [False, True])
@pytest.mark.parametrize("sides", [(True, False), (False, True), (True, True)])
def test_scaled_linear_is_diag_out_w_diag_in(sides, magnitude_direction):
    lin = ScaledLinear(6, 5, in_scale=sides[0], out_scale=sides[1], magnitude_direction=magnitude_direction).double()
    randomise_vectors(lin)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    W = lin.weight.detach()

    def vec(name, n):
        if name not in lin.scale_names:
            return torch.ones(n, dtype=torch.float64)
        if magnitude_direction:
            return md(getattr(lin, f"{name}_m").detach(), getattr(lin, f"{name}_d").detach())
        return getattr(lin, name).detach()

    s_in, s_out = vec("in_scale", 6), vec("out_scale", 5)
    expected = torch.einsum("o,oi,i,bti->bto", s_out, W, s_in, x)
    torch.testing.assert_close(lin(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.folded_state(W)["weight"], s_out[:, None] * W * s_in[None, :], rtol=1e-12, atol=0)


def test_magnitude_direction_value_init_and_gradients():
    lin = ScaledLinear(7, 3, in_scale=True, out_scale=False, magnitude_direction=True).double()
    assert torch.equal(lin.in_scale_m, torch.ones(1, dtype=torch.float64))  # init: s = all ones
    x = torch.randn(4, 7, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    with torch.no_grad():
        lin.in_scale_m.fill_(1.7)
        lin.in_scale_d.copy_(torch.tensor([0.3, -1.2, 2.0, 0.5, 0.9, -0.1, 1.4], dtype=torch.float64))
    s = md(lin.in_scale_m.detach(), lin.in_scale_d.detach())
    assert s.pow(2).sum().item() == pytest.approx(1.7**2 * 7)  # ||s|| = m sqrt(n): m is the magnitude
    torch.testing.assert_close(lin(x), (x * s) @ lin.weight.T.detach(), rtol=1e-12, atol=1e-12)
    lin(x).pow(2).sum().backward()
    assert lin.in_scale_m.grad.abs().item() > 0
    assert lin.in_scale_d.grad.abs().sum().item() > 0
    # The value does not depend on ||d||, so the direction's gradient is orthogonal to d.
    assert abs(torch.dot(lin.in_scale_d.grad, lin.in_scale_d.detach()).item()) < 1e-9


def test_magnitude_direction_norm_gain_formula():
    model = build(tiny_cfg(dict(magnitude_direction=True), n_layers=1))
    norm = model.norm
    with torch.no_grad():
        norm.weight_m.fill_(0.8)
        norm.weight_d.copy_(torch.linspace(0.5, 2.0, 32, dtype=torch.float64))
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(norm(x), x / rms * md(norm.weight_m.detach(), norm.weight_d.detach()))


# ---------------------------------------------------------------- folding


def _assert_fold_exact(cfg: ModelConfig) -> None:
    model = build(cfg)
    randomise_vectors(model)
    folded = fold_scale_vectors(model)
    plain_cfg = replace(cfg, scale=ScaleVectorConfig())
    plain = GatedLM(plain_cfg, V).double()
    plain.load_state_dict(folded, strict=True)  # the exact plain key set, nothing extra
    assert all(type(m) is torch.nn.Linear for m in plain.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    ref = model(x)
    assert not torch.allclose(ref, build(plain_cfg)(x))  # the randomised vectors do change the function
    torch.testing.assert_close(plain(x), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm_type", ["rmsnorm", "rmsnorm_zero_centered"])
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_folded_model_gives_the_same_logits(switch, norm_type):
    _assert_fold_exact(tiny_cfg(SWITCHES[switch], norm_type=norm_type, tie_embeddings=False))


@pytest.mark.parametrize("gate,qk_norm", [("elementwise", False), ("headwise", True), ("headwise", False),
                                          ("none", True)])
def test_fold_exact_for_every_gate_and_qk_norm(gate, qk_norm):
    _assert_fold_exact(tiny_cfg(SWITCHES["all"], attn_gate=gate, qk_norm=qk_norm))


@pytest.mark.parametrize("switch", ["branch_specific", "all"])
def test_fold_exact_with_gated_deltanet(switch):
    _assert_fold_exact(tiny_cfg(SWITCHES[switch], layer_pattern="LA"))


@pytest.mark.parametrize("norm_type", ["rmsnorm", "rmsnorm_zero_centered"])
def test_fold_at_init_is_the_plain_model(norm_type):
    # Same seed, same draws: scales at one and identity norms fold to exactly the plain model's weights.
    cfg = tiny_cfg(SWITCHES["all"], norm_type=norm_type)
    folded = fold_scale_vectors(build(cfg))
    plain = build(replace(cfg, scale=ScaleVectorConfig())).state_dict()
    assert folded.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(folded[name], value), name


# ---------------------------------------------------------------- placement and init


def test_default_config_keeps_the_old_parameter_names():
    model = build(tiny_cfg(n_layers=1))
    per_layer = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    expected = ["embed_tokens.weight"] + [f"layers.0.{n}" for n in per_layer] + ["norm.weight"]
    assert [n for n, _ in model.named_parameters()] == expected
    assert not any(isinstance(m, ScaledLinear) for m in model.modules())


def _scales(model: GatedLM) -> dict[str, tuple[str, ...]]:
    return {n: m.scale_names for n, m in model.named_modules() if isinstance(m, ScaledLinear)}


def test_branch_specific_moves_the_shared_gain_into_each_consumer():
    model = build(tiny_cfg(SWITCHES["branch_specific"], n_layers=1, attn_gate="headwise"))
    layer = model.layers[0]
    assert list(layer.input_layernorm.parameters()) == []
    assert list(layer.post_attention_layernorm.parameters()) == []
    assert model.norm.weight.shape == (32,)  # the final norm has one consumer: it keeps its gain
    readers = {f"layers.0.{n}": ("in_scale",) for n in
               ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.gate_proj",
                "mlp.gate_proj", "mlp.up_proj"]}
    assert _scales(model) == readers  # o_proj and down_proj read no block norm: plain


@pytest.mark.parametrize("qk_norm", [True, False])
def test_two_sided_has_no_out_scale_only_right_before_qk_norm(qk_norm):
    model = build(tiny_cfg(SWITCHES["two_sided"], n_layers=1, qk_norm=qk_norm))
    both = ("in_scale", "out_scale")
    q_k = ("in_scale",) if qk_norm else both
    assert _scales(model) == {
        "layers.0.self_attn.q_proj": q_k, "layers.0.self_attn.k_proj": q_k, "layers.0.self_attn.v_proj": both,
        "layers.0.self_attn.o_proj": both, "layers.0.mlp.gate_proj": both, "layers.0.mlp.up_proj": both,
        "layers.0.mlp.down_proj": both,
    }


@pytest.mark.parametrize("pattern", ["A", "LA"])
def test_residual_out_flag_matches_the_lm_out_projection_names(pattern):
    model = build(tiny_cfg(dict(two_sided=True), layer_pattern=pattern))
    scaled = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    assert any(m.residual_out for m in scaled.values())
    for name, m in scaled.items():
        assert m.residual_out == name.endswith(OUT_PROJ_NAMES), name


def test_branch_specific_gives_every_deltanet_input_projection_its_scale():
    model = build(tiny_cfg(SWITCHES["branch_specific"], layer_pattern="LA"))
    in_projs = {n for n in _scales(model) if ".linear_attn.in_proj" in n}
    assert len(in_projs) >= 4


def test_meta_construction_then_init_weights_gives_the_same_scaled_model():
    cfg = tiny_cfg(SWITCHES["all"])
    with torch.device("meta"):
        model = GatedLM(cfg, V)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = build(cfg, dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert all(torch.all(p == 1) for n, p in model.named_parameters() if p.ndim == 1), "scales start at one"


# ---------------------------------------------------------------- weight decay and training


def _groups(model, **train_kw) -> dict[str, list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in param_groups(model, TrainConfig(**train_kw))}


def test_decay_rule_all_switches_puts_exactly_these_params_in_each_group():
    model = build(tiny_cfg(SWITCHES["all"], n_layers=1))
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    matrices = [f"{a}{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
               [f"{m}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    in_scales = [f"{a}{p}.in_scale_{c}" for p in ("q_proj", "k_proj", "v_proj", "o_proj") for c in "md"] + \
                [f"{m}{p}.in_scale_{c}" for p in ("gate_proj", "up_proj", "down_proj") for c in "md"]
    out_scales = [f"{a}{p}.out_scale_{c}" for p in ("v_proj", "o_proj") for c in "md"] + \
                 [f"{m}{p}.out_scale_{c}" for p in ("gate_proj", "up_proj", "down_proj") for c in "md"]
    qk_gains = [f"{a}{n}.weight_{c}" for n in ("q_norm", "k_norm") for c in "md"]
    g = _groups(model)
    assert g["decay"] == sorted(matrices + in_scales + ["norm.weight_m", "norm.weight_d"])
    assert g["no_decay"] == sorted(["embed_tokens.weight"] + out_scales + qk_gains)
    # decay_norms no longer matters for the vectors the rule names
    assert _groups(model, decay_norms=True) == g


def test_decay_rule_with_plain_vectors_and_shared_norm_gains():
    model = build(tiny_cfg(dict(two_sided=True, decay_rule=True), n_layers=1, qk_norm=False))
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    projs = [f"{a}{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [f"{m}{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    g = _groups(model)
    assert g["decay"] == sorted(
        [f"{p}.weight" for p in projs] + [f"{p}.in_scale" for p in projs]
        + ["layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight"]
    )
    assert g["no_decay"] == sorted(["embed_tokens.weight"] + [f"{p}.out_scale" for p in projs])


def test_without_decay_rule_vectors_follow_decay_norms():
    model = build(tiny_cfg(dict(two_sided=True, magnitude_direction=True), n_layers=1))
    vectors = sorted(n for n, p in model.named_parameters() if p.ndim == 1)
    assert len(vectors) == 2 * 17  # (m, d) of 7 projections' in_scale, 5 out_scale, 5 norms' gains
    assert set(vectors) <= set(_groups(model)["no_decay"])
    assert set(vectors) <= set(_groups(model, decay_norms=True)["decay"])


def test_gated_lm_with_every_switch_trains():
    torch.manual_seed(0)
    model = build(tiny_cfg(SWITCHES["all"]), dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0))
    x = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(10):
        loss = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, initial[n])]
    assert unchanged == []  # every magnitude, direction and weight got a gradient
