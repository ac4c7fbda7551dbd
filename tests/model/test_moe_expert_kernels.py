"""The MoE layer on kernels/moe_gemm: the packed SwiGLU between the expert GEMMs (model.kernels.swiglu) gives the
unfused ``silu(gate) * up``'s outputs and gradients on both backends, and model.moe.gather=gemm (the gate_up GEMM
gathers the token rows itself; Triton under the interpreter) gives the permute path's, in float64 and under bf16
autocast, for top-1 and top-2, with a shared expert and with one expert holding every token; it writes no permuted
rows, reads nothing back to the host, refuses a bad value by name, and leaves expert parallelism on the permute
path."""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import ConfigError, load_config
from hybridtron.model import moe as moe_mod
from hybridtron.model.lm import GatedLM
from hybridtron.model.moe import MoE, moe_reference

from .test_moe import ALL_ON, cfg_for, direct, no_host_reads

pytest.importorskip("triton")


def layer(dtype=torch.float64, gather="permute", moe_kernels="reference", swiglu="reference", **moe) -> MoE:
    cfg = cfg_for(**moe)
    cfg.moe.gather = gather
    cfg.kernels.moe, cfg.kernels.swiglu = moe_kernels, swiglu
    torch.manual_seed(0)
    m = MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if m.bias_update_rate:
        m.expert_bias.normal_(std=0.2)
    return m.to(dtype)


def out_and_grads(m: MoE, x: torch.Tensor, autocast: bool = False):
    xi = x.clone().requires_grad_()
    m.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = m(xi)
    y.double().pow(2).sum().backward()
    return y.detach(), [xi.grad] + [p.grad.clone() for p in m.parameters()]


def assert_same(a, b, rtol, atol):
    (ya, ga), (yb, gb) = a, b
    torch.testing.assert_close(ya, yb, rtol=rtol, atol=atol)
    for i, (u, v) in enumerate(zip(ga, gb, strict=True)):
        torch.testing.assert_close(u, v, rtol=rtol, atol=atol, msg=lambda s, i=i: f"gradient {i}: {s}")


def tokens(n=23, seed=1, dtype=torch.float64):
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---- step 1: the packed SwiGLU --------------------------------------------------------------------------------


@pytest.mark.parametrize("swiglu", ["reference", "triton"])
def test_packed_swiglu_equals_the_unfused_activation_float64(swiglu):
    """moe_reference runs each expert as ``F.silu(gate) * up`` on a chunk of its gate_up product."""
    m = layer(swiglu=swiglu, **ALL_ON)
    x = tokens()
    ours = out_and_grads(m, x)
    xi = x.clone().requires_grad_()
    m.zero_grad()
    y = moe_reference(m, xi)
    y.pow(2).sum().backward()
    assert_same(ours, (y.detach(), [xi.grad] + [p.grad.clone() for p in m.parameters()]), rtol=1e-10, atol=1e-12)


def assert_bf16_close_to_float64(run, exact, bound=4e-2):
    """Output and every gradient within ``bound`` of the float64 layer's, in relative norm: bf16 experts make
    errors of ~1e-2 here (the interpreter rounds fp32 to bf16 toward zero, which doubles the kernels' share of it
    against the GPU's rounding to nearest); a wrong formula, row or expert makes errors of order 1."""
    for i, (a, b) in enumerate(zip([run[0], *run[1]], [exact[0], *exact[1]], strict=True)):
        err = float((a.double() - b).norm() / b.norm())
        assert err < bound, f"{'output' if i == 0 else f'gradient {i - 1}'}: relative error {err:.2e} >= {bound}"


def test_packed_swiglu_under_bf16_autocast():
    """bf16 experts on both backends (the Triton activation rounds once where the reference rounds silu(gate)
    first): within bf16's error of the float64 layer."""
    x = tokens(dtype=torch.float32)
    exact = out_and_grads(layer(**ALL_ON), x.double())
    for swiglu in ("reference", "triton"):
        run = out_and_grads(layer(torch.float32, swiglu=swiglu, **ALL_ON), x, autocast=True)
        assert run[0].dtype == torch.bfloat16
        assert_bf16_close_to_float64(run, exact)


# ---- step 2: the gathered gate_up GEMM -------------------------------------------------------------------------

VARIANTS = [
    {},
    {"top_k": 1},
    {**ALL_ON, "router": "sigmoid", "top_k": 3},
    {"top_k": 1, "n_experts": 1},
]


