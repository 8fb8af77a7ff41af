"""The run's timeline once more, in columns: an Arrow IPC stream the viewer reads without JSON.

The Chrome trace (``chrome.py``) is what chrome://tracing and Perfetto open, but parsing a
million events of JSON takes Python seconds. Beside it the driver writes the same events to
``<trace>.arrow`` (``run.timeline.json`` -> ``run.timeline.arrow``), one record batch per
batch the ranks sent::

    rank         int32
    lane         dictionary<int16, string>   codes in the Chrome trace's tid order (LANE_ORDER)
    name         string
    start_us     float64                     rounded as the Chrome trace rounds them
    duration_us  float64
    bytes        float64                     null where the event's args do not say
    world_size   int32                       args["size"]
    op           dictionary<int16, string>   args["op"] (the collective a shared_memory event ran)
    tensors      list<dictionary<int32, string>>   args["tensors"], or [args["tensor"]]
    other_args   string                      the remaining args, as the Chrome trace's JSON
                                             holds them; null when there are none

Why Arrow's IPC *stream* format: it is appended batch by batch, as the events arrive; a batch
is one write, so a driver killed mid-write leaves every earlier batch readable (the reader
stops at the torn one); reading a column costs no parsing and converts to numpy and pandas
without copying; dictionary deltas keep lane, op and tensor names (repeated millions of
times) to a few bytes per event. Rank names ("rank 0 (node-a)") travel as each batch's
custom metadata, so a name added at any time reaches the file with the next write.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from .chrome import TraceWriter, args_json
from .lanes import LANE_ORDER

COLUMNAR_SUFFIX = ".arrow"

_SCHEMA = pa.schema([
    ("rank", pa.int32()),
    ("lane", pa.dictionary(pa.int16(), pa.string())),
    ("name", pa.string()),
    ("start_us", pa.float64()),
    ("duration_us", pa.float64()),
    ("bytes", pa.float64()),
    ("world_size", pa.int32()),
    ("op", pa.dictionary(pa.int16(), pa.string())),
    ("tensors", pa.list_(pa.dictionary(pa.int32(), pa.string()))),
    ("other_args", pa.string()),
])
_RANK_NAMES_KEY = b"rank_names"


def columnar_path(trace_path: str | os.PathLike[str]) -> Path:
    """Where the columnar copy of the Chrome trace at ``trace_path`` lives.

    Example:
        >>> str(columnar_path("/tmp/run.timeline.json"))
        '/tmp/run.timeline.arrow'
        >>> str(columnar_path("/tmp/trace"))
        '/tmp/trace.arrow'
    """
    path = Path(trace_path)
    if path.suffix == ".json":
        return path.with_suffix(COLUMNAR_SUFFIX)
    return path.with_name(path.name + COLUMNAR_SUFFIX)


class ColumnarTraceWriter:
    """Appends ranks' timeline batches to an Arrow IPC stream; same calls as ``TraceWriter``.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "run.timeline.arrow")
        >>> with ColumnarTraceWriter(path) as trace:
        ...     trace.add_rank(0, "node-a")
        ...     trace.write(0, [("pack", "fc1.weight", 10.0, 2.5, {"bytes": 4096})])
        >>> table, names, truncated = read_columnar_trace(path)
        >>> table.column("name").to_pylist(), names, truncated
        (['fc1.weight'], {0: 'rank 0 (node-a)'}, False)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.event_count = 0
        self._lanes = _GrowingDictionary(pa.int16(), LANE_ORDER)
        self._ops = _GrowingDictionary(pa.int16())
        self._tensors = _GrowingDictionary(pa.int32())
        self._new_rank_names: dict[int, str] = {}
        # Unbuffered: each batch reaches the file in the write that makes it, so a killed
        # driver loses at most the batch it was writing.
        self._sink: pa.NativeFile | None = pa.OSFile(str(self.path), "wb")
        self._stream = ipc.new_stream(self._sink, _SCHEMA,
                                      options=ipc.IpcWriteOptions(emit_dictionary_deltas=True))

    def add_rank(self, rank: int, host: str) -> None:
        """Name rank ``rank`` "rank N (host)"; the name goes out with the next batch."""
        self._new_rank_names[rank] = f"rank {rank} ({host})"

    def write(self, rank: int, events: Iterable[tuple[Any, ...]]) -> None:
        """Append one batch of rank ``rank``'s ``(lane, name, start_us, duration_us, args)``
        events; events with a non-finite time are dropped, as the Chrome trace drops them."""
        if self._stream is None:
            raise ValueError(f"ColumnarTraceWriter for {self.path} is closed")
        lanes, names, starts, durations, nbytes, world_sizes, ops = [], [], [], [], [], [], []
        tensor_offsets, tensor_codes, other_args = [0], [], []
        for lane, name, start_us, duration_us, args in events:
            if not (math.isfinite(start_us) and math.isfinite(duration_us)):
                continue
            columns, rest = _split_args(args or {})
            lanes.append(self._lanes.code(lane))
            names.append(name)
            starts.append(round(start_us, 3))
            durations.append(round(max(duration_us, 0.0), 3))
            nbytes.append(columns.get("bytes"))
            world_sizes.append(columns.get("size"))
            ops.append(self._ops.code(columns["op"]) if "op" in columns else None)
            tensor_codes.extend(map(self._tensors.code, columns.get("tensors", ())))
            tensor_offsets.append(len(tensor_codes))
            other_args.append(args_json(rest) if rest else None)
        if not names and not self._new_rank_names:
            return
        batch = pa.record_batch([
            pa.array([rank] * len(names), pa.int32()),
            self._lanes.array(lanes),
            pa.array(names, pa.string()),
            pa.array(starts, pa.float64()),
            pa.array(durations, pa.float64()),
            pa.array(nbytes, pa.float64()),
            pa.array(world_sizes, pa.int32()),
            self._ops.array(ops),
            pa.ListArray.from_arrays(pa.array(tensor_offsets, pa.int32()), self._tensors.array(tensor_codes)),
            pa.array(other_args, pa.string()),
        ], schema=_SCHEMA)
        self._write(batch)
        self.event_count += len(names)

    def close(self) -> None:
        """Write the names not written yet and the end of the stream; calling it again does nothing."""
        if self._stream is None:
            return
        if self._new_rank_names:
            self._write(pa.record_batch([pa.array([], field.type) for field in _SCHEMA], schema=_SCHEMA))
        self._stream.close()
        self._sink.close()
        self._stream = self._sink = None

    def __enter__(self) -> ColumnarTraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, batch: pa.RecordBatch) -> None:
        metadata = None
        if self._new_rank_names:
            metadata = {_RANK_NAMES_KEY: json.dumps(self._new_rank_names).encode()}
            self._new_rank_names = {}
        self._stream.write_batch(batch, custom_metadata=metadata)


