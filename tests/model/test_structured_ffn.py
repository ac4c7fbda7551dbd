"""Structured FFN layers: each form against explicitly built matrices, SVD and orthogonal init, the
output scale at init, self-guided mixing and its schedule, dropping the guide, and the dense export."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.configs import ConfigError, ModelConfig, StructuredFFNConfig
from hybridtron.model import GatedLM
from hybridtron.model.mlp import SwiGLU
from hybridtron.model.structured_ffn import (
    StructuredLinear,
    StructuredSwiGLU,
    dense_state_dict,
    drop_self_guided,
    self_guided_alpha,
    set_self_guided_alpha,
)

KINDS = ["lowrank", "blockdense", "blockshuffle"]
V = 40


def layer(kind, i=16, o=24, self_guided=False, residual_out=False, seed=0) -> StructuredLinear:
    torch.manual_seed(seed)
    m = StructuredLinear(i, o, kind, rank=8, n_blocks=4, self_guided=self_guided, residual_out=residual_out)
    m.init_weights(0.02, 0.01)
    return m.double()


def explicit_matrix(m: StructuredLinear) -> torch.Tensor:
    """The product built from torch.block_diag and an explicit permutation matrix."""
    if m.kind == "lowrank":
        return m.U @ m.V
    if m.kind == "blockdense":
        return m.U @ torch.block_diag(*m.blocks)
    n, mid = m.n_blocks, m.mid
    s = mid // n
    P = torch.zeros(mid, mid, dtype=m.blocks1.dtype)
    for i in range(n):
        for j in range(s):
            P[j * n + i, i * s + j] = 1.0  # channel (block i, index j) -> position (j, i)
    return torch.block_diag(*m.blocks2) @ P @ torch.block_diag(*m.blocks1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_forward_equals_explicit_product(kind, shape):
    m = layer(kind, *shape)
    with torch.no_grad():  # off the init (orthogonal blocks), so any index error shows
        for p in m.parameters():
            p.normal_()
    x = torch.randn(3, 5, shape[0], dtype=torch.float64)
    W = explicit_matrix(m)
    torch.testing.assert_close(m(x), x @ W.T)
    torch.testing.assert_close(m.dense_weight(), W)
    m(x).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.parametrize(
    "args, message",
    [
        ((30, 64, "blockshuffle"), r"n_blocks=4 to divide in=30, out=64 and the middle width m=min\(in, out\)=30"),
        ((32, 64, "blockdense", 6), r"n_blocks=4 to divide in=32 and rank=6"),
        ((32, 64, "butterfly"), r"unknown structured kind 'butterfly'"),
    ],
)
def test_bad_layer_shapes_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        StructuredLinear(*args, n_blocks=4)


def test_lowrank_svd_init_is_best_rank_r_approximation():
    m = layer("lowrank")
    torch.manual_seed(0)
    StructuredLinear(16, 24, "lowrank", rank=8)  # same construction, then the same draw as init_weights
    w = torch.randn(24, 16, dtype=torch.float64) * 0.02
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    best = (u[:, :8] * s[:8]) @ vh[:8]
    torch.testing.assert_close(m.U @ m.V, best)
    assert torch.linalg.matrix_rank(m.U @ m.V) == 8
    assert m.U.numel() + m.V.numel() == 8 * (16 + 24) < 16 * 24


@pytest.mark.parametrize("kind", ["blockdense", "blockshuffle"])
def test_blocks_are_orthogonal_up_to_scale(kind):
    m = layer(kind, 32, 64)
    for blocks in [getattr(m, n) for n in ("blocks", "blocks1", "blocks2") if hasattr(m, n)]:
        for b in blocks:
            g = b @ b.T if b.shape[0] <= b.shape[1] else b.T @ b
            torch.testing.assert_close(g / g[0, 0], torch.eye(g.shape[0], dtype=g.dtype), atol=1e-5, rtol=0)  # fp32 init


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
def test_output_scale_at_init_matches_dense_layer(kind, shape):
    i, o = shape
    torch.manual_seed(1)
    m = StructuredLinear(i, o, kind, rank=32, n_blocks=4)
    m.init_weights(0.02, 0.01)
    y = m(torch.randn(4096, i))
    dense_std = 0.02 * i**0.5
    assert 0.7 < y.std().item() / dense_std < 1.3
    down = StructuredLinear(i, o, kind, rank=32, n_blocks=4, residual_out=True)
    down.init_weights(0.02, 0.01)
    assert 0.35 < down(torch.randn(4096, i)).std().item() / dense_std < 0.65  # out_std = std / 2


@pytest.mark.parametrize("kind", KINDS)
def test_self_guided_mixes_dense_and_structured(kind):
    m = layer(kind, self_guided=True)
    x = torch.randn(7, 16, dtype=torch.float64)
    torch.testing.assert_close(m.dense, m.dense_weight())  # the dense guide starts at the product
    for a in (1.0, 0.3):
        m.alpha = a
        torch.testing.assert_close(m(x), m.structured(x))
    with torch.no_grad():
        m.dense.add_(torch.randn_like(m.dense))
    m.alpha = 0.3
    torch.testing.assert_close(m(x), 0.3 * x @ m.dense.T + 0.7 * x @ explicit_matrix(m).T)
    m(x).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    with torch.no_grad():
        m.dense.fill_(float("nan"))
    m.alpha = 0.0  # the dense matmul is skipped: 0 * NaN would poison the output
    torch.testing.assert_close(m(x), x @ explicit_matrix(m).T)


def test_alpha_schedule_is_cosine_over_the_fraction():
    vals = [self_guided_alpha(s, 100, 0.4) for s in range(101)]
    assert vals[0] == 1.0 and vals[20] == pytest.approx(0.5) and vals[40] == 0.0 and vals[100] == 0.0
    assert all(a >= b for a, b in zip(vals, vals[1:], strict=False))
    assert vals[10] == pytest.approx(0.5 * (1 + 2**-0.5))


def cfg_for(kind: str, self_guided: bool = False, **kw) -> ModelConfig:
    return ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       ffn=StructuredFFNConfig(kind=kind, rank=8, n_blocks=4, self_guided=self_guided, **kw))


def test_drop_self_guided_removes_parameters_and_state():
    model = GatedLM(cfg_for("lowrank", self_guided=True), V)
    torch.manual_seed(0)
    model.init_weights()
    n_before = model.num_params()
    guides = [n for n in model.state_dict() if n.endswith(".dense")]
    assert len(guides) == 3  # layer 1's gate/up/down; layer 0 stays dense
    guide_params = {id(p) for n, p in model.named_parameters() if n.endswith(".dense")}
    dropped = drop_self_guided(model)
    assert {id(p) for p in dropped} == guide_params and len(dropped) == 3
    assert model.num_params() == n_before - sum(p.numel() for p in dropped)
    assert not any(n.endswith(".dense") for n in model.state_dict())
    assert not any(p is q for p in model.parameters() for q in dropped)
    assert drop_self_guided(model) == []
    lin = model.layers[1].mlp.up_proj
    x = torch.randn(3, 32)
    assert lin.alpha == 0.0 and not hasattr(lin, "dense")
    torch.testing.assert_close(lin(x), lin.structured(x))  # the structured path alone


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("self_guided", [False, True])
def test_dense_state_dict_loads_into_a_dense_model_with_same_logits(kind, self_guided):
    model = GatedLM(cfg_for(kind, self_guided), V)
    torch.manual_seed(0)
    model.init_weights()
    model = model.double()
    assert isinstance(model.layers[0].mlp, SwiGLU) and isinstance(model.layers[1].mlp, StructuredSwiGLU)
    if self_guided:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".dense"):
                    p.add_(torch.randn_like(p) * 0.05)
        set_self_guided_alpha(model, 0.4)
    dense = GatedLM(cfg_for("dense"), V).double()
    dense.load_state_dict(dense_state_dict(model), strict=True)
    x = torch.randint(0, V, (2, 11))
    torch.testing.assert_close(dense(x), model(x), rtol=1e-10, atol=1e-10)


def test_first_layer_structured_when_asked():
    model = GatedLM(cfg_for("blockshuffle", dense_first_layer=False), V)
    assert all(isinstance(b.mlp, StructuredSwiGLU) for b in model.layers)
    x = model.layers[0].mlp.gate_proj
    assert x.blocks1.shape == (4, 8, 8) and x.blocks2.shape == (4, 16, 8)


@pytest.mark.parametrize(
    "ffn, message",
    [
        (dict(kind="lowrank", rank=40), r"model.ffn.rank=40 exceeds min\(d_model, ffn_hidden\)=32"),
        (dict(kind="blockdense", n_blocks=5), r"model.ffn.n_blocks=5 must divide both d_model=32 and ffn_hidden=64"),
        (dict(kind="blockdense", n_blocks=4, rank=6), r"model.ffn.rank=6 must be a multiple of model.ffn.n_blocks=4"),
    ],
)
def test_bad_structured_configs_are_refused(ffn, message):
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, ffn=StructuredFFNConfig(**ffn))
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_swiglu_structure_of_structured_ffn():
    torch.manual_seed(0)
    m = StructuredSwiGLU(cfg_for("blockdense")).double()
    for sub in (m.gate_proj, m.up_proj, m.down_proj):
        sub.init_weights(0.02, 0.01)
    x = torch.randn(4, 32, dtype=torch.float64)
    g, u, d = (explicit_matrix(s) for s in (m.gate_proj, m.up_proj, m.down_proj))
    torch.testing.assert_close(m(x), (F.silu(x @ g.T) * (x @ u.T)) @ d.T)
