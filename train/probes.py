"""Evaluation-time measurements of a trained model beyond its loss.

``attention_sink``: per attention layer, the mean attention probability that queries put on the first token of
their document (Xiao et al.'s "attention sink"; the gated-attention paper reports that an output gate removes
most of it). Measured on validation batches with explicit attention scores, so it is for evaluation, not
training.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.model.attention import GatedAttention
from hybridtron.train.device import autocast_context
from hybridtron.train.model_order import canonical_name


@torch.no_grad()
def attention_sink(model: nn.Module, val_loader_factory, n_batches: int, device, amp_dtype, *, doc_mask: bool
                   ) -> dict[str, float]:
    """{layer name: mean probability on the first token a query can see} for every attention layer (empty if
    none): its document's when the model masks documents (``doc_mask``), else the sequence's, the model
    computing as it was trained."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, GatedAttention)}
    if not layers:
        return {}
    was_training = model.training
    model.eval()
    for m in layers.values():
        m.sink_stats = []
    try:
        loader = val_loader_factory()
        for _ in range(n_batches):
            b = next(loader)
            with autocast_context(device, amp_dtype):
                model(b["input_ids"].to(device), b["doc_ids"].to(device) if doc_mask and "doc_ids" in b else None)
        out = {}
        for name, m in layers.items():
            total, count = map(sum, zip(*m.sink_stats, strict=True)) if m.sink_stats else (0.0, 0)
            out[canonical_name(name).removesuffix(".self_attn")] = (
                total / count if count else float("nan"))
        return out
    finally:
        for m in layers.values():
            m.sink_stats = None
        model.train(was_training)