def read_columnar_trace(path: str | os.PathLike[str]) -> tuple[pa.Table, dict[int, str], bool]:
    """The events of a columnar trace as one table, the ranks' names, and whether the file
    was cut short (read up to its last complete batch).

    The table keeps the file's batches as its chunks, mapped from the file, not copied. A
    dictionary column's chunks each carry the dictionary as it was at their batch; each
    extends the one before, so the last chunk's dictionary holds every chunk's codes.

    Example:
        >>> table, rank_names, truncated = read_columnar_trace("run.timeline.arrow")  # doctest: +SKIP
        >>> table.column("duration_us").to_numpy().sum()                              # doctest: +SKIP
    """
    batches: list[pa.RecordBatch] = []
    rank_names: dict[int, str] = {}
    truncated = False
    # Mapped, not read: the batches' columns point into the file, so only the pages a caller
    # touches take memory. The mapping lives as long as the table does.
    try:
        reader = ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:  # not even the schema made it to the file
        return _SCHEMA.empty_table(), rank_names, True
    while True:
        try:
            batch, metadata = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError):
            truncated = True
            break
        if metadata is not None and _RANK_NAMES_KEY in metadata:
            rank_names.update({int(rank): name for rank, name in
                               json.loads(metadata[_RANK_NAMES_KEY]).items()})
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=_SCHEMA), dict(sorted(rank_names.items())), truncated


def _split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The args that have a column, in that column's type, and the rest as they are.

    A value that does not fit its column (a count or an empty list as ``tensors``, text as
    ``bytes``) stays among the rest, so the event reads back exactly as it was written.
    """
    columns: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in args.items():
        if key == "bytes" and _is_number(value):
            columns["bytes"] = float(value)
        elif key == "size" and _is_number(value) and float(value).is_integer() and abs(value) < 2**31:
            columns["size"] = int(value)
        elif key == "op" and isinstance(value, str):
            columns["op"] = value
        elif key == "tensor" and isinstance(value, str) and value and "tensors" not in args:
            columns["tensors"] = [value]  # what the viewer reads; kept among the rest too,
            rest[key] = value             # which says where the name came from
        elif key == "tensors" and isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            columns["tensors"] = value
        else:
            rest[key] = value
    return columns, rest


def _is_number(value: Any) -> bool:
    """A finite number, numpy's included; not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class _GrowingDictionary:
    """Codes for repeated strings, stable for the whole stream: new strings get the next code,
    so each batch's dictionary extends the last one and the stream carries only the delta."""

    def __init__(self, index_type: pa.DataType, first: Iterable[str] = ()) -> None:
        self._index_type = index_type
        self._codes: dict[str, int] = {}
        self._values: list[str] = []
        for value in first:
            self.code(value)

    def code(self, value: str) -> int:
        code = self._codes.get(value)
        if code is None:
            code = self._codes[value] = len(self._values)
            self._values.append(value)
        return code

    def array(self, codes: list[int | None]) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(codes, self._index_type),
                                              pa.array(self._values, pa.string()))


class TraceFiles:
    """A run's Chrome trace at ``path`` and its columnar copy beside it, written together.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "run.timeline.json")
        >>> with TraceFiles(path) as trace:
        ...     trace.add_rank(0, "node-a")
        ...     trace.write(0, [("pack", "fc1.weight", 10.0, 2.5, None)])
        >>> sorted(os.listdir(os.path.dirname(path)))
        ['run.timeline.arrow', 'run.timeline.json']
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.chrome = TraceWriter(path)
        self.columns = ColumnarTraceWriter(columnar_path(path))

    def add_rank(self, rank: int, host: str) -> None:
        self.chrome.add_rank(rank, host)
        self.columns.add_rank(rank, host)

    def write(self, rank: int, events: list[tuple[Any, ...]]) -> None:
        self.chrome.write(rank, events)
        self.columns.write(rank, events)

    def close(self) -> None:
        try:
            self.chrome.close()
        finally:
            self.columns.close()

    def __enter__(self) -> TraceFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
