"""The Gated DeltaNet mixer against a direct float64 transcription of its formulas, its document
isolation, its Qwen3.5 parameter layout, and its A_log / dt_bias initialisation and weight decay."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridtron.configs import ModelConfig, TrainConfig
from hybridtron.configs.model import DeltaNetConfig
from hybridtron.model import GatedDeltaNet, GatedLM
from hybridtron.train.optim import param_groups

V = 40


def cfg_for(pattern: str = "L", **deltanet) -> ModelConfig:
    return ModelConfig(d_model=24, n_layers=len(pattern), n_heads=2, n_kv_heads=2, head_dim=6, max_seq_len=64,
                       ffn_hidden=48, layer_pattern=pattern, deltanet=DeltaNetConfig(**{"chunk_size": 4, **deltanet}))


def mixer(**deltanet) -> GatedDeltaNet:
    torch.manual_seed(0)
    m = GatedDeltaNet(cfg_for(**deltanet))
    for p in m.parameters():  # random everything (norm gain too), so a wrong index or sign shows
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        m.A_log.uniform_(-1.0, 1.0)
    return m.double()


def l2(v: torch.Tensor) -> torch.Tensor:
    return v / torch.sqrt(v.pow(2).sum() + 1e-6)  # fla's and Qwen3.5's epsilon placement


def direct(m: GatedDeltaNet, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token, head by head, written from the paper's recurrence in the (Dv, Dk) convention:
    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t / sqrt(Dk); for
    DeltaProduct the decay applies once per token, then n_h such Householder/write steps."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv, n_h = m.n_k_heads, m.n_v_heads, m.k_head_dim, m.v_head_dim, m.n_h
    Kc = m.conv1d.kernel_size[0]
    w = m.conv1d.weight[:, 0, :]  # (C, K): w[c, K-1] multiplies the current input
    mixed = x @ m.in_proj_qkv.weight.T
    doc = doc_ids if doc_ids is not None else torch.zeros(B, T, dtype=torch.long)
    out = torch.zeros(B, T, m.out_proj.weight.shape[0], dtype=x.dtype)
    for b in range(B):
        S = torch.zeros(Hv, Dv, Dk, dtype=x.dtype)
        for t in range(T):
            if t > 0 and doc[b, t] != doc[b, t - 1]:
                S = torch.zeros_like(S)
            conv = torch.zeros(mixed.shape[-1], dtype=x.dtype)
            for i in range(Kc):  # input t - i, same document only
                if t - i >= 0 and doc[b, t - i] == doc[b, t]:
                    conv = conv + w[:, Kc - 1 - i] * mixed[b, t - i]
            conv = F.silu(conv)
            q = conv[: Hk * Dk].view(Hk, Dk)
            ks = conv[Hk * Dk : Hk * Dk * (1 + n_h)].view(n_h, Hk, Dk)
            vs = conv[Hk * Dk * (1 + n_h) :].view(n_h, Hv, Dv)
            beta = torch.sigmoid(x[b, t] @ m.in_proj_b.weight.T).view(n_h, Hv)
            if m.neg_eigval:
                beta = 2 * beta
            a = x[b, t] @ m.in_proj_a.weight.T
            g = -torch.exp(m.A_log) * F.softplus(a + m.dt_bias)
            z = (x[b, t] @ m.in_proj_z.weight.T).view(Hv, Dv)
            o = torch.zeros(Hv, Dv, dtype=x.dtype)
            for h in range(Hv):
                hk = h // (Hv // Hk)
                qh = l2(q[hk])
                S[h] = torch.exp(g[h]) * S[h]
                for j in range(n_h):
                    kh = l2(ks[j, hk])
                    S[h] = S[h] @ (torch.eye(Dk, dtype=x.dtype) - beta[j, h] * torch.outer(kh, kh)) \
                        + beta[j, h] * torch.outer(vs[j, h], kh)
                oh = S[h] @ qh / math.sqrt(Dk)
                normed = oh / torch.sqrt(oh.pow(2).mean() + m.norm.eps) * m.norm.weight
                o[h] = normed * F.silu(z[h])
            out[b, t] = m.out_proj.weight @ o.reshape(-1)
    return out


@pytest.mark.parametrize(
    "deltanet",
    [
        {},
        {"algo": "recurrent"},
        {"n_v_heads": 4},  # grouped value heads: two value heads per key head
        {"neg_eigval": True},
        {"n_householder": 2},  # DeltaProduct
        {"n_householder": 3, "n_v_heads": 4, "neg_eigval": True, "v_head_dim": 4},
        {"conv_size": 2},
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default",
)
def test_module_equals_direct_float64_formula(deltanet):
    m = mixer(**deltanet)
    x = torch.randn(2, 11, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # 11: odd, > 2 chunks
    doc_ids = torch.tensor([[0] * 11, [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2]])
    torch.testing.assert_close(m(x), direct(m, x), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(m(x, doc_ids=doc_ids), direct(m, x, doc_ids), rtol=1e-9, atol=1e-11)


def test_neg_eigval_lets_beta_exceed_one():
    """beta = 2 sigmoid(b): with b pushed large the write strength approaches 2 (reflection, eigenvalue
    -1); without the switch it stays below 1. Observed through the outputs: they differ."""
    plain, neg = mixer(), mixer(neg_eigval=True)
    x = torch.randn(1, 6, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(plain(x), neg(x))
    with torch.no_grad():
        neg.in_proj_b.weight.zero_()
    direct_out = direct(neg, x)  # beta = 2 * sigmoid(0) = 1 in the direct formula
    torch.testing.assert_close(neg(x), direct_out, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("pattern", ["L", "LLA"])
@pytest.mark.parametrize("algo", ["chunk", "recurrent"])
def test_documents_do_not_leak_state_or_convolution(pattern, algo):
    """Changing one document's tokens leaves every other document's outputs unchanged, bitwise, and a
    document's outputs equal those of that document run alone (state and conv window start fresh)."""
    cfg = cfg_for(pattern, algo=algo)
    model = GatedLM(cfg, V)
    torch.manual_seed(0)
    model.init_weights()
    model = model.double().eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (1, 17), generator=gen)
    doc = torch.tensor([[0] * 6 + [1] * 7 + [2] * 4])
    y = x.clone()
    y[0, 6:13] = torch.randint(0, V, (7,), generator=gen)  # a different middle document
    out_x, out_y = model(x, doc_ids=doc), model(y, doc_ids=doc)
    assert torch.equal(out_x[:, :6], out_y[:, :6])  # causal: nothing later reaches them, bitwise
    # A later document shares a chunk with the changed one, and with it the chunk's cumulative log decay: the
    # decays of its own steps are differences of sums that include the changed document's, exact up to float64
    # rounding (seen: 3e-17). Carried state would differ at the size of the outputs.
    torch.testing.assert_close(out_x[:, 13:], out_y[:, 13:], rtol=1e-13, atol=1e-13)
    assert not torch.allclose(out_x[:, 6:13], out_y[:, 6:13])
    alone = model(x[:, 13:])  # the third document on its own
    # Attention sees it at positions 13.. instead of 0..: the same up to the rotary table, which is fp32.
    tol = 1e-10 if "A" not in pattern else 1e-6
    torch.testing.assert_close(out_x[:, 13:], alone, rtol=tol, atol=tol)


