"""Kernel limits are layout rules (issue 29.5): a config whose model the backend would refuse on the target device
is refused by `Layout.from_config` before anything is built -- also when the backend is ``auto`` -- and the limits
the layout asks (kernels/limits.py) are the ones the kernels enforce at the call."""

from __future__ import annotations

import pytest

from hybridtron.cli import main
from hybridtron.configs import ConfigError, load_config
from hybridtron.kernels import backend, limits, rules
from hybridtron.train.parallel.layout import Layout, check_kernels, check_run, target_layout


@pytest.fixture
def peers(monkeypatch):
    """Which peer libraries 'are installed' (triton is, as on every GPU node): a dict the test fills."""
    present = {"flash_attn": False, "fla": False, "causal_conv1d": False}
    monkeypatch.setattr(rules, "installed", lambda module: present.get(module, True))
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    backend.clear_cache()
    yield present
    backend.clear_cache()


def hybrid(*over):
    return load_config("tiny_hybrid", list(over))


def test_auto_on_a_gpu_is_refused_when_no_kernel_takes_the_chunk_size(peers):
    """The issue's case: chunk_size 128 with auto on CUDA used to fail at the first forward."""
    with pytest.raises(ConfigError, match=r"model.kernels.delta_rule=auto on cuda: no kernel takes this model \(our "
                                          r"Triton delta rule runs chunks of 16, 32, 64 steps, not "
                                          r"model.deltanet.chunk_size=128\).*delta_rule=reference"):
        target_layout(hybrid(("model.deltanet.chunk_size", "128")), 1)
    peers["fla"] = True  # fla's chunks are the same sizes: both named
    with pytest.raises(ConfigError, match=r"not model.deltanet.chunk_size=128; fla's chunked delta rule"):
        target_layout(hybrid(("model.deltanet.chunk_size", "128")), 1)
    # asked for by name, the reference runs any chunk size; so does auto on the CPU (where it is the reference)
    target_layout(hybrid(("model.deltanet.chunk_size", "128"), ("model.kernels.delta_rule", "reference")), 1)
    Layout.from_config(hybrid(("model.deltanet.chunk_size", "128")), 1, "cpu")
    assert target_layout(hybrid(("model.deltanet.chunk_size", "32")), 1).device_type == "cuda"


def test_an_explicit_backend_is_checked_against_the_model(peers):
    with pytest.raises(ConfigError, match=r"model.kernels.delta_rule=triton: our Triton delta rule runs chunks"):
        target_layout(hybrid(("model.deltanet.chunk_size", "48"), ("model.kernels.delta_rule", "triton")), 1)
    with pytest.raises(ConfigError, match=r"delta_rule=fla cannot run on cuda: the fla package is not installed"):
        target_layout(hybrid(("model.kernels.delta_rule", "fla")), 1)
    peers["fla"] = True
    target_layout(hybrid(("model.kernels.delta_rule", "fla")), 1)
    with pytest.raises(ConfigError, match=r"fla's DeltaProduct .* refuses float32 \(train.dtype\)"):
        target_layout(load_config("tiny_deltaproduct", [("model.kernels.delta_rule", "fla"), ("train.dtype", "fp32")]), 1)
    peers["flash_attn"] = True
    with pytest.raises(ConfigError, match=r"flash-attn takes head dims that are multiples of 8 up to 256, not 20"):
        target_layout(load_config("tiny", [("model.kernels.attention", "flash-attn"), ("model.head_dim", "20")]), 1)
    with pytest.raises(ConfigError, match=r"flash-attn computes in float16/bfloat16 only"):
        target_layout(load_config("tiny", [("model.kernels.attention", "flash-attn"), ("train.dtype", "fp32")]), 1)


def test_auto_keeps_the_kernels_that_take_the_model(peers):
    """A filter wider than our conv kernel's: auto is refused only while no installed kernel takes it."""
    sizes = {"width": 5}
    with pytest.raises(backend.BackendError, match=r"takes filter widths 1-4, not model.deltanet.conv_size=5"):
        backend.admissible("conv", "auto", "cuda", sizes, here=False)
    peers["causal_conv1d"] = True  # takes 2-4 only: still nothing
    with pytest.raises(backend.BackendError, match="causal-conv1d takes filter widths 2-4"):
        backend.admissible("conv", "auto", "cuda", sizes, here=False)
    peers["fla"] = True  # fla's conv takes any width
    assert backend.admissible("conv", "auto", "cuda", sizes, here=False) == ("fla", "reference")
    assert backend.admissible("conv", "auto", "cuda", {"width": 4}, here=False) == (
        "triton", "causal-conv1d", "fla", "reference")
    assert backend.admissible("conv", "auto", "cpu", sizes, here=False) == ("reference",)


def test_a_gpu_elsewhere_is_not_this_machines(peers, monkeypatch):
    """submit and plan check for the cluster's GPUs: no GPU here does not refuse a GPU kernel there; a run here
    (here=True) is checked against this machine's device."""
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: False)
    cfg = hybrid(("model.kernels.delta_rule", "triton"))
    assert target_layout(cfg, 1).device_type == "cuda"
    with pytest.raises(ConfigError, match=r"delta_rule=triton cannot run on cuda: no CUDA device is visible"):
        Layout.from_config(cfg, 1, "cuda")


