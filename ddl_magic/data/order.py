"""Which rows each rank reads, in what order, and how many steps every rank takes: pure.

Everything a loader decides is a function of a few numbers, so that every rank can compute
its part alone, a checkpoint need only hold a position, and a test can check it without a
file or a second process (torch's `DistributedSampler` and Mosaic Streaming work the same way).

**Shares.** A dataset of `total` rows is cut into `parts` contiguous row ranges whose sizes
differ by one row at most (`split_rows`); over a sequence of pieces (Parquet row groups,
files) a rank reads the pieces its range covers, the first and last one partly.

**Steps.** Before the first step the ranks exchange their share sizes, and every rank takes
`steps_per_epoch(sizes, batch_size, drop_last)` steps: the smallest share's number of
batches, so that no rank waits in an allreduce that another never reaches. With
`drop_last`, every batch is full; without it, a rank's last batch may be short. Rows past a
rank's last step are left out of that epoch (a different few each epoch when shuffling),
and `Coverage` says how many.

**The order of an epoch**, for a share stored as blocks (its file's record batches):

    blocks      b0 b1 b2 b3 b4 b5 b6 b7          as written
    permuted    b5 b1 b7 b0 b3 b6 b2 b4          seeded by (seed, epoch, slot)
    windows     [b5 b1 b7][b0 b3 b6][b2 b4]      consecutive blocks, >= window_rows rows each
    rows        each window's rows permuted      seeded by (seed, epoch, slot, window)

So a reader holds one or two windows of the file at a time (memory bounded by the window,
whatever the share's size), every row comes exactly once per pass, and the order changes
every epoch yet is the same on every run with the same seed. Without shuffling the order is
the file's. Any position of an epoch is found without replaying it (`EpochOrder.take`),
which is what makes resuming mid-epoch exact and cheap.

`slot` is the share's index (the rank the run started with), not the rank's current number:
an elastic run may renumber ranks, but a share keeps its order.

>>> order = EpochOrder([4, 4, 4], seed=0, epoch=0, slot=0, shuffle=True, window_rows=8)
>>> sorted(order.take(0, 12).tolist()) == list(range(12))      # every row once
True
>>> bool((order.take(5, 3) == order.take(0, 12)[5:8]).all())    # a position, found directly
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_BLOCKS = 0  # the second word of a block permutation's seed; a window's is 1 + its index


def split_rows(total: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous row ranges [start, stop) covering `total` rows, sizes within one.

    >>> split_rows(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    >>> split_rows(2, 4)
    [(0, 0), (0, 1), (1, 1), (1, 2)]
    """
    if parts < 1:
        raise ValueError(f"a dataset is split among 1 rank or more, not {parts}")
    bounds = [total * part // parts for part in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class PieceRange:
    """Rows [start, stop) of piece `piece` (a row group, a file), in the piece's numbering."""

    piece: int
    start: int
    stop: int


def pieces_of(piece_rows: Sequence[int], start: int, stop: int) -> list[PieceRange]:
    """The parts of consecutive pieces of `piece_rows` rows each that rows [start, stop) of
    their concatenation cover.

    >>> pieces_of([5, 5, 5], 3, 11)
    [PieceRange(piece=0, start=3, stop=5), PieceRange(piece=1, start=0, stop=5), PieceRange(piece=2, start=0, stop=1)]
    """
    ranges, first = [], 0
    for piece, rows in enumerate(piece_rows):
        low, high = max(start, first), min(stop, first + rows)
        if low < high:
            ranges.append(PieceRange(piece, low - first, high - first))
        first += rows
    return ranges


def steps_per_epoch(share_rows: Sequence[int], batch_size: int, drop_last: bool) -> int:
    """How many steps every rank takes per epoch, given every rank's share size.

    >>> steps_per_epoch([1000, 999], 256, drop_last=True)
    3
    >>> steps_per_epoch([1000, 999], 256, drop_last=False)
    4
    >>> steps_per_epoch([1000, 0], 256, drop_last=False)     # an empty share: nobody steps
    0
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not share_rows:
        return 0
    if drop_last:
        return min(rows // batch_size for rows in share_rows)
    return min(-(-rows // batch_size) for rows in share_rows)


def batch_rows(share_rows: int, batch_size: int, step: int) -> int:
    """How many rows a share of `share_rows` rows gives at `step` (its last may be short).

    >>> [batch_rows(999, 256, step) for step in range(4)]
    [256, 256, 256, 231]
    """
    return max(0, min(batch_size, share_rows - step * batch_size))


@dataclass(frozen=True)
class Coverage:
    """What one epoch reads: `steps` steps on each of `ranks` ranks, `rows` rows of the
    dataset's `total` (the rest left out of this epoch; `missing_shares` shares had no rank
    to read them, an elastic run waiting for a replacement)."""

    steps: int
    ranks: int
    rows: int
    total: int
    missing_shares: int = 0

    @property
    def left_out(self) -> int:
        return self.total - self.rows

    def describe(self, name: str, batch_size: int) -> str:
        """'train: 976 steps of 256 rows per epoch on each of 4 ranks: 999,424 of 1,000,000
        rows per epoch (576 left out, different ones each epoch)'"""
        line = (f"{name}: {self.steps:,} steps of {batch_size:,} rows per epoch on each of "
                f"{self.ranks} ranks: {self.rows:,} of {self.total:,} rows per epoch")
        if self.missing_shares:
            line += (f" ({self.missing_shares} of the shares have no rank this epoch: an "
                     "elastic run waiting for a replacement)")
        elif self.left_out:
            line += f" ({self.left_out:,} left out, different ones each epoch when shuffled)"
        return line


