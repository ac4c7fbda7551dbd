"""Synthetic state-tracking tasks: parity of bit strings and running sums modulo m.

Both are token-level: input x_1 .. x_T, and at every position t the label is the state after reading
x_1 .. x_t (the per-position formulation of Grazzi et al., "Unlocking State-Tracking in Linear RNNs
Through Negative Eigenvalues"):

    parity:   x_t in {0, 1},      y_t = x_1 xor ... xor x_t
    modadd:   x_t in [0, m),      y_t = (x_1 + ... + x_t) mod m

They are the groups Z_2 and Z_m: the answer depends on every token so far, so a model must carry a
state and update it exactly, and a test on strings longer than the training strings shows whether it
learned the update or a length-bound shortcut. A linear RNN whose transition matrices have eigenvalues
in [0, 1] (DeltaNet with beta in (0, 1), Mamba) cannot flip the sign of its state, which parity needs
(read a 1: s -> -s); with eigenvalues in [-1, 1] (beta in (0, 2): I - beta k k^T is a reflection at
beta = 2) one step does it. Z_m for m > 2 needs rotations, i.e. products of such reflections
(DeltaProduct, or several layers).

Vocabulary: ids 0 .. m - 1 are the digits (bits for parity, m = 2), ``pad_id(m) = m`` pads rows shorter
than the batch (labels -100 there), so a model needs ``vocab_size(m) = m + 1`` embeddings. Labels are
token ids of the same digits, so a language model's logits score them directly. Everything is drawn
from the given torch.Generator: the same generator state gives the same batch.
"""

from __future__ import annotations

import torch

IGNORE = -100  # label of padding positions (the cross-entropy's ignore_index)
PARITY_VOCAB = {"0": 0, "1": 1, "<pad>": 2}  # parity's tokens: the two bits and the pad


def pad_id(modulus: int) -> int:
    """The padding token of a task over digits 0 .. modulus - 1."""
    return modulus


def vocab_size(modulus: int) -> int:
    """Embeddings a model needs for the task: the digits and the pad."""
    return modulus + 1


def _lengths(batch: int, length: int, min_length: int | None, generator: torch.Generator) -> torch.Tensor:
    if min_length is None:
        return torch.full((batch,), length, dtype=torch.long)
    if not 1 <= min_length <= length:
        raise ValueError(f"min_length={min_length} must be between 1 and length={length}")
    return torch.randint(min_length, length + 1, (batch,), generator=generator)


def modadd_batch(
    batch: int, length: int, modulus: int, generator: torch.Generator, min_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch, length) long: uniform digits in [0, modulus) and their running
    sum mod modulus. With min_length each row has a length uniform in [min_length, length]; the rest of
    the row is pad_id(modulus) with label -100 (right padding: a causal model never sees it early)."""
    if modulus < 2 or length < 1 or batch < 1:
        raise ValueError(f"need modulus >= 2, length >= 1, batch >= 1 (got {modulus}, {length}, {batch})")
    x = torch.randint(0, modulus, (batch, length), generator=generator)
    y = x.cumsum(dim=1) % modulus
    n = _lengths(batch, length, min_length, generator)
    pad = torch.arange(length)[None, :] >= n[:, None]
    return x.masked_fill(pad, pad_id(modulus)), y.masked_fill(pad, IGNORE)


def parity_batch(
    batch: int, length: int, generator: torch.Generator, min_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels): random bits (token ids 0 / 1) and their running parity (prefix xor, ids
    0 / 1); padding as in `modadd_batch`, with PARITY_VOCAB["<pad>"] = 2."""
    return modadd_batch(batch, length, 2, generator, min_length)


@torch.no_grad()
def accuracy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    last_only: bool = False,
    min_position: int = 0,
) -> float:
    """Fraction of labelled positions where the argmax of model(input_ids) equals the label.

    Per position by default (every prefix of every row counts). min_position keeps only positions
    >= min_position (0-based), e.g. the training length, to score the unseen lengths alone. last_only
    scores each row's last labelled position ("sequence accuracy": the state after the whole string)."""
    pred = model(input_ids).argmax(dim=-1)
    mask = labels != IGNORE
    mask[:, :min_position] = False
    if last_only:
        last = torch.where(mask, torch.arange(labels.shape[1], device=labels.device), -1).amax(dim=1)
        rows = last >= 0
        return (pred[rows, last[rows]] == labels[rows, last[rows]]).float().mean().item()
    return ((pred == labels) & mask).sum().item() / max(int(mask.sum()), 1)
