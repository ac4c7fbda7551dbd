"""kernels/tune_cases.py against the real ops: a sabotaged backend is caught by the real check (against the float64
reference, on a small input of the call's kind), and the classes a model's step meets are those `hybridtron kernels`
measures on its cut-down model (one block of each kind)."""

from __future__ import annotations

import pytest
import torch

from hybridtron.kernels import backend, tune
from hybridtron.kernels.tune_cases import CASES

# as a program that calls the tuned ops without the model registers the tuner (kernels/__init__.py)
backend.use_tuner(tune)

ATT = ("attention", (("dtype", "float32"), ("B", 1), ("T", 64), ("H", 4), ("KV", 2), ("D", 8), ("gate", "headwise"),
                     ("docs", True), ("grad", True)))


@pytest.fixture
def cpu_measured(tmp_path):
    tune.reset()
    backend.clear_cache()
    tune.configure(devices=("cpu",), cache_dir=tmp_path)
    yield
    tune.reset()
    backend.clear_cache()


def test_a_backend_off_by_one_percent_is_dropped_by_the_real_check(cpu_measured, monkeypatch):
    from hybridtron.kernels.gated_attention import sdpa

    real = sdpa.sdpa_gated_attention
    monkeypatch.setattr(sdpa, "sdpa_gated_attention", lambda *a, **kw: real(*a, **kw) * 1.01)
    timer_saw = []

    def timer(fns, device):
        timer_saw.extend(fns)
        return {n: 1.0 for n in fns}

    tune.configure(timer=timer)
    with pytest.warns(tune.KernelTuningWarning) as caught:
        d = tune.measure("attention", ATT, torch.device("cpu"))
    said = " ".join(str(w.message) for w in caught)
    assert "sdpa dropped" in said and "disagrees with the reference" in said and "output 0" in said
    assert "flex dropped" in said and "backward needs CUDA" in said
    assert sorted(timer_saw) == ["triton"] and d.chosen == "triton"  # ours (interpreted) agreed with float64


def test_small_checks_keep_the_kind_of_the_call():
    """The check's small input has the class's dtype, head dims, gate, grouping and documents."""
    params = dict(ATT[1]) | {"T": 4096, "B": 4, "H": 16, "KV": 4, "D": 128}
    small = CASES["attention"].inputs(params, torch.device("cpu"), small=True)
    q, k, v, gate, doc_ids = small.tensors
    assert q.shape[-1] == 128 and q.shape[2] // k.shape[2] == 4 and gate.shape == q.shape[:3]
    assert doc_ids.shape == q.shape[:2] and doc_ids.max() > 0 and q.shape[1] <= 128
    assert small.dtypes[:4] == [torch.float32] * 4 and small.dtypes[4] is None


def test_the_cut_down_model_meets_the_classes_of_the_whole_one(monkeypatch):
    """`hybridtron kernels` measures one block of each kind: it must meet exactly the classes a training step and an
    evaluation forward of the whole model meet."""
    from hybridtron.configs import load_config
    from hybridtron.train.build import build_model
    from hybridtron.train.kernel_choice import model_for_kernels

    met = []

    def record(op, shape, device_type):
        met.append(tune.shape_key(shape))
        return "reference"

    monkeypatch.setattr(tune, "choose", record)
    monkeypatch.setattr(tune, "measures_on", lambda device_type: True)
    cfg = load_config("tiny_hybrid", [("data.seq_len", "32"), ("model.d_model", "32"), ("model.n_layers", "4"),
                                      ("model.deltanet.n_v_heads", "4"), ("train.micro_batch_size", "2")])

    def classes(c):
        met.clear()
        model = build_model(c, 64, torch.device("cpu"))
        ids = torch.randint(0, 64, (2, 32))
        docs = torch.tensor([[0] * 10 + [1] * 22, [0] * 32])
        model(ids, docs, labels=ids).backward()
        with torch.no_grad():
            model(ids, docs, labels=ids)
        return set(met)

    whole, cut = classes(cfg), classes(model_for_kernels(cfg))
    assert whole == cut
    assert {k.split("[")[0] for k in whole} == {"attention", "delta_rule", "conv"}
    assert any("grad=False" in k for k in whole) and any("grad=True" in k for k in whole)
