"""The synthetic state-tracking batches: labels against a plain Python loop, seeding, padding, ranges,
and the accuracy helper on a model whose predictions are known."""

from __future__ import annotations

import pytest
import torch

from hybridtron.data_pipeline.synthetic import (
    IGNORE,
    PARITY_VOCAB,
    accuracy,
    modadd_batch,
    pad_id,
    parity_batch,
    vocab_size,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def running_state(row: list[int], modulus: int, pad: int) -> list[int]:
    """The labels of one row, computed token by token."""
    out, state = [], 0
    for tok in row:
        if tok == pad:
            out.append(IGNORE)
        else:
            state = (state + tok) % modulus
            out.append(state)
    return out


@pytest.mark.parametrize("min_length", [None, 1, 5])
def test_parity_labels_are_prefix_xor(min_length):
    x, y = parity_batch(16, 24, gen(0), min_length=min_length)
    assert x.shape == y.shape == (16, 24) and x.dtype == y.dtype == torch.long
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        xor, want = 0, []
        for tok in row:
            if tok == PARITY_VOCAB["<pad>"]:
                want.append(IGNORE)
                continue
            xor ^= tok
            want.append(xor)
        assert labels == want
    assert set(x.unique().tolist()) <= set(PARITY_VOCAB.values())


@pytest.mark.parametrize("modulus", [3, 5, 10])
def test_modadd_labels_and_range(modulus):
    x, y = modadd_batch(32, 20, modulus, gen(1), min_length=3)
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        assert labels == running_state(row, modulus, pad_id(modulus))
    digits, labelled = x[x != pad_id(modulus)], y[y != IGNORE]
    assert digits.min() >= 0 and digits.max() < modulus
    assert labelled.min() >= 0 and labelled.max() < modulus
    assert x.max() < vocab_size(modulus)
    assert len(digits.unique()) == modulus  # every digit is drawn


def test_same_seed_same_batch_other_seed_differs():
    a = parity_batch(8, 32, gen(7), min_length=4)
    b = parity_batch(8, 32, gen(7), min_length=4)
    c = parity_batch(8, 32, gen(8), min_length=4)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    m1, m2 = modadd_batch(8, 32, 7, gen(7)), modadd_batch(8, 32, 7, gen(7))
    assert torch.equal(m1[0], m2[0]) and torch.equal(m1[1], m2[1])
    # One generator drawn from twice gives two different batches.
    g = gen(3)
    assert not torch.equal(parity_batch(8, 32, g)[0], parity_batch(8, 32, g)[0])


def test_padding_is_a_right_suffix_labelled_ignore():
    length, lo = 30, 6
    x, y = parity_batch(64, length, gen(2), min_length=lo)
    pad = x == PARITY_VOCAB["<pad>"]
    assert torch.equal(pad, y == IGNORE)
    n = (~pad).sum(1)
    assert n.min() >= lo and n.max() <= length and len(n.unique()) > 1  # lengths vary within the bounds
    assert torch.equal(pad, torch.arange(length)[None, :] >= n[:, None])  # real tokens first, then pads
    x, y = parity_batch(4, length, gen(2))  # no min_length: full rows
    assert not (y == IGNORE).any()


def test_bad_arguments():
    with pytest.raises(ValueError):
        parity_batch(2, 8, gen(0), min_length=9)
    with pytest.raises(ValueError):
        modadd_batch(2, 8, 1, gen(0))


class Oracle(torch.nn.Module):
    """Logits that predict the given ids."""

    def __init__(self, pred: torch.Tensor, vocab: int):
        super().__init__()
        self.logits = torch.nn.functional.one_hot(pred, vocab).float()

    def forward(self, input_ids):
        return self.logits


def test_accuracy_per_position_last_and_min_position():
    y = torch.tensor([[0, 1, 1, IGNORE], [1, 1, 0, 1]])
    pred = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0]])  # wrong at (0, 1) and (1, 3); (0, 3) is padding
    model, x = Oracle(pred, 3), torch.zeros_like(y)
    assert accuracy(model, x, y) == pytest.approx(5 / 7)
    assert accuracy(model, x, y, last_only=True) == pytest.approx(1 / 2)  # rows end at 2 and 3
    assert accuracy(model, x, y, min_position=2) == pytest.approx(2 / 3)
    assert accuracy(Oracle(y.clamp(min=0), 3), x, y) == 1.0
