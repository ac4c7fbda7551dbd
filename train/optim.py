"""AdamW with parameter groups.

Weight decay goes on matrices (>= 2-D weights); never on biases; on embeddings and norm scales only
when configured. Decaying a zero-centred norm's ``w`` pulls the scale toward 1, a plain norm's toward
0, which is why it is off by default. A module may override this for its parameters with a
``param_decay`` dict (model.scale.decay_rule: decay on Input-Norm scales, none on Output-Norm ones).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.configs import TrainConfig


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    decay, no_decay = [], []
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # A module's ``param_decay`` ({local parameter name: decay?}) overrides the rules below for those
    # parameters; model.scale.decay_rule uses it for the Input-Norm / Output-Norm scale split.
    declared = {id(getattr(m, n)): d for m in model.modules() for n, d in getattr(m, "param_decay", {}).items()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = id(p) in embedding_params
        is_norm = p.ndim < 2 and not name.endswith("bias")
        if id(p) in declared:
            use_decay = declared[id(p)]
        elif name.endswith("bias"):
            use_decay = False
        elif is_embedding:
            use_decay = cfg.decay_embeddings
        elif is_norm:
            use_decay = cfg.decay_norms
        else:
            use_decay = p.ndim >= 2
        (decay if use_decay else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"}]
    groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # The fused CUDA kernel is one launch for all parameters; on the CPU torch uses its
    # per-parameter loop, whose fixed order keeps fp32 runs bitwise reproducible.
    fused_ok = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused_ok or None,
    )