def coverage(share_rows: Sequence[int], total: int, batch_size: int, drop_last: bool,
             missing_shares: int = 0) -> Coverage:
    """The `Coverage` of an epoch in which each rank reads a share of `share_rows[r]` rows.

    >>> coverage([1000, 999], 1999, 256, drop_last=True).rows
    1536
    """
    steps = steps_per_epoch(share_rows, batch_size, drop_last)
    read = sum(sum(batch_rows(rows, batch_size, step) for step in range(steps))
               for rows in share_rows)
    return Coverage(steps, len(share_rows), read, total, missing_shares)


@dataclass(frozen=True)
class Window:
    """Consecutive blocks of an epoch's block order, whose rows are shuffled together."""

    blocks: tuple[int, ...]
    start: int  # the epoch position of its first row
    rows: int


class EpochOrder:
    """The order in which one share's rows are read in one epoch (see the module's top).

    `block_rows[i]`: the rows of block i; a row's number is its position in the share
    (blocks in file order). `take(position, count)` gives the share rows at epoch positions
    [position, position + count).
    """

    def __init__(self, block_rows: Sequence[int], *, seed: int, epoch: int, slot: int,
                 shuffle: bool, window_rows: int):
        self.block_rows = np.asarray(block_rows, dtype=np.int64)
        self.block_starts = np.concatenate([[0], np.cumsum(self.block_rows)])
        self.total = int(self.block_starts[-1])
        self._key = (int(seed) & 0xFFFFFFFF, int(epoch), int(slot))
        self.shuffle = shuffle
        blocks = np.arange(len(self.block_rows))
        if shuffle:
            blocks = np.random.default_rng([*self._key, _BLOCKS]).permutation(blocks)
        self.windows = _group(blocks, self.block_rows, max(1, window_rows) if shuffle else 1)
        self._window_starts = np.array([window.start for window in self.windows], dtype=np.int64)
        self._cached: tuple[int, np.ndarray] | None = None

    def window_of(self, position: int) -> int:
        """The index of the window holding epoch position `position`."""
        return int(np.searchsorted(self._window_starts, position, side="right")) - 1

    def window_rows(self, index: int) -> np.ndarray:
        """The share rows of window `index`, in their order for this epoch."""
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        window = self.windows[index]
        rows = np.concatenate([np.arange(self.block_starts[block], self.block_starts[block + 1])
                               for block in window.blocks])
        if self.shuffle:
            rows = np.random.default_rng([*self._key, 1 + index]).permutation(rows)
        self._cached = (index, rows)
        return rows

    def take(self, position: int, count: int) -> np.ndarray:
        """The share rows at epoch positions [position, position + count)."""
        if count <= 0 or position >= self.total:
            return np.empty(0, dtype=np.int64)
        stop = min(position + count, self.total)
        parts, index = [], self.window_of(position)
        while position < stop:
            window = self.windows[index]
            rows = self.window_rows(index)
            end = min(stop, window.start + window.rows)
            parts.append(rows[position - window.start:end - window.start])
            position, index = end, index + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _group(blocks: np.ndarray, block_rows: np.ndarray, window_rows: int) -> list[Window]:
    """Consecutive `blocks` grouped into windows of at least `window_rows` rows (the last
    may have fewer); empty blocks join whichever window they fall in."""
    windows, current, rows, start = [], [], 0, 0
    for block in blocks.tolist():
        current.append(block)
        rows += int(block_rows[block])
        if rows >= window_rows:
            windows.append(Window(tuple(current), start, rows))
            start, current, rows = start + rows, [], 0
    if current:
        windows.append(Window(tuple(current), start, rows))
    return windows
