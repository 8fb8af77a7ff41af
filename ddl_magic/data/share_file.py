"""A rank's share on disk: an Arrow IPC file with no name, written once, read block by block.

Whoever has the rows writes them (a Spark task on its executor, a rank reading its Parquet
row groups, the driver for a pandas DataFrame it holds) with `ShareWriter`, into a file that
is unlinked the moment it is created: only open descriptors keep it, so it is gone when the
last process holding one ends, however it ends (finished, SIGKILLed, its executor lost, the
kernel restarted). Nothing is ever left on disk to clean up.

A reader (`ShareFile`) memory-maps it and reads one record batch (a *block*) at a time,
without copying: a block's columns are numpy views into the mapping. Once a block was read
its pages are released from the process (`release`), so a rank's memory holds the blocks it
is reading, not the share, whatever its size (the pages stay in the OS's page cache while
memory allows, which makes the next epoch fast).
"""

from __future__ import annotations

import copy
import ctypes
import errno
import functools
import mmap
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow

from .columns import element_dtype, is_list

SHARE_DIR_VARIABLE = "DDL_MAGIC_SHARE_DIR"  # where shares are written, if not the default
MAX_BLOCK_BYTES = 8 << 20  # a block larger than this is written as several
_PAGE = mmap.PAGESIZE


class ShareDiskFullError(OSError):
    """A share does not fit the local disk it is written to; the message names the host,
    the folder, the bytes needed and the free space."""


def share_directory() -> str:
    """Where shares are written on this machine: `DDL_MAGIC_SHARE_DIR`, else the first of
    Spark's local directories (on an executor), else the system's temporary folder."""
    chosen = os.environ.get(SHARE_DIR_VARIABLE) or os.environ.get("SPARK_LOCAL_DIRS", "")
    return chosen.split(",")[0] or tempfile.gettempdir()


def unlinked_file(directory: str | None = None) -> int:
    """A new, empty file in `directory` that has no name: its descriptor is all there is."""
    directory = directory or share_directory()
    fd, path = tempfile.mkstemp(prefix="ddl_magic-share-", suffix=".arrow", dir=directory)
    os.unlink(path)
    return fd


