"""The loader: a rank's share, batch by batch, as dicts of tensors.

    share file ──(blocks of the window now read, memory-mapped)──► gather a batch's rows
               ──► {column: tensor} ──► your step

Before the first step the ranks exchange what they hold (one allgather of each share's rows,
nulls and array widths): every rank then takes the same number of steps per epoch
(`order.steps_per_epoch`), and a null or an uneven array anywhere is refused on every rank
alike, naming the counts. The order of each epoch is `order.EpochOrder`'s, a pure function of
(seed, epoch, the share's slot); the position in it is two numbers, the epoch and the steps
taken, which is all `state_dict()` holds: a loader restored from it yields the very batch
that would have come next.

Memory: the blocks of the one or two shuffle windows being read are mapped, and released
as soon as the reading moves past them; a batch is gathered into fresh memory (the tensors
are yours to change). Nothing scales with the share's size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from .columns import is_list
from .order import Coverage, EpochOrder, batch_rows, coverage
from .share_file import ShareFile, width_span

DEFAULT_WINDOW_BYTES = 64 << 20  # rows shuffled together, by default: about this many bytes
_ORDER_FIELDS = ("dataset", "batch_size", "columns", "shuffle", "seed", "drop_last",
                 "shuffle_window", "equal_steps")


class ShareLoader:
    """Batches of one rank's share (made by `Share.loader`; see there)."""

    def __init__(self, share, batch_size: int, columns: list[str], *, shuffle: bool,
                 seed: int, drop_last: bool, shuffle_window: int | None,
                 equal_steps: bool = True):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(f"shuffle_window must be a number of rows, 1 or more, got "
                             f"{shuffle_window!r}")
        self.share = share
        self.batch_size = batch_size
        self.columns = list(columns)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.equal_steps = bool(equal_steps)
        self.epoch = 0
        self.step = 0  # batches yielded in this epoch
        self._shuffle_window = shuffle_window
        self._coverage: Coverage | None = None
        self._views: dict[int, dict[str, np.ndarray]] = {}

    # ---- what every rank agrees on ------------------------------------------------------------

    @property
    def coverage(self) -> Coverage:
        """What an epoch reads over all ranks: steps, rows of the total, rows left out."""
        if self._coverage is None:
            self._coverage = self._agree()
        return self._coverage

    def __len__(self) -> int:
        """Steps per epoch, the same on every rank (the first call is a collective)."""
        return self.coverage.steps

    def _agree(self) -> Coverage:
        file = self.share.file()
        mine = [file.num_rows, *_problems(file, self.columns)]
        if not self.equal_steps:  # this rank alone: every row of its share, no collective
            _refuse_bad_values(self.share.name, self.columns, [mine])
            return coverage([file.num_rows], file.num_rows, self.batch_size, self.drop_last)
        everyone, rank = _allgather(mine, f"ddl_magic.data.{self.share.name}.agree")
        _refuse_bad_values(self.share.name, self.columns, everyone)
        missing = max(0, self.share.parts - len(everyone))
        agreed = coverage([counts[0] for counts in everyone], self.share.total_rows,
                          self.batch_size, self.drop_last, missing)
        if rank == 0:
            print(agreed.describe(self.share.name, self.batch_size), flush=True)
        return agreed

    # ---- reading ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` next, from its start (as torch's `DistributedSampler.set_epoch`);
        without it, each pass over the loader is the next epoch."""
        self.epoch, self.step = int(epoch), 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        steps = len(self)
        if self.step >= steps:  # the last epoch was read to its end: this pass is the next
            self.epoch, self.step = self.epoch + 1, 0
        yield from self._batches(range(self.step, steps), count_steps=True)
        self.epoch, self.step = self.epoch + 1, 0

    def _batches(self, steps, count_steps: bool) -> Iterator[dict[str, torch.Tensor]]:
        file = self.share.file()
        order = EpochOrder(file.block_rows, seed=self.seed, epoch=self.epoch,
                           slot=self.share.slot, shuffle=self.shuffle,
                           window_rows=self._window_rows(file))
        starts = order.block_starts
        try:
            for step in steps:
                position = step * self.batch_size
                rows = order.take(position, batch_rows(file.num_rows, self.batch_size, step))
                batch = self._gather(file, starts, rows)
                self._release_read(file, order, position + len(rows))
                if count_steps:
                    self.step = step + 1
                yield batch
        finally:
            self._release_all(file)

    def _gather(self, file: ShareFile, starts: np.ndarray, rows: np.ndarray) -> dict:
        """The share rows `rows` as tensors, fresh memory; rows of one block are copied
        together, in file order (a batch's rows are a set: its order is the file's)."""
        blocks = np.searchsorted(starts, rows, side="right") - 1
        local = rows - starts[blocks]
        by_place = np.lexsort((local, blocks))
        blocks, local = blocks[by_place], local[by_place]
        runs = np.flatnonzero(np.diff(blocks)) + 1
        bounds = [0, *runs.tolist(), len(rows)]
        out: dict[str, np.ndarray] = {}
        for low, high in zip(bounds[:-1], bounds[1:]):
            block = int(blocks[low])
            views = self._block_views(file, block)
            picked = file.picked(block)
            places = local[low:high] if picked is None else picked[local[low:high]]
            for name, view in views.items():
                if name not in out:
                    out[name] = np.empty((len(rows), *view.shape[1:]), dtype=view.dtype)
                np.take(view, places, axis=0, out=out[name][low:high])
        if not out:  # an empty batch (an empty share without drop_last never gets here)
            return {name: torch.empty(0) for name in self.columns}
        return {name: torch.from_numpy(out[name]) for name in self.columns}

    def _block_views(self, file: ShareFile, block: int) -> dict[str, np.ndarray]:
        views = self._views.get(block)
        if views is None:
            try:
                views = self._views[block] = file.views(block, self.columns)
            except ValueError as exc:
                raise ValueError(f"dataset {self.share.name!r}, rank {self.share.slot}'s "
                                 f"share: {exc}") from None
        return views

    def _release_read(self, file: ShareFile, order: EpochOrder, next_position: int) -> None:
        current = order.window_of(min(next_position, max(order.total - 1, 0)))
        for index in range(current):
            for block in order.windows[index].blocks:
                if self._views.pop(block, None) is not None:
                    file.release(block)

    def _release_all(self, file: ShareFile) -> None:
        for block in list(self._views):
            del self._views[block]
            file.release(block)

    def _window_rows(self, file: ShareFile) -> int:
        if self._shuffle_window is not None:
            return self._shuffle_window
        if not file.block_rows:
            return 1
        views = file.views(0, self.columns)
        row_bytes = max(1, sum(view.nbytes for view in views.values()) // max(1, file.block_rows[0]))
        return max(self.batch_size, DEFAULT_WINDOW_BYTES // row_bytes)

    # ---- a checkpoint's part --------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the loader is: the epoch and the batches of it already yielded, with what
        fixes the order (a checkpoint holds it with the model's; torch's `Stateful`)."""
        agreed = None if self._coverage is None else dataclasses.asdict(self._coverage)
        return {"dataset": self.share.name, "epoch": self.epoch, "step": self.step,
                "batch_size": self.batch_size, "columns": list(self.columns),
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last,
                "shuffle_window": self._shuffle_window, "equal_steps": self.equal_steps,
                "agreed": agreed}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state` (`state_dict()`'s): the next batch is the one that came next
        then. The loader must read the same way (batch size, columns, seed...).

        What the ranks agreed on comes with it (when it was over the same dataset), so that a
        rank restored from it takes the same steps without asking the others again: an
        elastic run's replacement, synced from rank 0, joins the others' loop directly."""
        mine = self.state_dict()
        differ = [name for name in _ORDER_FIELDS if name in state and state[name] != mine[name]]
        if differ:
            raise ValueError(
                "this loader reads differently from the one whose state this is: "
                + ", ".join(f"{name} {state[name]!r} there, {mine[name]!r} here" for name in differ)
                + ". Make it with the same arguments to resume where that one was")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        agreed = state.get("agreed")
        if agreed is not None and agreed["total"] == self.share.total_rows:
            self._coverage = Coverage(**agreed)

    def __repr__(self) -> str:
        return (f"<ShareLoader of {self.share.name!r}: batches of {self.batch_size}, epoch "
                f"{self.epoch}, step {self.step}>")


class ShareDataset(torch.utils.data.IterableDataset):
    """A `ShareLoader`'s batches as an `IterableDataset` (made by `Share.dataset`): each
    element is a whole batch, so use `DataLoader(dataset, batch_size=None, ...)`. With
    `num_workers=W`, worker w reads steps w, w + W, ...; every rank still takes `len(self)`
    steps. Call `set_epoch(epoch)` before each epoch."""

    def __init__(self, loader: ShareLoader):
        super().__init__()
        self.loader = loader
        len(loader)  # the ranks agree now, in the rank's process: workers cannot

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = torch.utils.data.get_worker_info()
        first, every = (0, 1) if worker is None else (worker.id, worker.num_workers)
        steps = range(self.loader.step + first, len(self.loader), every)
        return self.loader._batches(steps, count_steps=worker is None)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def _problems(file: ShareFile, columns: list[str]) -> list[int]:
    """Per column: its nulls, and for arrays the narrowest and widest row (-1: not arrays)."""
    nulls, low, high = [0] * len(columns), [-1] * len(columns), [-1] * len(columns)
    for block in range(len(file.block_rows)):
        batch = file.block(block)
        for index, name in enumerate(columns):
            column = batch.column(name)
            nulls[index] += column.null_count
            if is_list(column.type) and len(column):
                nulls[index] += column.flatten().null_count
                narrowest, widest = width_span(column)
                low[index] = narrowest if low[index] < 0 else min(low[index], narrowest)
                high[index] = max(high[index], widest)
        file.release(block)
    return [*nulls, *low, *high]


def _refuse_bad_values(name: str, columns: list[str], everyone: list[list[int]]) -> None:
    """The same error on every rank for nulls, or arrays of uneven width, in any share."""
    count = len(columns)
    for index, column in enumerate(columns):
        nulls = {rank: counts[1 + index] for rank, counts in enumerate(everyone)
                 if counts[1 + index]}
        if nulls:
            where = ", ".join(f"rank {rank}: {n:,}" for rank, n in nulls.items())
            raise ValueError(
                f"dataset {name!r}: column {column!r} has {sum(nulls.values()):,} nulls ({where})"
                f": drop or fill them before the run (df.dropna(subset=[{column!r}]) or "
                f"df.fillna(...)), or leave the column out (columns=[...])")
        lows = [counts[1 + count + index] for counts in everyone if counts[1 + count + index] >= 0]
        highs = [counts[1 + 2 * count + index] for counts in everyone]
        if lows and min(lows) != max(highs):
            raise ValueError(
                f"dataset {name!r}: column {column!r} holds arrays of {min(lows)} to "
                f"{max(highs)} values: every row must have the same length to make a 2-D "
                "tensor (pad or trim them first)")


def _allgather(values: list[int], name: str) -> tuple[list[list[int]], int]:
    """Every rank's `values`, in rank order, and this rank's number: over torch.distributed
    if the code set it up, else over ddl_magic's runtime (a world of one outside a run)."""
    tensor = torch.tensor([values], dtype=torch.int64)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        return [part[0].tolist() for part in gathered], dist.get_rank()
    from .. import torch as hvd

    if not hvd.is_initialized():
        hvd.init()
    return hvd.allgather(tensor, name=name).tolist(), hvd.rank()
