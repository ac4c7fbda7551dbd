"""train.compile: blocks compiled in place (names and checkpoints unchanged), the same losses and gradients
as eager with every Triton kernel, and the config refusals for combinations that cannot work."""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import ConfigError, load_config
from hybridtron.train.parallel.layout import Layout
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.parallel.parallelize import apply_compile, parallelize

from .test_model_kernels import batch, build, loss_and_grads

pytest.importorskip("triton")


def test_parallelize_compiles_each_block_in_place():
    model = build("dense", "reference")
    names = list(model.state_dict())
    parallelize(model, load_config("tiny", [("train.compile", "true")]), Mesh())
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert list(model.state_dict()) == names
    plain = build("dense", "reference")
    parallelize(plain, load_config("tiny"), Mesh())
    assert all(block._compiled_call_impl is None for block in plain.layers)


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_compiled_blocks_match_eager_with_triton_kernels(name):
    eager, compiled = build(name, "triton"), build(name, "triton")
    apply_compile(compiled, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break fails the test
    ids, labels, docs = batch(2)
    l_e, g_e = loss_and_grads(eager, ids, labels, docs)
    l_c, g_c = loss_and_grads(compiled, ids, labels, docs)
    assert torch.allclose(l_c, l_e, rtol=1e-6)
    for n, g in g_e.items():
        assert torch.allclose(g_c[n], g, rtol=1e-5, atol=1e-7), n


def test_config_refusals():
    with pytest.raises(ConfigError, match="train.compile=true works with parallel.engine=torch only"):
        Layout.from_config(load_config("tiny", [("train.compile", "true"), ("parallel.engine", "deepspeed")]), 1)
    with pytest.raises(ConfigError, match="model.kernels.norm=triton with parallel.tp=2"):
        Layout.from_config(load_config("tiny", [("model.kernels.norm", "triton"), ("parallel.tp", "2"),
                                                ("train.device", "cpu")]), 2)
    assert load_config("tiny", [("train.compile", "true")]).train.compile
