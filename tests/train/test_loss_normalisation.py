"""The loss of a step is the sum of its token losses over all micro-batches (and data-parallel ranks) divided by the
global number of labelled tokens (train/step.py): micro-batches holding different numbers of labelled tokens give
the gradient of the one full batch, not a mean of their means. Where every token is labelled, the step is bitwise
the mean of the micro-batches' means it always was. The several-process layouts (DDP, pipeline) are compared with
one process on a task whose rows hold different numbers of labels in tests/train/test_loss_layouts.py."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridtron.configs import load_config
from hybridtron.model import GatedLM
from hybridtron.train.engine import TorchEngine
from hybridtron.train.optim import build_optimizer
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.step import IGNORE_INDEX
from hybridtron.train.trainer import Trainer

V, B, T = 40, 2, 16


def _setup(tmp_path, accum: int):
    cfg = load_config("tiny", [("model.d_model", "32"), ("model.n_layers", "2"), ("model.n_heads", "2"),
                               ("model.n_kv_heads", "1"), ("data.seq_len", str(T)), ("model.max_seq_len", str(T)),
                               ("train.grad_accum_steps", str(accum)), ("train.micro_batch_size", str(B)),
                               ("train.grad_clip", "0"), ("train.max_steps", "2"),
                               ("train.warmup_steps", "1")])
    torch.manual_seed(0)
    model = GatedLM(cfg.model, V)
    model.init_weights()
    return cfg, model


def _batches(labelled: list[int], seed: int = 1) -> list[dict]:
    """One micro-batch per entry, with that many labelled positions (the others -100), placed at random."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in labelled:
        ids = torch.randint(0, V, (B, T), generator=g)
        labels = torch.full((B, T), IGNORE_INDEX)
        where = torch.randperm(B * T, generator=g)[:n]
        labels.view(-1)[where] = torch.randint(0, V, (n,), generator=g)
        out.append({"input_ids": ids, "labels": labels})
    return out


def _trainer_step(cfg, model, batches, tmp_path) -> tuple[dict, dict[str, torch.Tensor]]:
    """One Trainer step over ``batches``; returns its record and the gradients its update saw."""
    cpu = torch.device("cpu")
    engine = TorchEngine(cfg, model, build_optimizer(model, cfg.train), Mesh(), cpu, None)
    trainer = Trainer(cfg, engine, iter(batches), None, device=cpu, amp_dtype=None, run_dir=tmp_path, config_yaml="",
                      tokenizer_dir=tmp_path, flops_per_token=0.0)
    seen = {}
    trainer.grad_hooks.append(lambda tr: seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters()}))
    return trainer.train_step(), seen


@pytest.mark.parametrize("labelled", [[32, 3, 17], [5, 0, 30]], ids=["uneven", "one_without_labels"])
def test_accumulated_gradient_is_the_full_batch_gradient(labelled, tmp_path):
    cfg, model = _setup(tmp_path, accum=len(labelled))
    batches = _batches(labelled)
    ref = copy.deepcopy(model)
    full = ref(torch.cat([b["input_ids"] for b in batches]), labels=torch.cat([b["labels"] for b in batches]))
    full.backward()  # the mean over every labelled token of the whole batch
    rec, grads = _trainer_step(cfg, model, batches, tmp_path)
    assert rec["loss"] == pytest.approx(full.item(), rel=1e-6)
    assert not rec["skipped"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # the mean of the micro-batches' means (what a step was before) is far from it: the test can tell them apart
    if 0 not in labelled:
        means = copy.deepcopy(model)
        for p in means.parameters():
            p.grad = None
        for b in batches:
            (means(b["input_ids"], labels=b["labels"]) / len(batches)).backward()
        w = ref.embed_tokens.weight.grad
        assert (means.embed_tokens.weight.grad - w).abs().max() > 100 * 1e-5 * w.abs().max()


def test_fully_labelled_micro_batches_step_bitwise_as_a_mean_of_means(tmp_path):
    cfg, model = _setup(tmp_path, accum=3)
    batches = _batches([B * T] * 3)
    ref = copy.deepcopy(model)
    total = torch.zeros(())
    for b in batches:
        loss = ref(b["input_ids"], labels=b["labels"])
        (loss / 3).backward()
        total += loss.detach()
    rec, grads = _trainer_step(cfg, model, batches, tmp_path)
    assert rec["loss"] == (total / 3).item()
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_a_step_without_any_label_is_skipped_as_non_finite(tmp_path):
    cfg, model = _setup(tmp_path, accum=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rec, _ = _trainer_step(cfg, model, _batches([0, 0]), tmp_path)
    assert rec["skipped"]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