@dataclass
class ShareSummary:
    """What a writer wrote: rows, bytes, and per column the nulls and (for arrays) the
    narrowest and widest row, which the ranks check before the first step."""

    rows: int = 0
    bytes: int = 0
    nulls: dict[str, int] = field(default_factory=dict)
    widths: dict[str, tuple[int, int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "bytes": self.bytes, "nulls": self.nulls,
                "widths": {name: list(span) for name, span in self.widths.items()}}

    @classmethod
    def from_dict(cls, values: dict) -> "ShareSummary":
        return cls(values["rows"], values["bytes"], dict(values["nulls"]),
                   {name: tuple(span) for name, span in values["widths"].items()})


class ShareWriter:
    """Writes record batches to an unlinked file (`fd`), in blocks of at most
    `MAX_BLOCK_BYTES`, counting what `ShareSummary` holds.

    `expected_rows`: how many rows are coming, if known: after the first batch the writer
    checks that that many fit the disk, and raises `ShareDiskFullError` at once if not
    (else when a write fails for want of space).

    >>> writer = ShareWriter(pyarrow.schema([("x", pyarrow.float32())]))
    >>> writer.write(pyarrow.record_batch([pyarrow.array([1.0, 2.0], pyarrow.float32())], ["x"]))
    >>> writer.finish().rows
    2
    """

    def __init__(self, schema: pyarrow.Schema, directory: str | None = None, *,
                 expected_rows: int | None = None, what: str = "this share"):
        self.directory = directory or share_directory()
        self.fd = unlinked_file(self.directory)
        self.schema = schema
        self.summary = ShareSummary(nulls={name: 0 for name in schema.names})
        self._expected_rows = expected_rows
        self._what = what
        self._sink = _file_sink(self.fd)
        self._writer = None  # made with the first batch's schema, or `schema` if none comes

    def write(self, batch: pyarrow.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self._writer is None:
            if batch.schema.names == self.schema.names:
                # The same columns, as the source typed them (a list's element name or
                # nullability may differ from `schema`'s): written as they come, uncopied.
                self.schema = batch.schema
            self._writer = pyarrow.ipc.new_file(self._sink, self.schema)
        if batch.schema != self.schema:
            batch = pyarrow.RecordBatch.from_arrays(
                [batch.column(i).cast(field.type) for i, field in enumerate(self.schema)],
                schema=self.schema)
        first = self.summary.rows == 0
        self._count(batch)
        rows_per_block = max(1, batch.num_rows * MAX_BLOCK_BYTES // max(1, batch.nbytes))
        try:
            for start in range(0, batch.num_rows, rows_per_block):
                self._writer.write_batch(batch.slice(start, rows_per_block))
        except OSError as exc:
            if exc.errno == errno.ENOSPC or "No space left" in str(exc):
                raise self._disk_full(self.summary.bytes) from None
            raise
        self.summary.bytes += batch.nbytes
        if first and self._expected_rows:
            needed = batch.nbytes * self._expected_rows // batch.num_rows
            if needed > shutil.disk_usage(self.directory).free + self.summary.bytes:
                raise self._disk_full(needed)
            if not reserve(self.fd, needed):
                raise self._disk_full(needed)

    def finish(self) -> ShareSummary:
        """Close the file's writer (the descriptor stays open) and return the summary."""
        if self._writer is None:  # no rows: a file of the schema alone
            self._writer = pyarrow.ipc.new_file(self._sink, self.schema)
        self._writer.close()
        self._sink.close()
        return self.summary

    def close_sink(self) -> None:
        """Close what writes the file (not `fd`), also after a failed write."""
        if not self._sink.closed:
            self._sink.close()

    def abandon(self) -> None:
        """Give the file up: closing its last descriptor frees its space."""
        try:
            self.close_sink()
        finally:
            os.close(self.fd)

    def _count(self, batch: pyarrow.RecordBatch) -> None:
        self.summary.rows += batch.num_rows
        for name, column in zip(batch.schema.names, batch.columns):
            self.summary.nulls[name] += column.null_count
            if is_list(column.type):
                column_nulls = column.flatten().null_count
                self.summary.nulls[name] += column_nulls
                low, high = width_span(column)
                known = self.summary.widths.get(name)
                self.summary.widths[name] = ((low, high) if known is None
                                             else (min(known[0], low), max(known[1], high)))

    def _disk_full(self, needed: int) -> ShareDiskFullError:
        free = shutil.disk_usage(self.directory).free
        return ShareDiskFullError(
            errno.ENOSPC,
            f"{self._what} needs about {_size(needed)} of local disk on {socket.gethostname()}, "
            f"but {self.directory} has {_size(free)} free: run on more ranks (smaller shares), "
            f"give the executors more local disk (spark.local.dir), or set "
            f"{SHARE_DIR_VARIABLE} to a folder with room")


class ShareFile:
    """Rows [start, stop) of an Arrow IPC file, memory-mapped, read block by block.

    `source`: an open descriptor (the share's; it is duplicated, the caller keeps its own)
    or a path. Block `i` is the i-th record batch that holds rows of the range, cut to it.
    """

    def __init__(self, source: int | str, row_range: tuple[int, int] | None = None):
        if isinstance(source, int):
            self._map = mmap.mmap(source, 0, access=mmap.ACCESS_READ)
        else:
            with open(source, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._buffer = pyarrow.py_buffer(self._map)
        self._reader = pyarrow.ipc.open_file(self._buffer)
        self.schema = self._reader.schema
        # (batch index, first row in the batch, rows) of every block, in file order
        self._blocks: list[tuple[int, int, int]] = []
        batch_rows = [self._reader.get_batch(i).num_rows
                      for i in range(self._reader.num_record_batches)]
        first = 0
        start, stop = row_range if row_range is not None else (0, sum(batch_rows))
        for index, rows in enumerate(batch_rows):
            low, high = max(start, first), min(stop, first + rows)
            if low < high:
                self._blocks.append((index, low - first, high - low))
            first += rows
        self.block_rows = [rows for _, _, rows in self._blocks]
        self.num_rows = sum(self.block_rows)
        self._part: tuple[float, int, bool] | None = None  # (fraction, seed, held out?)

    def part(self, fraction: float, seed: int, held_out: bool) -> "ShareFile":
        """The same file, holding only some rows of each block: `round(fraction * rows)`
        rows chosen at random (seeded by `seed` and the block) if `held_out`, else the rest.
        A validation split that costs no copy and no memory per row."""
        part = copy.copy(self)
        part._part = (fraction, seed, held_out)
        chosen = [round(fraction * rows) for _, _, rows in self._blocks]
        part.block_rows = [k if held_out else rows - k
                           for k, (_, _, rows) in zip(chosen, self._blocks)]
        part.num_rows = sum(part.block_rows)
        return part

    def picked(self, index: int) -> np.ndarray | None:
        """The rows of block `index` this file holds (a `part`'s), or None for all."""
        if self._part is None:
            return None
        fraction, seed, held_out = self._part
        rows = self._blocks[index][2]
        chosen = np.random.default_rng([seed, index]).permutation(rows)[:round(fraction * rows)]
        return np.sort(chosen) if held_out else np.setdiff1d(np.arange(rows), chosen)

    def block(self, index: int) -> pyarrow.RecordBatch:
        batch_index, first, rows = self._blocks[index]
        batch = self._reader.get_batch(batch_index)
        return batch if (first, rows) == (0, batch.num_rows) else batch.slice(first, rows)

    def views(self, index: int, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Block `index`'s columns as numpy arrays, without copying where Arrow allows:
        numbers 1-D, arrays `[rows, width]`. Raises ValueError for nulls or uneven arrays."""
        batch = self.block(index)
        return {name: column_array(batch.column(name), name) for name in names}

    def release(self, index: int) -> None:
        """Let the pages of block `index` go from this process (re-read if touched again)."""
        batch = self._reader.get_batch(self._blocks[index][0])
        addresses = [(buffer.address, buffer.size) for column in batch.columns
                     for buffer in column.buffers() if buffer is not None and buffer.size]
        if not addresses:
            return
        base = self._buffer.address
        low = min(address for address, _ in addresses) - base
        high = max(address + size for address, size in addresses) - base
        low -= low % _PAGE
        high = min(len(self._map), high + (-high) % _PAGE)
        if 0 <= low < high and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, low, high - low)


def column_array(column: pyarrow.Array, name: str) -> np.ndarray:
    """An Arrow column as numpy: numbers 1-D, arrays of numbers 2-D `[rows, width]`."""
    if column.null_count:
        raise ValueError(f"column {name!r} has {column.null_count} nulls in this block: "
                         "drop or fill them first (df.dropna(subset=[...]) or df.fillna(...))")
    if not is_list(column.type):
        return _numbers(column, element_dtype(column.type))
    values = column.flatten()
    if values.null_count:
        raise ValueError(f"column {name!r} holds arrays with {values.null_count} null "
                         "elements: fill them first")
    low, high = width_span(column)
    if low != high:
        raise ValueError(f"column {name!r} holds arrays of {low} to {high} values: every row "
                         "must have the same length to make a 2-D tensor (pad or trim them "
                         "first)")
    return _numbers(values, element_dtype(column.type.value_type)).reshape(len(column), high)


def _numbers(values: pyarrow.Array, dtype: np.dtype) -> np.ndarray:
    array = values.to_numpy(zero_copy_only=False)
    return array if array.dtype == dtype else array.astype(dtype)


def width_span(column: pyarrow.Array) -> tuple[int, int]:
    if pyarrow.types.is_fixed_size_list(column.type):
        return column.type.list_size, column.type.list_size
    if len(column) == 0:
        return 0, 0
    widths = np.diff(column.offsets.to_numpy())
    return int(widths.min()), int(widths.max())


def reserve(fd: int, size: int) -> bool:
    """Have the file system set `size` bytes aside for the file behind `fd` before it is
    written (Linux `fallocate`, its size unchanged); False if there is no room for them.

    A file system that allocates as the writes come (ext4's delayed allocation) writes a
    share of a gigabyte or more 2 to 10 times slower than into room set aside at once
    (measured on ext4: 0.7-3.4 s against 0.16 s for 1.6 GB). Where the call is missing or
    the file system cannot do it, nothing is set aside and the writes allocate as before."""
    if size <= 0 or _fallocate() is None:
        return True
    if _fallocate()(fd, _FALLOC_FL_KEEP_SIZE, 0, size) == 0:
        return True
    return ctypes.get_errno() != errno.ENOSPC


_FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h: set room aside, leave the size as it is


@functools.cache
def _fallocate():
    """libc's `fallocate`, or None where there is none (not Linux)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return function


def _file_sink(fd: int) -> pyarrow.NativeFile:
    """A writable Arrow file over descriptor `fd`'s empty file. Opened to append, not to
    truncate: ext4 writes a truncated file's pages to disk as it is closed (its guard for
    files replaced by truncation), which took 0.3-0.4 s of each 1.6 GB share here."""
    proc_path = f"/proc/self/fd/{fd}"
    if os.path.exists(proc_path):
        return pyarrow.OSFile(proc_path, "ab")
    return pyarrow.PythonFile(os.fdopen(os.dup(fd), "wb"), mode="w")


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"
