"""Activation checkpointing modes (none / full / selective / every k-th block) and bf16 weight casts made once
per optimizer step: same losses and gradients as without them, less recompute or fewer casts than the
alternatives."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.cli import main
from hybridtron.configs import ConfigError, load_config
from hybridtron.train import step as step_mod
from hybridtron.train.build import build_model
from hybridtron.train.device import step_weight_casts
from hybridtron.train.metrics import read_metrics
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.parallel.parallelize import parallelize
from hybridtron.train.plan import plan_table

SMALL = [("model.n_layers", "4"), ("model.d_model", "64"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
         ("model.ffn_hidden", "128"), ("data.seq_len", "32"), ("train.dtype", "fp32")]
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm"}


class _Count(TorchDispatchMode):
    def __init__(self, keep):
        super().__init__()
        self.keep, self.n = keep, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.keep(func, args, kwargs or {}):
            self.n += 1
        return out


def _grads_and_matmuls(mode: str, every: int = 1):
    cfg = load_config("tiny", [*SMALL, ("train.activation_checkpointing", mode),
                               ("train.activation_checkpointing_every", str(every))])
    model = build_model(cfg, 256, torch.device("cpu"))
    parallelize(model, cfg, Mesh())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(ids, None, labels=ids)
    counter = _Count(lambda f, a, k: f._schema.name in MATMULS)
    with counter:  # the backward: what it recomputes shows up as extra matmuls
        loss.backward()
    names = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in model.named_parameters()}
    return loss.item(), {n: p.grad.clone() for n, p in names.items()}, counter.n


def test_checkpointing_modes_equal_losses_and_grads_and_differ_in_recompute():
    base_loss, base_grads, none_mm = _grads_and_matmuls("none")
    recompute = {}
    for mode, every in (("full", 1), ("full", 2), ("selective", 1)):
        loss, grads, mm = _grads_and_matmuls(mode, every)
        assert loss == pytest.approx(base_loss, abs=1e-6), mode
        for n, g in grads.items():
            torch.testing.assert_close(g, base_grads[n], rtol=1e-5, atol=1e-6, msg=f"{mode}/{every}: {n}")
        recompute[(mode, every)] = mm - none_mm
    # full recomputes every block's forward matmuls; every 2nd block about half of them; selective none
    assert recompute[("full", 1)] > 0
    assert 0 < recompute[("full", 2)] < recompute[("full", 1)]
    assert recompute[("selective", 1)] == 0


def test_selective_plans_between_none_and_full():
    # 8 x 256 tokens: the blocks' saved activations, not the fused loss's gradient of the logits (the peak in
    # backward at shorter sequences, the same in every mode), decide the peak
    long = [*SMALL, ("data.seq_len", "256"), ("train.micro_batch_size", "8")]
    acts = {m: plan_table(load_config("tiny", [*long, ("train.activation_checkpointing", m)]), 1, 80,
                          stages=(0,))[0]["activations"]
            for m in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"], acts


def test_checkpointing_config_values():
    assert load_config("tiny", [("train.activation_checkpointing", "true")]).train.activation_checkpointing == "full"
    assert load_config("tiny", [("train.activation_checkpointing", "false")]).train.activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="choose one of"):
        load_config("tiny", [("train.activation_checkpointing", "some")])
    with pytest.raises(ConfigError, match="full only"):
        load_config("tiny", [("train.activation_checkpointing", "selective"), ("train.activation_checkpointing_every", "2")])
    with pytest.raises(ConfigError, match="must be >= 1"):
        load_config("tiny", [("train.activation_checkpointing", "full"), ("train.activation_checkpointing_every", "0")])


def _is_weight_cast(func, args, kwargs):
    """fp32 -> bf16 copies of leaf tensors that require grad: autocast casting a weight."""
    if func is not torch.ops.aten._to_copy.default:
        return False
    x = args[0]
    return kwargs.get("dtype") == torch.bfloat16 and x.dtype == torch.float32 and x.is_leaf and x.requires_grad


def _train_counting_casts(monkeypatch, small_data_dir, cli_args, run, once_per_step: bool):
    real = step_weight_casts
    counter = _Count(_is_weight_cast)

    class Counted:
        def __init__(self, device, dtype, enabled=True):
            self.inner = real(device, dtype, enabled=enabled and once_per_step)

        def __enter__(self):
            counter.__enter__()
            self.inner.__enter__()

        def __exit__(self, *exc):
            self.inner.__exit__(*exc)
            counter.__exit__(*exc)

    monkeypatch.setattr(step_mod, "step_weight_casts", Counted)
    extra = ["--train.max_steps", "2", "--train.warmup_steps", "1", "--train.grad_accum_steps", "3",
             "--train.dtype", "bf16", "--train.eval_every", "0", "--checkpoint.every", "0"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    return counter.n, [r["loss"] for r in read_metrics(run)]


def test_bf16_weights_are_cast_once_per_step_not_per_micro_batch(monkeypatch, small_data_dir, cli_args, tmp_path):
    every, every_losses = _train_counting_casts(monkeypatch, small_data_dir, cli_args, tmp_path / "every", False)
    once, once_losses = _train_counting_casts(monkeypatch, small_data_dir, cli_args, tmp_path / "once", True)
    assert once > 0 and every == 3 * once  # 3 micro-batches a step: three casts of each weight before
    assert once_losses == pytest.approx(every_losses, abs=1e-6)  # the same bf16 copies, made once
