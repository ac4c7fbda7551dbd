"""A resumable, data-parallel-size-independent loader over a map-style dataset.

The global sample order depends only on (seed, len(dataset)): global position p is epoch p // N, sample
perm_e[p % N], with perm_e = randperm(N) from a generator seeded by (seed, e). An optimizer step consumes
``global_batch = micro * accum * dp_size`` consecutive positions; rank r takes the r-th contiguous block of
``micro * accum`` and yields it as ``accum`` micro-batches. Hence a step sees the same samples at any dp_size
with the same global batch, and the whole state is one integer: the global positions consumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch) pairs over the seed space


@dataclass
class DataLoaderState:
    consumed_samples: int = 0  # global samples of whole optimizer steps already taken

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * _GOLDEN + epoch) % (1 << 63))
    return torch.randperm(n, generator=g)


class DistributedLoader:
    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        consumed_samples: int = 0,
        shuffle: bool = True,
    ):
        if micro_batch_size <= 0 or grad_accum_steps <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size} and grad_accum_steps={grad_accum_steps} must be > 0")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        self.dataset = dataset
        self.micro = micro_batch_size
        self.accum = grad_accum_steps
        self.rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch = micro_batch_size * grad_accum_steps * dp_size
        self.state = DataLoaderState(consumed_samples)
        self._micro_step = 0  # micro-batches of the current step already yielded
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def __iter__(self) -> DistributedLoader:
        return self

    def _sample_index(self, pos: int) -> int:
        n = len(self.dataset)
        epoch, k = divmod(pos, n)
        if not self.shuffle:
            return k
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(n, self.seed, epoch), epoch
        return int(self._perm[k])

    def positions(self, step_start: int, micro_step: int) -> range:
        """Global positions of this rank's ``micro_step``-th micro-batch of the step starting at ``step_start``."""
        first = step_start + self.rank * self.micro * self.accum + micro_step * self.micro
        return range(first, first + self.micro)

    def __next__(self) -> dict[str, torch.Tensor]:
        pos = self.positions(self.state.consumed_samples, self._micro_step)
        items = [self.dataset[self._sample_index(p)] for p in pos]
        self._micro_step += 1
        if self._micro_step == self.accum:
            # the step's last micro-batch is out: the whole global batch now counts as consumed
            self._micro_step = 0
            self.state.consumed_samples += self.global_batch
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    def state_dict(self) -> dict:
        """Saved mid-step, this points at the step's start, so a resumed run replays that step whole."""
        return self.state.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.state = DataLoaderState(int(d["consumed_samples"]))
        self._micro_step = 0


# The loader is its own factory: `build_loader(ds, micro, accum, dp_rank, dp_size, seed, consumed_samples, shuffle)`.
build_loader = DistributedLoader