def test_the_limits_are_the_ones_the_kernels_enforce():
    """limits.py is the only place a size limit is written: our kernels refuse exactly what it refuses."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from hybridtron.kernels.gated_delta_rule.chunk import _check
    from hybridtron.kernels.short_conv.triton_kernels import _check_k

    B, T, H, D = 1, 8, 1, 4
    q = torch.zeros(B, T, H, D)
    k = torch.zeros(B, T, 1, H, D)
    g, beta = torch.zeros(B, T, H), torch.zeros(B, T, 1, H)
    for chunk in range(1, 130):
        refused = limits.refusal("delta_rule", "triton", {"chunk_size": chunk}) is not None
        try:
            _check(q, k, k, g, beta, None, None, chunk)
            raised = False
        except ValueError:
            raised = True
        assert raised == refused, chunk
    for K in range(1, 9):
        refused = limits.refusal("conv", "triton", {"width": K}) is not None
        try:
            _check_k(K)
            raised = False
        except ValueError:
            raised = True
        assert raised == refused, K


def test_a_checkpoint_is_checked_for_the_device_it_is_loaded_on(no_interpreter):
    cfg = load_config("tiny", [("model.kernels.norm", "triton")])
    with pytest.raises(ConfigError, match=r"model.kernels.norm=triton cannot run on cpu"):
        check_kernels(cfg, "cpu")
    check_kernels(load_config("tiny"), "cpu")


def test_train_refuses_a_kernel_limit_before_data_or_model(tmp_path, cli_args, capsys, monkeypatch):
    """On the CPU under the interpreter our Triton delta rule runs, but not chunks of 48: the run is refused at
    the layout check, before its data is prepared or its run directory made."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend.clear_cache()
    try:
        code = main(cli_args(tmp_path / "data", tmp_path / "run", [
            "--model.layer_pattern", "LA", "--model.kernels.delta_rule", "triton", "--model.deltanet.chunk_size", "48",
            "--train.device", "cpu"]))
    finally:
        backend.clear_cache()
    err = capsys.readouterr().err
    assert code == 2 and "model.kernels.delta_rule=triton: our Triton delta rule runs chunks of 16, 32, 64" in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_plan_refuses_auto_on_the_gpus_it_plans_for(tmp_path, capsys):
    code = main(["plan", "--config", "tiny_hybrid", "--model.deltanet.chunk_size", "128", "--nodes", "1",
                 "--gpus-per-node", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "model.kernels.delta_rule=auto on cuda: no kernel takes this model" in err, err


def test_device_rules_of_the_layout(monkeypatch):
    """nccl needs CUDA devices; megablocks needs its grouped_gemm kernels: both refused at the layout, not when the
    process group or the MoE layer is built."""
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs CUDA devices"):
        Layout.from_config(load_config("tiny", [("parallel.backend", "nccl")]), 2, "cpu")
    assert Layout.from_config(load_config("tiny", [("parallel.backend", "nccl")]), 2, "cuda", here=False).dp == 2
    moe = [("model.moe.n_experts", "4"), ("model.moe.backend", "megablocks")]
    monkeypatch.setattr(rules, "installed", lambda module: module != "grouped_gemm")
    with pytest.raises(ConfigError, match="model.moe.backend=megablocks needs megablocks and its grouped_gemm"):
        target_layout(load_config("tiny", moe), 1)
    monkeypatch.setattr(rules, "installed", lambda module: True)
    target_layout(load_config("tiny", moe), 1)


def test_check_run_asks_torch_only_where_the_device_decides(monkeypatch, no_interpreter):
    """train.device=auto is CUDA when torch sees a device; the command line's check (check_run) answers from both
    devices without asking, and asks only when their answers differ (issue 39)."""
    asked = []
    monkeypatch.setattr(rules, "cuda_visible", lambda: asked.append("asked") or False)  # this machine: no GPU
    check_run(hybrid(), 1)  # valid on either device
    cfg = load_config("tiny", [("model.kernels.cross_entropy", "flash-attn")])
    with pytest.raises(ConfigError) as refused:  # refused on either device, in the same words
        check_run(cfg, 1)
    assert asked == []
    with pytest.raises(ConfigError) as full:
        Layout.from_config(cfg, 1)  # the run's own check, with the device asked
    assert str(refused.value) == str(full.value) and "(train.device=auto)" in str(refused.value)
    nccl = load_config("tiny", [("parallel.backend", "nccl")])  # two processes on nccl: CUDA only
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs CUDA devices"):
        check_run(nccl, 2)
    assert asked  # the two devices answered differently: torch was asked which one this is
    monkeypatch.setattr(rules, "cuda_visible", lambda: True)  # a GPU here: the same config runs
    check_run(nccl, 2)
    # an explicit device is taken as given: the CPU refuses Triton without the interpreter, without asking torch
    monkeypatch.setattr(rules, "cuda_visible", lambda: pytest.fail("torch was asked"))
    with pytest.raises(ConfigError, match=r"model.kernels.norm=triton cannot run on cpu.*\(train.device=cpu\)"):
        check_run(load_config("tiny", [("model.kernels.norm", "triton"), ("train.device", "cpu")]), 1)
    check_run(load_config("tiny", [("model.kernels.norm", "triton"), ("train.device", "cuda")]), 1)
