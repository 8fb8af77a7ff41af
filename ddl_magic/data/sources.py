"""Where a rank's share comes from: what the driver sends (a small, picklable description)
and what the rank does with it to get its `ShareFile`.

| description       | made from                      | the rank                                         |
|-------------------|--------------------------------|--------------------------------------------------|
| `SparkShares`     | a Spark DataFrame              | maps the file its Spark task wrote beside it (`rank/spark_task.py`) |
| `ArrowFileShares` | a pandas DataFrame, an Arrow/Feather file | maps the one file every rank shares, and reads its row range |
| `DatasetShares`   | Parquet files or folders, a Delta table | reads its row groups with pyarrow into a local share file |

Each description knows every rank's share, and a rank takes the one of its *slot* (the rank
it was started as): an elastic run's replacement, started in a lost rank's slot, reads the
lost rank's rows again from the source.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow

from .order import PieceRange, pieces_of, split_rows
from .share_file import ShareFile, ShareWriter

SHARES_VARIABLE = "DDL_MAGIC_SHARES"  # a Spark task's shares: {"fds": {name: fd}, "ready_fd": fd}
SLOT_VARIABLE = "DDL_MAGIC_SLOT"  # the rank this process was started as


class ShareSourceError(RuntimeError):
    """A rank could not read its share from the source; the message names the rank, the
    dataset and the file."""


@dataclass(eq=False)
class Data:
    """A dataset for a run, with the columns its shares hold (all, if None): a Spark or
    pandas DataFrame, or the path of Parquet files, a Delta table or an Arrow file.

    >>> HorovodRunner(np=2).run(main, train=Data(df, columns=["features", "label"]))
    """

    source: object
    columns: Sequence[str] | None = None

    def __post_init__(self):
        if isinstance(self.columns, str):
            self.columns = [self.columns]


def this_slot() -> int:
    """The slot of this process: the rank it was started as."""
    return int(os.environ.get(SLOT_VARIABLE) or os.environ.get("RANK") or 0)


@dataclass(frozen=True)
class SparkShares:
    """Shares a Spark barrier stage wrote, one per task, each beside its rank."""

    parts: int
    total_rows: int
    schema_bytes: bytes  # the Arrow schema, serialised

    @property
    def schema(self) -> pyarrow.Schema:
        return pyarrow.ipc.read_schema(pyarrow.py_buffer(self.schema_bytes))

    def open(self, name: str, slot: int) -> ShareFile:
        fds = _spark_task_shares()
        if name not in fds:
            raise ShareSourceError(
                f"dataset {name!r}: this rank's Spark task wrote no share of it (it wrote "
                f"{sorted(fds) or 'none'}); a share of a Spark DataFrame reaches only the "
                "ranks of the run it was given to")
        return ShareFile(fds[name])


@dataclass(frozen=True)
class ArrowFileShares:
    """One Arrow IPC file that every rank maps, each reading its own row range: a pandas
    DataFrame the driver wrote (`path` is then the driver's open descriptor, as
    /proc/<pid>/fd/<n>: the file has no name) or an Arrow/Feather file of the user's."""

    path: str
    parts: int
    total_rows: int
    schema_bytes: bytes

    @property
    def schema(self) -> pyarrow.Schema:
        return pyarrow.ipc.read_schema(pyarrow.py_buffer(self.schema_bytes))

    def open(self, name: str, slot: int) -> ShareFile:
        try:
            return ShareFile(self.path, split_rows(self.total_rows, self.parts)[slot])
        except OSError as exc:
            raise ShareSourceError(f"rank {slot} could not open dataset {name!r} at "
                                   f"{self.path}: {exc}") from None


@dataclass(frozen=True)
class DatasetShares:
    """Parquet files (or a Delta table's) as pyarrow fragments of one row group each, with
    their row counts; each rank reads the row groups its range of rows covers."""

    fragments: tuple  # pyarrow.dataset.ParquetFileFragment, one row group each
    piece_rows: tuple[int, ...]
    parts: int
    schema_bytes: bytes
    columns: tuple[str, ...] | None = None

    @property
    def total_rows(self) -> int:
        return sum(self.piece_rows)

    @property
    def schema(self) -> pyarrow.Schema:
        return pyarrow.ipc.read_schema(pyarrow.py_buffer(self.schema_bytes))

    def ranges(self, slot: int) -> list[PieceRange]:
        start, stop = split_rows(self.total_rows, self.parts)[slot]
        return pieces_of(self.piece_rows, start, stop)

    def open(self, name: str, slot: int) -> ShareFile:
        schema = self.schema
        columns = list(self.columns or schema.names)
        schema = pyarrow.schema([schema.field(column) for column in columns])
        ranges = self.ranges(slot)
        expected = sum(piece.stop - piece.start for piece in ranges)
        writer = ShareWriter(schema, expected_rows=expected,
                             what=f"rank {slot}'s share of {name!r}")
        try:
            for piece in ranges:
                fragment = self.fragments[piece.piece]
                try:
                    table = fragment.to_table(schema=self.schema, columns=columns)
                except (OSError, pyarrow.ArrowException) as exc:
                    raise ShareSourceError(
                        f"rank {slot} could not read {fragment.path} (a row group of dataset "
                        f"{name!r}): {type(exc).__name__}: {exc}") from None
                for batch in table.slice(piece.start, piece.stop - piece.start).to_batches():
                    writer.write(batch)
            writer.finish()
        except BaseException:
            writer.abandon()
            raise
        share = ShareFile(writer.fd)
        os.close(writer.fd)  # the mapping holds the file now
        return share


_task_shares: dict[str, int] | None = None
_task_shares_lock = threading.Lock()


def _spark_task_shares() -> dict[str, int]:
    """{dataset: descriptor} of the shares this rank's Spark task wrote, once the task says
    they are complete (it may still be writing while the rank starts)."""
    global _task_shares
    with _task_shares_lock:
        if _task_shares is not None:
            return _task_shares
        given = os.environ.get(SHARES_VARIABLE)
        if not given:
            raise ShareSourceError("this rank has no share of a Spark DataFrame: only ranks "
                                   "whose run was given one have it")
        handed = json.loads(given)
        with os.fdopen(handed["ready_fd"], "rb") as ready:
            word = ready.read()
        said = json.loads(word) if word else {"error": "its Spark task ended before it had "
                                                        "written every row"}
        if "error" in said:
            raise ShareSourceError(f"this rank's share could not be written: {said['error']}")
        _task_shares = {name: int(fd) for name, fd in handed["fds"].items()}
        return _task_shares
