"""The backend switch: resolution per device, refusals with reasons, config-time checks."""

from __future__ import annotations

import pytest

from hybridtron.configs import ConfigError, load_config
from hybridtron.kernels import backend, rules
from hybridtron.kernels.backend import BackendError, resolve
from hybridtron.train.parallel.layout import Layout


def test_auto_is_reference_on_cpu(no_interpreter, monkeypatch):
    for op in backend.OPS:
        assert resolve(op, "auto", "cpu") == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter is a test tool: auto stays on the reference
    assert resolve("norm", "auto", "cpu") == "reference"


def test_triton_on_cpu_needs_the_interpreter(no_interpreter, monkeypatch):
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        resolve("norm", "triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backend.triton_installed():
        assert resolve("norm", "triton", "cpu") == "triton"
    monkeypatch.setattr(rules, "triton_installed", lambda: False)
    with pytest.raises(BackendError, match="triton is not installed"):
        resolve("rotary", "triton", "cpu")


def test_flash_attn_refused_on_cpu_and_for_other_ops(no_interpreter):
    with pytest.raises(BackendError, match="flash-attn runs on CUDA GPUs only"):
        resolve("attention", "flash-attn", "cpu")
    with pytest.raises(BackendError, match="does not implement swiglu"):
        resolve("swiglu", "flash-attn", "cpu")
    with pytest.raises(BackendError, match="unknown fused op"):
        resolve("softmax", "auto", "cpu")
    with pytest.raises(BackendError, match="not a backend"):
        resolve("norm", "cuda", "cpu")


def test_auto_on_cuda_without_a_measurement_takes_the_first_runnable(no_interpreter, monkeypatch):
    """Where no shape class is measured (ops without peers, decoding calls, a compile trace): AUTO_ORDER, ours first."""
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    installed = {"flash_attn": False, "fla": False}
    monkeypatch.setattr(rules, "installed", lambda m: installed.get(m, True))
    assert resolve("norm", "auto", "cuda") == "triton"
    assert resolve("attention", "auto", "cuda") == "triton"
    installed["flash_attn"] = True
    assert resolve("attention", "auto", "cuda") == "triton"  # ours takes every dtype and head dim the peers refuse
    assert resolve("attention", "flash-attn", "cuda") == "flash-attn"
    monkeypatch.setattr(rules, "triton_installed", lambda: False)
    assert resolve("attention", "auto", "cuda") == "sdpa"  # torch's, wherever torch runs
    assert resolve("delta_rule", "auto", "cuda") == "reference"  # fla not installed
    installed["fla"] = True
    assert resolve("delta_rule", "auto", "cuda") == "fla"
    assert resolve("cross_entropy", "auto", "cuda") == "reference"
    with pytest.raises(BackendError, match="the causal_conv1d package is not installed"):
        installed["causal_conv1d"] = False
        resolve("conv", "causal-conv1d", "cuda")


def test_config_refuses_what_cannot_run(no_interpreter):
    def layout(*over):
        return Layout.from_config(load_config("tiny", list(over)), 1)

    with pytest.raises(ConfigError, match=r"model.kernels.norm=triton cannot run on cpu.*TRITON_INTERPRET=1"):
        layout(("model.kernels.norm", "triton"), ("train.device", "cpu"))
    with pytest.raises(ConfigError, match="flash-attn does not implement cross_entropy"):
        layout(("model.kernels.cross_entropy", "flash-attn"))
    with pytest.raises(ConfigError, match="flash-attn runs on CUDA GPUs only"):
        layout(("model.kernels.attention", "flash-attn"), ("train.device", "cpu"))
    cfg = load_config("tiny", [("model.kernels.norm", "reference")])
    assert cfg.model.kernels.norm == "reference"


def test_resume_may_change_kernels_but_not_the_model(tmp_path, no_interpreter):
    from hybridtron.train.run_dir import check_resume_compatible

    (tmp_path / "config.yaml").write_text(load_config("tiny").to_yaml())
    check_resume_compatible(load_config("tiny", [("model.kernels.norm", "reference")]), tmp_path)
    with pytest.raises(ConfigError, match="model.d_model"):
        check_resume_compatible(load_config("tiny", [("model.d_model", "64")]), tmp_path)


def test_the_model_registers_the_tuner_and_the_rules_need_neither():
    """kernels/__init__ imports nothing (issue 39): the layout's rules load without torch, and the tuner that decides
    auto on CUDA is registered by importing the model, whose ops it measures (it was kernels/__init__'s import)."""
    import subprocess
    import sys

    code = ("import sys; import hybridtron.kernels.rules, hybridtron.kernels.limits; "
            "print('torch' in sys.modules, 'hybridtron.kernels.tune' in sys.modules); "
            "import hybridtron.model; from hybridtron.kernels import backend; print(backend._tuner.__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "False", "hybridtron.kernels.tune"], res.stdout
