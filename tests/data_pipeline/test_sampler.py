from __future__ import annotations

import pytest
import torch

from hybridtron.data_pipeline import build_loader


class _Index(torch.utils.data.Dataset):
    """Sample i is just [i], so a batch shows which samples were drawn."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i]), "labels": torch.tensor([i]), "doc_ids": torch.tensor([0])}


def _take(loader, n_micro):
    return [next(loader)["input_ids"][:, 0].tolist() for _ in range(n_micro)]


def _steps(ds, micro, accum, dp, n_steps, seed=3, start=0):
    """Per optimizer step, the samples all ranks saw, in rank then micro-batch order."""
    loaders = [build_loader(ds, micro, accum, r, dp, seed=seed, consumed_samples=start) for r in range(dp)]
    out = []
    for _ in range(n_steps):
        out.append([x for ld in loaders for mb in _take(ld, accum) for x in mb])
    return out, loaders


def test_batch_shapes():
    b = next(build_loader(_Index(10), 4, 1))
    assert b["input_ids"].shape == (4, 1) and set(b) == {"input_ids", "labels", "doc_ids"}


def test_epochs_are_permutations_and_differ():
    ds = _Index(24)
    flat = [x for mb in _take(build_loader(ds, 4, 1, seed=5), 18) for x in mb]
    e0, e1, e2 = flat[:24], flat[24:48], flat[48:]
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(24))
    assert e0 != e1 != e2 and e0 != list(range(24))


def test_deterministic_and_seed_dependent():
    ds = _Index(100)
    a = _take(build_loader(ds, 8, 2, seed=1), 10)
    assert a == _take(build_loader(ds, 8, 2, seed=1), 10)
    assert a != _take(build_loader(ds, 8, 2, seed=2), 10)


def test_no_shuffle_is_sequential():
    flat = [x for mb in _take(build_loader(_Index(10), 3, 1, shuffle=False), 5) for x in mb]
    assert flat == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("micro,accum,dp", [(4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4)])
def test_step_content_independent_of_dp_size(micro, accum, dp):
    ds = _Index(37)  # not a multiple of the global batch: steps straddle epochs
    ref, _ = _steps(ds, 8, 1, 1, n_steps=12)
    got, loaders = _steps(ds, micro, accum, dp, n_steps=12)
    assert got == ref
    assert all(ld.state_dict() == {"consumed_samples": 12 * 8} for ld in loaders)


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_equals_uninterrupted(dp):
    ds = _Index(29)
    full, _ = _steps(ds, 2, 3, dp, n_steps=9)
    head, loaders = _steps(ds, 2, 3, dp, n_steps=4)
    state = loaders[0].state_dict()
    assert state == {"consumed_samples": 4 * 2 * 3 * dp}
    resumed, _ = _steps(ds, 2, 3, dp, n_steps=5, start=state["consumed_samples"])
    assert head + resumed == full
    # load_state_dict on a fresh loader does the same
    fresh = [build_loader(ds, 2, 3, r, dp, seed=3) for r in range(dp)]
    for ld in fresh:
        ld.load_state_dict(state)
    assert [x for ld in fresh for mb in _take(ld, 3) for x in mb] == full[4]


def test_state_mid_step_points_at_step_start():
    ld = build_loader(_Index(50), 2, 3, seed=0)
    _take(ld, 3 + 1)  # one whole step and one micro-batch of the next
    assert ld.state_dict() == {"consumed_samples": 6}


def test_bad_rank():
    with pytest.raises(ValueError, match="dp_rank"):
        build_loader(_Index(5), 1, 1, dp_rank=2, dp_size=2)
