"""Evaluation computes what training computes: the document ids reach the model exactly when it masks documents
(``model.doc_mask``), in `evaluate`, in the attention-sink probe and in `hybridtron eval`."""

from __future__ import annotations

import json

import pytest
import torch

from hybridtron.cli import main
from hybridtron.configs import load_config
from hybridtron.model.lm import GatedLM
from hybridtron.train.probes import attention_sink
from hybridtron.train.trainer import evaluate


def _batches(n=3, B=2, T=24, vocab=64):
    """Validation-like batches of several packed documents each (ids restart at 0 per sample)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (B, T + 1), generator=g)
        doc = torch.tensor([0] * 7 + [1] * 9 + [2] * (T - 16)).expand(B, T).clone()
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": doc})
    return out


def _model(doc_mask: bool) -> GatedLM:
    cfg = load_config("tiny_hybrid", [("model.d_model", "32"), ("model.n_heads", "2"), ("model.n_kv_heads", "1"),
                                      ("model.doc_mask", str(doc_mask).lower())])
    torch.manual_seed(0)
    model = GatedLM(cfg.model, 64)
    model.init_weights()
    return model


@torch.no_grad()
def _as_trained(model, batches, doc_mask):
    """The loss the way train/step.py feeds the model: doc_ids only under doc_mask."""
    losses = [model(b["input_ids"], b["doc_ids"] if doc_mask else None, labels=b["labels"]).float().item()
              for b in batches]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("doc_mask", [False, True])
def test_evaluate_feeds_document_ids_only_to_a_model_trained_with_them(doc_mask):
    batches = _batches()
    model = _model(doc_mask)
    got = evaluate(model, lambda: iter(batches), len(batches), torch.device("cpu"), None, doc_mask=doc_mask)
    assert got == pytest.approx(_as_trained(model, batches, doc_mask), rel=1e-6)
    # the documents change the loss on these batches, so the check above tells the two apart
    assert abs(_as_trained(model, batches, True) - _as_trained(model, batches, False)) > 1e-4


def test_attention_sink_sees_what_the_model_was_trained_to_see():
    batches = _batches()
    model = _model(False)
    across = attention_sink(model, lambda: iter(batches), len(batches), torch.device("cpu"), None, doc_mask=False)
    within = attention_sink(model, lambda: iter(batches), len(batches), torch.device("cpu"), None, doc_mask=True)
    plain = [{"input_ids": b["input_ids"]} for b in batches]  # no document ids at all: the sequence is the span
    none = attention_sink(model, lambda: iter(plain), len(plain), torch.device("cpu"), None, doc_mask=True)
    assert across == pytest.approx(none, rel=1e-6)
    assert any(abs(across[k] - within[k]) > 1e-4 for k in across)


def test_hybridtron_eval_is_the_loss_of_the_model_as_trained(small_data_dir, cli_args, tmp_path, capsys):
    """`hybridtron eval` of a run without doc_mask equals a plain forward of its checkpoint over the validation
    batches without document ids, and differs from the document-masked loss (what eval reported before)."""
    from hybridtron.data_pipeline import build_dataset
    from hybridtron.train.build import load_for_inference
    from hybridtron.train.recipe import val_loader_factory

    run = tmp_path / "run"
    extra = ["--train.max_steps", "4", "--train.eval_every", "0", "--checkpoint.every", "4"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    cfg, model, _tok, _device = load_for_inference(run / "checkpoints" / "step_00000004", [])
    assert not cfg.model.doc_mask
    loader, batches = val_loader_factory(build_dataset(cfg.data, "val"), cfg)(), []
    while not any(int(b["doc_ids"].max()) > 0 for b in batches):  # up to the first batch that spans two documents
        batches.append(next(loader))
        assert len(batches) < 200, "the validation stream should hold several documents"
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--batches", str(len(batches))]) == 0
    reported = json.loads(capsys.readouterr().out)["val_loss"]
    assert reported == pytest.approx(_as_trained(model, batches, False), rel=1e-6)
    assert abs(reported - _as_trained(model, batches, True)) > 1e-6