@pytest.mark.parametrize("moe", VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_gather_in_gemm_equals_the_permute_path_float64(moe):
    x = tokens()
    permute = out_and_grads(layer(**moe), x)
    gathered = layer(gather="gemm", moe_kernels="triton", swiglu="triton", **moe)
    assert gathered.gathers_in_gemm(x)
    assert_same(out_and_grads(gathered, x), permute, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_with_every_token(top_k):
    """A router bias that sends every token's first choice to expert 0: at top-1 the other experts have no rows
    (their weight gradients are zero), at top-2 expert 0 holds all N rows (several row tiles)."""
    x = tokens(n=41, seed=2)
    ms = [layer(gather=g, moe_kernels=b, bias_update_rate=0.01, top_k=top_k) for g, b in
          (("permute", "reference"), ("gemm", "triton"))]
    for m in ms:
        m.expert_bias.zero_()
        m.expert_bias[0] = 100.0
    permute, gathered = out_and_grads(ms[0], x), out_and_grads(ms[1], x)
    assert_same(gathered, permute, rtol=1e-10, atol=1e-12)
    if top_k == 1:
        assert torch.equal(ms[1].experts.gate_up_proj.grad[1:], torch.zeros_like(ms[1].experts.gate_up_proj[1:]))


def test_gather_in_gemm_under_bf16_autocast():
    """fp32 parameters under bf16 autocast, as the trainer runs: bf16 output, the output and every gradient within
    bf16's error of the float64 layer."""
    x = tokens(dtype=torch.float32)
    run = out_and_grads(layer(torch.float32, gather="gemm", swiglu="triton", moe_kernels="triton", **ALL_ON), x,
                        autocast=True)
    assert run[0].dtype == torch.bfloat16
    assert_bf16_close_to_float64(run, out_and_grads(layer(**ALL_ON), x.double()))


def test_gather_in_gemm_writes_no_permuted_rows(monkeypatch):
    m = layer(gather="gemm", moe_kernels="triton")

    def refuse(*a, **k):
        raise AssertionError("moe_permute ran: the gathered path wrote the permuted rows")

    monkeypatch.setattr(moe_mod, "moe_permute", refuse)
    m(tokens()).sum().backward()


def test_reference_backend_and_expert_parallelism_keep_the_permute_path(monkeypatch):
    x = tokens()
    assert not layer(gather="gemm", moe_kernels="reference").gathers_in_gemm(x)  # the same formula, permuted
    m = layer(gather="gemm", moe_kernels="triton")
    seen = []

    def dispatch(moe, xs, counts):  # expert parallelism hands the permuted rows to other ranks
        seen.append(xs.shape)
        return moe.run_experts(xs, counts, moe.experts.gate_up_proj, moe.experts.down_proj)

    m.expert_dispatch = dispatch
    torch.testing.assert_close(m(x), direct(m, x), rtol=1e-10, atol=1e-12)
    assert seen == [(23 * 2, 32)]


def test_bad_gather_value_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"model.moe.gather='fused' is not a choice; choose one of \['permute', "
                                          r"'gemm'\]"):
        layer(gather="fused")


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32 params, bf16 autocast", "bf16 params (FSDP2)"])
def test_gather_in_gemm_never_waits_for_the_device(autocast, monkeypatch):
    """As test_moe's check of the permute path: on data-less tensors any host read in the layer would raise."""
    m = layer(torch.float32 if autocast else torch.bfloat16, gather="gemm", moe_kernels="triton", swiglu="triton",
              **ALL_ON)
    m.train()
    with no_host_reads(monkeypatch, m):
        assert m.gathers_in_gemm(m.gate.weight)
        x = torch.randn(23, 32, dtype=m.gate.weight.dtype, requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = m(x)
        (y.float().pow(2).sum() + m.aux_loss).backward()
    assert x.grad is not None and m.experts.gate_up_proj.grad is not None


def test_tiny_moe_lm_with_the_gathered_gemm_matches_the_reference_backend():
    def lm(gather: str, backend: str) -> GatedLM:
        cfg = load_config("tiny_moe").model
        cfg.n_layers, cfg.d_model, cfg.moe.expert_hidden = 2, 32, 32  # one dense layer, one MoE layer
        cfg.moe.gather = gather
        cfg.kernels.moe = cfg.kernels.swiglu = backend
        torch.manual_seed(0)
        model = GatedLM(cfg, 64)
        model.init_weights()
        return model

    from ..kernels.helpers import assert_same_loss_and_grads

    ref, tri = lm("permute", "reference"), lm("gemm", "triton")
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))
    g = assert_same_loss_and_grads(ref, tri, ids, torch.roll(ids, -1, 1))
    assert g["layers.1.mlp.experts.gate_up_proj"].abs().sum() > 0
