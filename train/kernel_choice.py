"""``auto``'s kernel choices in a training run (kernels/tune.py measures them at each op's first call on CUDA).

The run's first step runs eagerly even where blocks are compiled: a measurement cannot run inside a compile trace,
so the eager step meets every shape class first and the compiled steps after it find them decided. After that
step rank 0's decisions go to every rank and are installed there (no rank measures again, so every rank runs the
same backends; ranks of one machine already agree through the tuner's locked cache file), the run directory keeps
them in ``kernels.json``, and the log shows the table: each class, every candidate's time or why it was dropped,
and the choice.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from hybridtron.atomic import write_text_atomic
from hybridtron.train.run_dir import naming

KERNELS_JSON = "kernels.json"


def first_step(device: torch.device, compiled: bool):
    """The context of the run's first step: torch.compile's eager stance where blocks are compiled on CUDA."""
    if device.type == "cuda" and compiled:
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def share(mesh, run_dir: Path, log) -> None:
    """After the first step: rank 0's decisions installed on every rank, written to ``run_dir/kernels.json`` and
    logged (nothing on a device where nothing is measured)."""
    from hybridtron.kernels import tune

    mine = {key: d.to_json() for key, d in tune.decisions().items()}
    if mesh.distributed:
        tune.install(mesh.broadcast(mine))
    if mesh.is_main and mine:
        record = {"machine": tune.fingerprint("cuda"), "decisions": mine,
                  "notes": {key: d.note for key, d in tune.decisions().items() if d.note}}
        with naming(run_dir / KERNELS_JSON):  # a failed write names the file (a full disk: exit 4)
            write_text_atomic(run_dir / KERNELS_JSON, json.dumps(record, indent=1) + "\n")
        log(tune.table())
        log(f"kernel choices: {run_dir / KERNELS_JSON}")


def model_for_kernels(cfg):
    """``cfg``'s model cut to one block of each kind its layers have (an attention and a Gated DeltaNet block, each
    with its feed-forward): the same shape classes at a fraction of the memory. No compile, no recompute."""
    import copy

    small = copy.deepcopy(cfg)
    kinds = list(dict.fromkeys(cfg.model.layer_types()))
    small.model.layer_pattern = "".join(kinds)
    small.model.n_layers = len(kinds)
    small.train.compile = False
    small.train.activation_checkpointing = "none"
    return small


def measure_preset(cfg, device: torch.device, log=print) -> None:
    """Meet every tuned shape class of ``cfg``'s training step on ``device``: one forward and backward of a model
    with one block of each kind (`model_for_kernels`) at the run's micro-batch and sequence length, with its
    documents (``model.doc_mask``: synthetic ones of the tuner's mean length) under the run's autocast, then one
    forward without gradients (evaluation's classes). kernels/tune.py measures each class it has not decided."""
    from hybridtron.kernels.tune_cases import DOC_LEN, doc_ids_for
    from hybridtron.train.build import build_model
    from hybridtron.train.device import autocast_context, autocast_dtype
    from hybridtron.train.parallel.mesh import Mesh
    from hybridtron.train.parallel.parallelize import parallelize

    small = model_for_kernels(cfg)
    vocab = small.model.resolve_vocab(small.data.tokenizer.vocab_size)
    model = build_model(small, vocab, device)
    parallelize(model, small, Mesh())  # as one process of the run would run it (recomputation, compile)
    B, T = small.train.micro_batch_size, small.data.seq_len
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (B, T), generator=g, device=device)
    docs = doc_ids_for(B, T, min(DOC_LEN, max(T // 4, 1)), g, device) if small.model.doc_mask else None
    log(f"kernels: measuring {small.model.layer_pattern} blocks of {cfg.model.d_model} at {B} x {T} tokens"
        f"{' with documents' if docs is not None else ''} on {device}")
    with autocast_context(device, autocast_dtype(small.train, device)):
        model(ids, docs, labels=ids).backward()
        with torch.no_grad():
            model(ids, docs, labels=ids)
    del model
