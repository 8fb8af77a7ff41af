"""`Share`: what a rank's code holds for a dataset given to its run (`train` in
`%%horovod --data train=df`, the `train=` of `HorovodRunner.run(main, train=df)`).

On the driver a `Share` is a small description (`sources.py`); it travels in the payload
and, on a rank, opens that rank's share of the rows when first used. Its rows are read
through a loader, batch by batch::

    loader = train.loader(batch_size=256, columns=["features", "label"], shuffle=True, seed=0)
    for epoch in range(3):
        for batch in loader:             # every rank takes len(loader) steps per epoch
            x, y = batch["features"], batch["label"]
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pyarrow

from .columns import check_columns
from .share_file import ShareFile
from .sources import this_slot


_given: dict[str, "Share"] = {}  # the shares that reached this process, by name


def share(name: str) -> "Share":
    """The share named `name` of this rank's run, from anywhere in its code: a script run by
    `ddlrun --data train=...`, or a module a cell imports.

    >>> train = ddl_magic.data.share("train")
    """
    if name not in _given:
        raise KeyError(f"this process was given no dataset {name!r} (it has "
                       f"{sorted(_given) or 'none'}): give it to the run, e.g. --data "
                       f"{name}=df, or run(main, {name}=df)")
    return _given[name]


def shares_line(name: str, what: str, rows: int, parts: int) -> str:
    """What a run says of a dataset it was given.

    >>> shares_line("train", "DataFrame", 1_000_000, 4)
    "train: DataFrame → each rank's share, 1,000,000 rows in 4 shares"
    """
    return f"{name}: {what} → each rank's share, {rows:,} rows in {parts} shares"


class Share:
    """This rank's share of a dataset; `loader(...)` reads it, `dataset(...)` as a torch
    `IterableDataset` for a `DataLoader` of your own.

    >>> train.num_rows, train.total_rows, train.columns    # on a rank: its share's rows
    (250000, 1000000, ['features', 'label'])
    """

    def __init__(self, name: str, source, description: str = ""):
        self.name = name
        self.source = source
        self.description = description  # what it was made from: "DataFrame", "Parquet", ...
        self._file: ShareFile | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"name": self.name, "source": self.source, "description": self.description}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"], state["source"], state["description"])
        _given[self.name] = self  # arrived on a rank: `share(name)` finds it

    # ---- what it holds ----------------------------------------------------------------------

    @property
    def parts(self) -> int:
        """How many shares the dataset was cut into: the ranks the run started with."""
        return self.source.parts

    @property
    def total_rows(self) -> int:
        """The rows of the whole dataset, every rank's share together."""
        return self.source.total_rows

    @property
    def schema(self) -> pyarrow.Schema:
        return self.source.schema

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    @property
    def slot(self) -> int:
        """Whose share this is: the rank this process was started as."""
        return this_slot()

    @property
    def num_rows(self) -> int:
        """The rows of this rank's share."""
        return self.file().num_rows

    def file(self) -> ShareFile:
        """This rank's share file, opened (written first, for some sources) on first use."""
        with self._lock:
            if self._file is None:
                self._file = self.source.open(self.name, self.slot)
            return self._file

    # ---- reading it ---------------------------------------------------------------------------

    def split(self, fraction: float, seed: int = 0) -> tuple["Share", "Share"]:
        """(the rest, `fraction` of the rows held out), both of this rank's share, e.g. for
        validation: each block of the file gives `round(fraction * rows)` rows at random
        (the same every run with `seed`) to the second. No row is copied.

        >>> training, validation = train.split(0.2, seed=1)
        """
        if not 0 <= fraction < 1:
            raise ValueError(f"split({fraction!r}): give the fraction of rows to hold out, in "
                             "[0, 1)")
        parts = []
        for held_out, suffix in ((False, ""), (True, ":held-out")):
            part = Share(self.name + suffix, self.source, self.description)
            part._file = self.file().part(fraction, seed, held_out)
            parts.append(part)
        return parts[0], parts[1]

    def loader(self, batch_size: int, columns: Sequence[str] | None = None, *,
               shuffle: bool = True, seed: int = 0, drop_last: bool = True,
               shuffle_window: int | None = None, equal_steps: bool = True):
        """Batches of this rank's share: dicts {column: tensor}, numbers 1-D, arrays and ML
        vectors 2-D. Every rank takes `len(loader)` steps per epoch (agreed by the ranks
        before the first); each `for batch in loader` is the next epoch (or the rest of one
        left midway), in a new order when `shuffle` (reproducible from `seed`).
        `shuffle_window`: how many rows are shuffled together (default: about 64 MB of
        them); memory per rank is bounded by it and a batch, not by the share's size.
        `state_dict()` / `load_state_dict()` resume mid-epoch exactly. `equal_steps=False`
        reads every row of this rank's share, whatever the others hold, without a collective
        (an evaluation loop with no collective per step).

        >>> loader = train.loader(batch_size=256, columns=["features", "label"], seed=1)
        >>> for batch in loader:
        ...     step(batch["features"], batch["label"])
        """
        from .loader import ShareLoader

        return ShareLoader(self, batch_size, self._columns(columns), shuffle=shuffle, seed=seed,
                           drop_last=drop_last, shuffle_window=shuffle_window,
                           equal_steps=equal_steps)

    def dataset(self, batch_size: int, columns: Sequence[str] | None = None, *,
                shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                shuffle_window: int | None = None):
        """The same batches as `loader`, as a `torch.utils.data.IterableDataset` for a
        `DataLoader(dataset, batch_size=None, num_workers=..., pin_memory=...)` (its workers
        split the batches among them); call `set_epoch(epoch)` before each epoch, as with
        torch's `DistributedSampler`. The ranks agree on the steps when it is made.
        """
        from .loader import ShareDataset

        return ShareDataset(self.loader(batch_size, columns, shuffle=shuffle, seed=seed,
                                        drop_last=drop_last, shuffle_window=shuffle_window))

    def _columns(self, columns: Sequence[str] | None) -> list[str]:
        if isinstance(columns, str):
            columns = [columns]
        try:
            return check_columns(self.schema, columns)
        except KeyError as exc:
            raise KeyError(f"dataset {self.name!r}: {exc.args[0]}") from None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.name!r} on a rank is this rank's share of the {self.description or 'data'}"
            f" given to the run (a Share), not the {self.description or 'data'} itself, which "
            f"has no '.{name}' here: read its rows with {self.name}.loader(batch_size=..., "
            f"columns=[...]) (or {self.name}.dataset(...) for a DataLoader of your own)")

    def __repr__(self) -> str:
        columns = ", ".join(f"{field.name} ({field.type})" for field in self.schema)
        return (f"<Share {self.name!r}: {self.total_rows:,} rows of a {self.description or 'dataset'}"
                f" in {self.parts} shares; columns {columns}>")