def test_qwen35_parameter_names_and_shapes():
    """n_householder = 1: exactly the `linear_attn` parameters of transformers' Qwen3.5 decoder layer."""
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                      layer_pattern="L", deltanet=DeltaNetConfig(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6,
                                                       conv_size=4))
    m = GatedDeltaNet(cfg)
    key_dim, value_dim = 2 * 8, 4 * 6
    conv_dim = 2 * key_dim + value_dim
    expected = {
        "in_proj_qkv.weight": (conv_dim, 32),
        "in_proj_z.weight": (value_dim, 32),
        "in_proj_b.weight": (4, 32),
        "in_proj_a.weight": (4, 32),
        "conv1d.weight": (conv_dim, 1, 4),
        "dt_bias": (4,),
        "A_log": (4,),
        "norm.weight": (6,),
        "out_proj.weight": (32, value_dim),
    }
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == expected
    lm = GatedLM(cfg, V)
    assert "layers.0.linear_attn.in_proj_qkv.weight" in lm.state_dict()
    assert not any(".self_attn." in k for k in lm.state_dict())


def test_deltaproduct_widens_qkv_and_b():
    m = GatedDeltaNet(cfg_for(n_householder=3))
    key_dim = value_dim = 2 * 6
    assert m.in_proj_qkv.weight.shape == (key_dim + 3 * key_dim + 3 * value_dim, 24)
    assert m.in_proj_b.weight.shape == (3 * 2, 24)


