"""The MoE layer: sorted/grouped dispatch against a per-token float64 formula and the loop reference,
losses against their definitions, the auxiliary-loss-free bias, metrics, layout, placement, FLOPs."""

from __future__ import annotations

import contextlib
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.configs import ConfigError, ModelConfig, MoEConfig
from hybridtron.model import GatedLM, flops_per_token
from hybridtron.model.moe import MoE, moe_reference
from hybridtron.train.model_hooks import after_step

V = 48


def cfg_for(n_layers: int = 1, **moe) -> ModelConfig:
    base = dict(n_experts=6, top_k=2, expert_hidden=16)
    return ModelConfig(d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       moe=MoEConfig(**{**base, **moe}))


def layer(dtype=torch.float64, **moe) -> MoE:
    torch.manual_seed(0)
    m = MoE(cfg_for(**moe))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if m.bias_update_rate:
        m.expert_bias.normal_(std=0.2)
    return m.to(dtype)


def direct(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: router scores, top-k by sorting (bias only for the choice), SwiGLU experts."""
    out = torch.zeros_like(x)
    hid = m.experts.hidden
    for n in range(x.shape[0]):
        logits = m.gate.weight @ x[n]
        scores = logits.softmax(0) if m.router_kind == "softmax" else logits.sigmoid()
        chosen = sorted(range(m.n_experts), key=lambda e: -(scores[e] + m.expert_bias[e]).item())[: m.top_k]
        w = scores[chosen]
        if m.norm_topk_prob:
            w = w / w.sum()
        for wj, e in zip(w, chosen, strict=True):
            gu = m.experts.gate_up_proj[e]
            h = F.silu(gu[:hid] @ x[n]) * (gu[hid:] @ x[n])
            out[n] += wj * (m.experts.down_proj[e] @ h)
        if m.shared_expert is not None:
            s = m.shared_expert
            h = F.silu(s.gate_proj.weight @ x[n]) * (s.up_proj.weight @ x[n])
            out[n] += torch.sigmoid(m.shared_expert_gate.weight[0] @ x[n]) * (s.down_proj.weight @ h)
    return out


VARIANTS = [
    {},
    {"router": "sigmoid"},
    {"norm_topk_prob": False},
    {"shared_expert_hidden": 24},
    {"bias_update_rate": 0.01, "router": "sigmoid", "top_k": 3},
    {"top_k": 6},  # every expert
    {"top_k": 1, "n_experts": 1},
]


@pytest.mark.parametrize("moe", VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_forward_equals_direct_formula_float64(moe):
    m = layer(**moe)
    x = torch.randn(23, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(x), direct(m, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("moe", VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_grouped_dispatch_equals_loop_reference_fp32_with_grads(moe):
    """fp32 with widths 32 and 16 takes torch's grouped GEMM; the reference is a masked loop."""
    m = layer(torch.float32, **moe)
    x = torch.randn(3, 17, 32, generator=torch.Generator().manual_seed(2))
    outs, grads = [], []
    for fn in (m.forward, lambda t: moe_reference(m, t)):
        xi = x.clone().requires_grad_()
        m.zero_grad()
        y = fn(xi)
        y.pow(2).sum().backward()
        outs.append(y)
        grads.append([xi.grad] + [p.grad.clone() for p in m.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_per_expert_fallback_path_equals_grouped_path():
    """Widths that are not 16-byte aligned fall back to one matmul per expert slice; same result."""
    from hybridtron.model.moe import grouped_linear

    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(10, 8, generator=gen), torch.randn(3, 12, 8, generator=gen)
    counts = [4, 0, 6]
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
    loop = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    torch.testing.assert_close(grouped_linear(x, w, offsets, "native"), loop)  # grouped GEMM
    fallback = torch.cat([x[:4, :7] @ w[0, :, :7].T, x[4:, :7] @ w[2, :, :7].T])
    torch.testing.assert_close(grouped_linear(x[:, :7], w[:, :, :7], offsets, "native"), fallback)  # counts read back
    torch.testing.assert_close(grouped_linear(x[:, :7], w[:, :, :7], offsets, "native", counts), fallback)  # given


def test_aux_and_z_loss_match_their_definitions():
    m = layer(aux_loss_coef=0.1, z_loss_coef=0.01, top_k=2)
    x = torch.randn(40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    m(x)
    logits = x @ m.gate.weight.T
    p = logits.softmax(-1)
    top = p.topk(2, dim=-1).indices
    f = torch.stack([(top == e).sum() for e in range(6)]).double() / (40 * 2)
    aux = 6 * (f * p.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(m.aux_loss, 0.1 * aux + 0.01 * z)
    # Balanced routing gives the minimum, 1, of the Switch loss (uniform probabilities, uniform load).
    assert aux > 1.0


def test_lm_loss_adds_weighted_aux_losses_only_in_training():
    cfg = cfg_for(2, aux_loss_coef=0.5, z_loss_coef=0.1, every=1)
    model = GatedLM(cfg, V).double()
    torch.manual_seed(0)
    model.init_weights()
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(5))
    ce = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss = model(x, labels=x)
    aux = sum(m.aux_loss for m in model.modules() if isinstance(m, MoE))
    assert float(aux.detach()) > 0.5  # two layers of 0.5 * (>= 1)
    torch.testing.assert_close(loss, ce + aux)
    model.eval()
    torch.testing.assert_close(model(x, labels=x), ce)


def test_bias_picks_experts_without_weighting_them_and_moves_towards_balance():
    m = layer(bias_update_rate=0.05, router="sigmoid", norm_topk_prob=False)
    x = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        m.expert_bias.zero_()
        m.expert_bias[3] = 10.0  # expert 3 is always chosen ...
    _, probs, w, idx = m.route(x)
    assert (idx == 3).any(-1).all()
    slot = (idx == 3).int().argmax(-1)
    torch.testing.assert_close(w.gather(-1, slot[:, None])[:, 0], probs[:, 3])  # ... at its own score
    m.train()
    m(x)
    load = m.metrics()
    assert load["load/e3"] == pytest.approx(0.5)  # one of the two slots of every token
    before = m.expert_bias.clone()
    m.after_optimizer_step()
    delta = m.expert_bias - before
    assert delta[3] == pytest.approx(-0.05)  # overloaded: down by the rate
    counts = torch.bincount(idx.flatten(), minlength=6).double()
    expected = 0.05 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(delta, expected.to(delta.dtype))
    assert m.metrics()["load/e0"] == 0.0  # statistics reset after the step


def test_metrics_accumulate_micro_batches_and_skip_eval():
    m = layer(aux_loss_coef=0.01, bias_update_rate=0.01)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(10, 32, dtype=torch.float64, generator=gen) for _ in range(2)]
    m.train()
    idx = [m.route(x)[3] for x in xs]
    auxes = []
    for x in xs:
        m(x)
        auxes.append(float(m.aux_loss.detach()) / 0.01)
    m.eval()
    m(torch.randn(50, 32, dtype=torch.float64, generator=gen))  # not counted
    stats = m.metrics()
    counts = torch.bincount(torch.cat(idx).flatten(), minlength=6).double()
    for e in range(6):
        assert stats[f"load/e{e}"] == pytest.approx(float(counts[e] / counts.sum()))
    assert stats["dropped"] == 0
    assert stats["aux_loss"] == pytest.approx(sum(auxes) / 2)
    assert set(stats) >= {f"bias/e{e}" for e in range(6)}


def test_after_step_reports_per_layer_metrics():
    cfg = cfg_for(4, every=2, bias_update_rate=0.01, z_loss_coef=0.001)
    model = GatedLM(cfg, V)
    torch.manual_seed(0)
    model.init_weights()
    model(torch.randint(0, V, (2, 8)), labels=torch.randint(0, V, (2, 8)))
    rec = after_step(model)
    layers = {k.split("/")[1] for k in rec}
    assert layers == {"layer1", "layer3"}
    assert rec["moe/layer1/dropped"] == 0
    assert sum(rec[f"moe/layer3/load/e{e}"] for e in range(6)) == pytest.approx(1.0)
    assert "moe/layer1/z_loss" in rec and "moe/layer3/bias/e5" in rec


def test_qwen35_moe_names_shapes_and_fused_gate_up_order():
    cfg = cfg_for(2, every=1, shared_expert_hidden=24)
    sd = GatedLM(cfg, V).state_dict()
    assert tuple(sd["layers.0.mlp.gate.weight"].shape) == (6, 32)
    assert tuple(sd["layers.0.mlp.experts.gate_up_proj"].shape) == (6, 2 * 16, 32)
    assert tuple(sd["layers.0.mlp.experts.down_proj"].shape) == (6, 32, 16)
    assert tuple(sd["layers.1.mlp.shared_expert.gate_proj.weight"].shape) == (24, 32)
    assert tuple(sd["layers.1.mlp.shared_expert.down_proj.weight"].shape) == (32, 24)
    assert tuple(sd["layers.1.mlp.shared_expert_gate.weight"].shape) == (1, 32)
    assert "layers.0.mlp.expert_bias" in sd
    m = layer()
    x = torch.randn(5, 32, dtype=torch.float64)
    g, u = m.experts.gate_up_proj[2, :16], m.experts.gate_up_proj[2, 16:]  # gate rows first, then up
    torch.testing.assert_close(m.experts.expert(2, x), (F.silu(x @ g.T) * (x @ u.T)) @ m.experts.down_proj[2].T)


def test_placement_every_and_list():
    assert [cfg_for(4, every=2).moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    cfg = cfg_for(4, layers=[0, 2])
    model = GatedLM(cfg, V)
    assert [isinstance(b.mlp, MoE) for b in model.layers] == [True, False, True, False]


def test_active_params_and_flops_count_routed_experts_only():
    cfg = cfg_for(2, every=1, shared_expert_hidden=24, n_experts=8, top_k=2)
    model = GatedLM(cfg, V)
    total, active = model.num_params(), model.num_active_params()
    per_expert = 3 * 32 * 16
    assert total - active == 2 * (8 - 2) * per_expert  # two layers, six idle experts each
    # Adding experts at fixed top_k adds only the router's rows to the FLOPs.
    more = cfg_for(2, every=1, shared_expert_hidden=24, n_experts=12, top_k=2)
    diff = flops_per_token(more, V, 16) - flops_per_token(cfg, V, 16)
    assert diff == pytest.approx(3 * 2 * (2 * 4 * 32))  # 3 x (fwd: 2 FLOPs x 2 layers x 4 rows x d)


def test_bad_moe_configs_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model.moe.top_k=9 .*n_experts=8"):
        cfg_for(1, n_experts=8, top_k=9).validate()
    with pytest.raises(ConfigError, match=r"model.moe.layers lists layer 5"):
        cfg_for(2, layers=[5]).validate()


def test_megablocks_backend_without_megablocks_names_the_fix():
    try:
        import grouped_gemm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="model.moe.backend=megablocks"):
            MoE(cfg_for(backend="megablocks"))
        return
    MoE(cfg_for(backend="megablocks"))  # installed: builds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megablocks' grouped GEMM runs on CUDA only; no GPU here")
def test_megablocks_backend_equals_native_on_gpu():
    pytest.importorskip("grouped_gemm", reason="megablocks (grouped_gemm) is not installed")
    native = layer(torch.bfloat16).cuda()
    mb = layer(torch.bfloat16, backend="megablocks").cuda()
    mb.load_state_dict(native.state_dict())
    x = torch.randn(256, 32, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for m in (native, mb):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.float().pow(2).sum().backward()
        outs.append(y.float())
        grads.append(m.experts.gate_up_proj.grad.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0], grads[1], rtol=5e-2, atol=5e-2)
    assert math.isfinite(float(outs[0].sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_within_the_float64_error_bound(dtype):
    """torch's grouped GEMM (the native backend's expert matmul) against the per-expert loop, by the kernels'
    rule: its error against float64 is no worse than a small multiple of the loop's own in the same dtype, for
    the output and the gradients of the rows and of every expert's weight (an empty expert included)."""
    from hybridtron.model.moe import _grouped_mm_ok, grouped_linear

    from ..kernels.helpers import check_against_reference

    counts = [5, 0, 11, 3]  # rows per expert, consecutive
    E, d_in, d_out, N = len(counts), 32, 48, sum(counts)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, d_in, generator=gen, dtype=torch.float64)
    w = torch.randn(E, d_out, d_in, generator=gen, dtype=torch.float64) / d_in**0.5
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert _grouped_mm_ok(x.to(dtype), d_out, d_in)  # the grouped path, not the loop, is what is checked

    def loop(xs, ws):
        return torch.cat([xe @ we.T for xe, we in zip(xs.split(counts), ws.unbind(0), strict=True)])

    check_against_reference(f"grouped_linear[{dtype}]", lambda xs, ws: grouped_linear(xs, ws, offsets, "native"),
                            loop, [x, w], [dtype, dtype])


# ---- precision under autocast, and no host synchronisation ---------------------------------------------------

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear", "mv", "addmv", "dot"}


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of the floating operands of every matmul-family aten op that runs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.append((func.overloadpacket.__name__,
                              tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())))
        return func(*args, **(kwargs or {}))


def fake_megablocks(monkeypatch) -> list[torch.Tensor]:
    """``grouped_gemm.ops`` as megablocks installs it, for the CPU: ``gmm`` by its contract (a (rows, in), b (E,
    out, in) with trans_b, the batch sizes an int64 tensor on the host), computed by a loop. Returns the list
    of batch-size tensors it was handed."""
    handed, tolist = [], torch.Tensor.tolist  # (the real tolist: the sync tests count the layer's own calls)

    def gmm(a, b, batch_sizes, trans_a=False, trans_b=False):
        assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64 and trans_b and not trans_a
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        handed.append(batch_sizes)
        return torch.cat([ae @ be.T for ae, be in zip(a.split(tolist(batch_sizes)), b.unbind(0), strict=True)])

    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm = gmm
    pkg = types.ModuleType("grouped_gemm")
    pkg.ops = ops
    monkeypatch.setitem(sys.modules, "grouped_gemm", pkg)
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", ops)
    return handed


ALL_ON = dict(shared_expert_hidden=24, aux_loss_coef=0.01, z_loss_coef=0.01, bias_update_rate=0.01)
PATHS = ["native", "fallback", "megablocks", "reference"]


@pytest.mark.parametrize("path", PATHS)
def test_experts_run_in_bf16_under_autocast(path, monkeypatch):
    """fp32 parameters under bf16 autocast (the trainer's GPU setting): every matmul of the experts, the shared
    expert and their backward sees bf16 (autocast does not cover torch._grouped_mm: the layer casts), on each
    backend; the router's three (forward, its input and weight gradients) stay fp32 on purpose."""
    from hybridtron.model import moe as moe_mod

    if path == "megablocks":
        handed = fake_megablocks(monkeypatch)
    if path == "fallback":
        monkeypatch.setattr(moe_mod, "_grouped_mm_ok", lambda *a: False)
    m = layer(torch.float32, backend="megablocks" if path == "megablocks" else "native", **ALL_ON)
    m.train()
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(8), requires_grad=True)
    seen = MatmulDtypes()
    with seen:
        with torch.autocast("cpu", torch.bfloat16):
            y = moe_reference(m, x) if path == "reference" else m(x)
        y.float().pow(2).sum().backward()
    assert y.dtype == torch.bfloat16
    fp32 = [s for s in seen.seen if torch.float32 in s[1]]
    low = [s for s in seen.seen if s[1] and set(s[1]) == {torch.bfloat16}]
    assert len(fp32) == 3 and all(set(s[1]) == {torch.float32} for s in fp32), fp32  # the router only
    assert len(low) == len(seen.seen) - 3 and len(low) >= 12, seen.seen  # experts (2 + 4 bwd), shared (3 + 6)
    if path == "native":
        assert any(op == "_grouped_mm" for op, _ in low)
    if path == "megablocks":
        assert len(handed) == 2  # both projections went through gmm
    # and the result is the layer's: within bf16's error of the float64 formula
    with torch.no_grad():
        ref = direct(layer(**ALL_ON), x.detach().double())
    assert float((y.detach().double() - ref).norm() / ref.norm()) < 2e-2


@contextlib.contextmanager
def no_host_reads(monkeypatch, m: torch.nn.Module):
    """m's parameters and buffers and every tensor made inside become data-less (FakeTensorMode), so .item(),
    .tolist(), bool(t) and ops whose output shape depends on the data (nonzero, bincount, repeat_interleave
    without output_size) raise: on a GPU each would wait for the device. Explicit copies to the host raise too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    for mod in m.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, torch.nn.Parameter(mode.from_tensor(p.detach())))
        for name, b in list(mod.named_buffers(recurse=False)):
            mod._buffers[name] = mode.from_tensor(b)

    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"{name}: a device-to-host copy in the MoE layer")
        return f

    for name in ("cpu", "numpy", "tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    monkeypatch.setattr(torch.cuda, "synchronize", refuse("torch.cuda.synchronize"))
    with mode:
        yield


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32 params, bf16 autocast", "bf16 params (FSDP2)"])
@pytest.mark.parametrize("moe", [{"router": "softmax"}, {"router": "sigmoid", "top_k": 3, "norm_topk_prob": False}])
def test_forward_backward_and_bias_update_never_wait_for_the_device(moe, autocast, monkeypatch):
    """Routing, counts, offsets, grouped GEMM, losses, load statistics, the backward and the auxiliary-loss-free
    bias update all stay on the device: run on data-less (fake) tensors, any host read would raise. (The fake
    grouped GEMM is CUDA's fast path: it takes bf16 only, so an fp32 expert matmul would fail here too.)"""
    m = layer(torch.float32 if autocast else torch.bfloat16, **{**ALL_ON, **moe})
    m.train()
    with no_host_reads(monkeypatch, m):
        x = torch.randn(23, 32, dtype=m.gate.weight.dtype, requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = m(x)
        (y.float().pow(2).sum() + m.aux_loss).backward()
        m.after_optimizer_step()
        m.reset_stats()
    assert x.grad is not None and m.experts.gate_up_proj.grad is not None and m.gate.weight.grad is not None


def test_the_no_sync_check_catches_a_host_read(monkeypatch):
    """The check above can fail: a layer reading its counts to the host (as dispatch did with .tolist())."""
    from hybridtron.model import moe as moe_mod

    m = layer(torch.float32)
    real = moe_mod.grouped_linear
    monkeypatch.setattr(moe_mod, "grouped_linear",
                        lambda x, w, offsets, backend, counts=None: real(x, w, offsets, backend, offsets.tolist()))
    with no_host_reads(monkeypatch, m), pytest.raises(AssertionError, match="item|tolist"):
        m(torch.randn(23, 32))
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    with no_host_reads(monkeypatch, layer()), pytest.raises(DynamicOutputShapeException):
        torch.bincount(torch.zeros(4, dtype=torch.int64), minlength=3)  # bincount reads its max on CUDA


def test_megablocks_reads_the_counts_to_the_host_once_per_forward(monkeypatch):
    """megablocks' gmm takes its batch sizes on the host: one read per layer forward for both projections, none
    in the backward (it keeps them)."""
    handed = fake_megablocks(monkeypatch)
    m = layer(torch.float32, backend="megablocks", **ALL_ON)
    calls, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(1) or tolist(t))
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(9), requires_grad=True)
    y = m(x)
    assert len(calls) == 1 and len(handed) == 2 and torch.equal(handed[0], handed[1])
    y.pow(2).sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(y, moe_reference(m, x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_layer_traces_whole_under_torch_compile():
    """Without host reads the layer is one graph (fullgraph=True: a .tolist() would break it), so train.compile
    hands inductor the router's softmax, top-k, renormalisation, counts and losses to fuse."""
    m = layer(torch.float32, **ALL_ON)
    m.train()
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(12))
    compiled = torch.compile(m, fullgraph=True, backend="eager")  # dynamo's tracing is what is checked
    with torch.autocast("cpu", torch.bfloat16):
        y = compiled(x)
        torch.testing.assert_close(y, m(x))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a GPU whose grouped GEMM runs bf16 natively (sm90+: H100; others fall back to a "
                           "per-expert loop that reads the offsets on the host)")
def test_no_host_sync_on_the_gpu():
    """CUDA's own check: any synchronising call in the layer's forward, backward or bias update raises."""
    m = layer(torch.float32, **ALL_ON).cuda()
    m.train()
    x = torch.randn(512, 32, device="cuda", requires_grad=True)
    for debug in (0, "error"):  # a first step unchecked: allocator and kernels' first launches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug)
        try:
            with torch.autocast("cuda", torch.bfloat16):
                y = m(x)
            (y.float().pow(2).sum() + m.aux_loss).backward()
            m.after_optimizer_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert y.dtype == torch.bfloat16
