"""`hvd.elastic.ElasticSampler`: a `DistributedSampler` that survives the world changing.

An epoch's indices are put in one order (shuffled by `seed + epoch`, the same on every
rank) and dealt out as `DistributedSampler` deals them: rank r of N takes positions
r, r + N, r + 2N, ... of what is left. Ranks step together, so when each has done k
samples, the ranks together have done exactly the first k * N positions: progress is one
number, the length of that done prefix, and the oldest surviving rank's number is right
for everyone. A reset deals out what follows the prefix over the new world, so no sample
is done twice in an epoch, except the few that pad the last deal so that every rank gets
as many (`DistributedSampler` pads so too).

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, batch in enumerate(loader):
                ...
                state.sampler.record_batch(batch_idx, 32)
                state.commit()
            state.sampler.set_epoch(state.epoch + 1)
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence, Sized

import torch.utils.data

from ..ops import rank, size


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The order in which an epoch visits `range(length)` (Horovod's, for the same seed).

    >>> epoch_order(5, shuffle=False, seed=0, epoch=3)
    [0, 1, 2, 3, 4]
    """
    indices = list(range(length))
    if shuffle:
        random.Random(seed + epoch).shuffle(indices)
    return indices


def deal(remaining: Sequence[int], rank: int, size: int) -> list[int]:
    """Rank `rank`'s share of `remaining` among `size` ranks: every size-th index from
    position `rank`, after padding `remaining` with its own first indices so that every
    rank gets `ceil(len(remaining) / size)`.

    >>> deal([10, 11, 12, 13, 14], rank=1, size=2)
    [11, 13, 10]
    """
    if not remaining:
        return []
    per_rank = math.ceil(len(remaining) / size)
    padded = list(remaining) * math.ceil(per_rank * size / len(remaining))
    return padded[:per_rank * size][rank::size]


class ElasticSampler(torch.utils.data.Sampler):
    """Deals an epoch's indices over the ranks, and again over the new world after a reset,
    skipping what the ranks already did this epoch. Horovod's `ElasticSampler`.

    Track it in the `TorchState` (`sampler=`), call `record_batch` after each batch and
    `set_epoch` at the end of each epoch (not the start: a reset mid-epoch must not clear
    what the epoch did). `dataset` must keep its length; `seed` must be the same on every
    rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        # Progress in the epoch's order: `_partitioned_at` positions were done by every rank
        # together when the current deal was made, and since then this rank did `_done_here`
        # samples of its share, as did each of the `_dealt_over` ranks of that deal.
        self._partitioned_at = 0
        self._done_here = 0
        self._dealt_over = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []  # this rank's share of the remaining indices
        self.reset()

    @property
    def processed_num(self) -> int:
        """Samples of this epoch counted as done on this rank: every rank's before the
        current deal, plus this rank's own since. On one rank, the epoch's progress; on N,
        `state_dict()["processed_num"]` counts the N ranks' samples since the deal (the
        number each rank gets from rank 0 at a sync)."""
        return self._partitioned_at + self._done_here

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: a new order, nothing done. Call it at the end of an epoch."""
        self.epoch = epoch
        self._partitioned_at = self._done_here = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of `batch_size` samples (this rank's) as done. As in Horovod,
        `batch_idx` is not used: every call counts one more batch."""
        self._done_here += batch_size

    def record_indices(self, indices: Sequence[int]) -> None:
        """Count `indices` as done: they must be this rank's next indices, in the order the
        sampler gave them (progress is a count, since ranks step together)."""
        expected = self.indices[self._done_here:self._done_here + len(indices)]
        if list(indices) != expected:
            raise ValueError(
                f"record_indices: expected this rank's next {len(indices)} indices {expected}, "
                f"got {list(indices)}; the sampler counts progress in the order it deals "
                "(pass the indices of each batch as they came, or call record_batch)")
        self._done_here += len(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of batch `batch_idx` of this rank's share."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict:
        """`{"epoch", "processed_num"}`: the epoch and how many of its positions all ranks
        together have done (Horovod's format)."""
        return {"epoch": self.epoch,
                "processed_num": self._partitioned_at + self._done_here * self._dealt_over}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self._partitioned_at, self._done_here = state_dict["processed_num"], 0
        self.reset()

    def reset(self) -> None:
        """Deal what is left of the epoch over the current world (after a reset)."""
        self._partitioned_at += self._done_here * self._dealt_over
        self._done_here = 0
        self.num_replicas, self.rank = size(), rank()
        self._dealt_over = self.num_replicas
        self._deal()

    def commit_point(self) -> tuple[int, int, int, int]:
        """Where the sampler is, for `TorchState.commit()`: returned to by `return_to`."""
        return self.epoch, self._partitioned_at, self._done_here, self._dealt_over

    def return_to(self, point: tuple[int, int, int, int]) -> None:
        """Back to a `commit_point()`. If the world changed since, the share dealt here is
        only a placeholder: the sync that follows every restore deals again."""
        self.epoch, self._partitioned_at, self._done_here, self._dealt_over = point
        self._deal()

    def _deal(self) -> None:
        order = epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        self.remaining_indices = order[self._partitioned_at:]
        self.indices = deal(self.remaining_indices, self.rank, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