def test_a_log_and_dt_bias_init_and_no_weight_decay():
    cfg = cfg_for("LA", n_v_heads=64)
    model = GatedLM(cfg, V)
    torch.manual_seed(0)
    model.init_weights()
    m = model.layers[0].linear_attn
    A = m.A_log.exp()
    assert A.min() >= 1.0 and A.max() <= 16.0 and A.std() > 1.0  # U(1, 16), not a constant
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    assert dt.log().std() > 0.5  # log-uniform spread
    bound = 1 / math.sqrt(m.conv1d.kernel_size[0])
    assert m.conv1d.weight.abs().max() <= bound and m.conv1d.weight.std() > 0.2 * bound
    groups = {g["name"]: {id(p) for p in g["params"]} for g in param_groups(model, TrainConfig(weight_decay=0.1))}
    for p in (m.A_log, m.dt_bias):
        assert id(p) in groups["no_decay"] and id(p) not in groups["decay"]
    assert id(m.in_proj_qkv.weight) in groups["decay"]


def test_gradients_chunk_equal_recurrent_through_module():
    x = torch.randn(2, 13, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    doc_ids = torch.tensor([[0] * 13, [0] * 5 + [1] * 8])
    grads = []
    for algo in ("chunk", "recurrent"):
        m = mixer(algo=algo, n_householder=2, neg_eigval=True)
        m(x, doc_ids=doc_ids).pow(2).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-8, atol=1e-10, msg=n)


def test_flops_per_token_hand_count_for_a_deltanet_layer():
    """One L layer (d 24, 2 key heads of 6, 4 value heads of 6, conv 4, chunk 4), SwiGLU 48, vocab 40."""
    from hybridtron.model import flops_per_token

    cfg = cfg_for("L", n_v_heads=4)
    d, hk, hv, dk, dv, K, C, ffn = 24, 2, 4, 6, 6, 4, 4, 48
    conv_dim = 2 * hk * dk + hv * dv
    params = conv_dim * d + hv * dv * d + 2 * hv * d + conv_dim * K + d * hv * dv + 3 * d * ffn + d * V
    delta = hv * (2 * C * dk + C * (dk + dv) / 2 + C * dv + 3 * dk * dv)
    assert flops_per_token(cfg, V, 16) == pytest.approx(6 * (params + delta))
    # DeltaProduct with n_h = 2: two keys, two values and two betas per token, the delta rule twice.
    cfg2 = cfg_for("L", n_v_heads=4, n_householder=2)
    conv2 = hk * dk + 2 * hk * dk + 2 * hv * dv
    params2 = conv2 * d + hv * dv * d + 3 * hv * d + conv2 * K + d * hv * dv + 3 * d * ffn + d * V
    assert flops_per_token(cfg2, V, 16) == pytest.approx(6 * (params2 + 2 * delta))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("start", [None, 5, 10, 13],
                         ids=["one_doc", "mid_prompt", "in_prompts_last_window", "inside_a_later_call"])
def test_cached_decoding_with_documents_equals_full_forward(backend, start):
    """A call continues the cached document: its convolution window reads the cached inputs and its state
    goes on, unless a document starts inside it. A second document starting at 10 leaves inputs of the first
    in the window cached at 12 (conv_size 4): they must not reach the next call. Attention's cached keys of an
    earlier document are not attended to either."""
    from hybridtron.configs import load_config

    cfg = load_config("tiny_hybrid").model
    cfg.n_layers, cfg.layer_pattern = 2, "LA"
    cfg.kernels.conv = cfg.kernels.delta_rule = backend
    torch.manual_seed(0)
    model = GatedLM(cfg, V)
    model.init_weights()
    model.eval()
    x = torch.randint(0, V, (2, 18), generator=torch.Generator().manual_seed(5))
    doc = torch.zeros(2, 18, dtype=torch.long)
    if start is not None:
        doc[0, start:] = 1  # the second row stays one document
    with torch.no_grad():
        full = model(x, doc_ids=doc)
        cache = model.new_cache()
        cuts = [0, 12, 15, 16, 17, 18]  # a prompt, a second prompt chunk, then single tokens
        parts = [model(x[:, a:b], doc_ids=doc[:, a:b], cache=cache) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_cached_decoding_with_a_one_tap_convolution():
    """conv_size 1 caches no inputs (K - 1 = 0): the next call's past is empty, not the whole previous call."""
    from hybridtron.configs import load_config

    cfg = load_config("tiny_hybrid").model
    cfg.n_layers, cfg.layer_pattern, cfg.deltanet.conv_size = 1, "L", 1
    torch.manual_seed(0)
    model = GatedLM(cfg, V)
    model.init_weights()
    model.eval()
    x = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        parts = [model(x[:, :6], cache=cache), model(x[:, 6:8], cache=cache), model(x[:, 8:], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
