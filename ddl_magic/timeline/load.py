"""Reading a timeline file into a ``TraceData``: ours (columns or JSON) or Horovod's.

Three ways in, one table out:

* the columnar copy a run of ddl_magic writes beside its trace (``columns.py``): read by
  mapping the file, no parsing, when it is there and current;
* ours, written by ``ddl_magic.timeline.chrome.TraceWriter``: a Chrome trace object of
  complete (``"ph": "X"``) events with ``pid`` = rank and ``cat`` = lane;
* Horovod's ``HOROVOD_TIMELINE`` file: a JSON array, often without its closing ``]``, with
  one process per tensor and ``B``/``E`` pairs per activity. It becomes rank 0 with one lane
  per activity (``NEGOTIATE_ALLREDUCE``, ``QUEUE``, ``NCCL_ALLREDUCE``, ...), each event
  named after its tensor.

JSON is read a chunk at a time (``json_reader.py``), keeping only columns.

Example:
    >>> from ddl_magic.timeline.load import load_trace
    >>> trace = load_trace("run.timeline.json")            # doctest: +SKIP
    >>> trace.events.groupby("lane").duration_us.sum()     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import operator
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .columns import COLUMNAR_SUFFIX, columnar_path, read_columnar_trace
from .json_reader import JsonTraceEvents
from .trace import TraceData, events_table

__all__ = ["load_trace"]

_HOROVOD_RANK_READY = "NEGOTIATE_RANK_READY"

_CHROME_EVENT_FIELDS = operator.itemgetter("pid", "tid", "cat", "name", "ts", "dur", "args")


def load_trace(path: str | os.PathLike[str]) -> TraceData:
    """Read a ddl_magic trace or a Horovod timeline file.

    A run of ddl_magic writes its events twice: the Chrome trace at ``path`` and the same
    events in columns beside it (``run.timeline.arrow``, see ``ddl_magic.timeline.columns``).
    The columns are read when they are there, which takes a fraction of a second where
    parsing the JSON takes many; ``path`` may also name the ``.arrow`` file itself. Other
    traces (Horovod's, Chrome's) are parsed as JSON a chunk at a time (``json_reader.py``), so
    a file bigger than memory opens as long as its events, in columns, fit.

    The columns are not used when the JSON is newer (another program wrote the same path
    since, or the driver died between writing the two): the JSON then says more.

    A file cut short (no closing ``]``, a trailing comma, half an event at the end; half a
    batch of columns) is read up to its last complete event and marked ``truncated``.

    Example:
        >>> trace = load_trace("run.timeline.json")         # doctest: +SKIP
        >>> trace.events.groupby("lane").duration_us.sum()  # doctest: +SKIP
    """
    path = Path(path)
    columns = path if path.suffix == COLUMNAR_SUFFIX else columnar_path(path)
    if _columns_are_current(columns, path):
        table, rank_names, truncated = read_columnar_trace(columns)
        trace = _from_columns(table, rank_names)
        trace.truncated, trace.path = truncated, path
        return trace
    events = JsonTraceEvents(path)
    with _garbage_collection_paused():
        batches = iter(events)
        first = next(batches, [])  # the kind of file is known once reading has begun
        batches = itertools.chain([first], batches)
        trace = _from_horovod_events(batches) if events.kind == "array" else _from_chrome_events(batches)
    trace.truncated = events.truncated
    trace.path = path
    return trace


def _columns_are_current(columns: Path, path: Path) -> bool:
    """Whether the columnar file exists and holds at least what the JSON trace at ``path`` does."""
    if not columns.exists():
        return False
    if columns == path or not path.exists():
        return True
    return columns.stat().st_mtime_ns >= path.stat().st_mtime_ns


@contextlib.contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    """Parsing a trace creates millions of dicts and lists, none of them in a cycle; left
    on, the cycle collector rescans them again and again and makes loading 3-4x slower."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _from_chrome_events(batches: Iterable[list[dict[str, Any]]]) -> TraceData:
    """Our format: complete events with pid = rank and the lane in ``cat``."""
    columns = _EventColumns()
    rank_names: dict[int, str] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    tid_of_row: dict[tuple[int, str], Any] = {}
    for batch in batches:
        complete = []
        for e in batch:
            phase = e.get("ph")
            if phase == "X":
                complete.append(e)
            elif phase == "M" and e.get("name") in ("process_name", "thread_name"):
                name = e.get("args", {}).get("name", "")
                if e["name"] == "process_name":
                    rank_names[e.get("pid", 0)] = name
                else:
                    thread_names[(e.get("pid", 0), e.get("tid", 0))] = name
        # A million events make this the hot loop of loading: fetch each event's fields as
        # one tuple and zip(*) them into columns, several times faster than per field.
        try:
            # Our writer gives every event all seven keys, so itemgetter can fetch them in C.
            fields = list(map(_CHROME_EVENT_FIELDS, complete))
        except KeyError:
            # Other tools' Chrome traces leave keys out (no cat, no args).
            fields = [(e.get("pid", 0), e.get("tid", 0), e.get("cat"), e.get("name", ""),
                       e.get("ts", 0.0), e.get("dur", 0.0), e.get("args")) for e in complete]
        if not fields:
            continue
        ranks, tids, lanes, names, starts, durations, args = zip(*fields)
        if None in lanes or "" in lanes:
            lanes = tuple(lane or thread_names.get((rank, tid)) or f"thread {tid}"
                          for lane, rank, tid in zip(lanes, ranks, tids))
        for rank, lane, tid in dict.fromkeys(zip(ranks, lanes, tids)):
            tid_of_row.setdefault((rank, lane), tid)
        columns.add(ranks, lanes, names, starts, durations, args)
    events = columns.table()
    for rank in np.unique(events["rank"].to_numpy()):
        rank_names.setdefault(int(rank), f"rank {rank}")
    # The writer numbers a lane's tid by its fixed order, so sorting by tid keeps rows stable.
    rows = sorted(((int(rank), lane) for rank, lane in tid_of_row), key=lambda row: (
        row[0], _sortable_number(tid_of_row[row]), row[1]))
    return TraceData(events, rows, dict(sorted(rank_names.items())), "ddl_magic")


def _from_horovod_events(batches: Iterable[list[dict[str, Any]]]) -> TraceData:
    """Horovod's format: pid = tensor, B/E pairs per activity, X ticks, global instants."""
    columns = _EventColumns()
    tensor_of_pid: dict[int, str] = {}
    open_spans: dict[int, list[tuple[str, float]]] = {}
    lanes_seen: dict[str, None] = {}
    lanes, names, starts, durations, args = [], [], [], [], []

    def add(lane: str, name: str, start: float, duration: float, event_args: dict | None) -> None:
        lanes.append(lane)
        names.append(name)
        starts.append(start)
        durations.append(duration)
        args.append(event_args)

    def into_columns() -> None:
        lanes_seen.update(dict.fromkeys(lanes))
        columns.add([0] * len(lanes), lanes, names, starts, durations, args)
        for kept in (lanes, names, starts, durations, args):
            kept.clear()

    last_ts = 0.0
    for batch in batches:
        for event in batch:
            phase, pid = event.get("ph"), event.get("pid", 0)
            ts = float(event.get("ts", last_ts))
            last_ts = max(last_ts, ts)
            tensor = tensor_of_pid.get(pid, "")
            if phase == "M":
                if event.get("name") == "process_name" and "name" in event.get("args", {}):
                    tensor_of_pid[pid] = event["args"]["name"]
            elif phase == "B":
                open_spans.setdefault(pid, []).append((event.get("name", ""), ts))
            elif phase == "E" and open_spans.get(pid):
                activity, start = open_spans[pid].pop()
                add(activity, tensor, start, ts - start, {"tensor": tensor})
            elif phase == "X":
                activity = event.get("name", "")
                if activity.isdigit():
                    # Horovod's negotiation tick: the name is the rank that reported ready.
                    add(_HOROVOD_RANK_READY, f"{tensor}: rank {activity} ready", ts, 0.0, {"tensor": tensor})
                else:
                    add(activity, tensor, ts, float(event.get("dur", 0.0)), {"tensor": tensor})
            elif phase in ("i", "I", "R"):
                add(event.get("name", ""), event.get("name", ""), ts, 0.0, None)
        into_columns()
    # A span still open when the file ends is what the job was stuck in: show it to the end.
    for pid, spans in open_spans.items():
        for activity, start in spans:
            tensor = tensor_of_pid.get(pid, "")
            add(activity, f"{tensor} (unfinished)", start, last_ts - start, {"tensor": tensor})
    into_columns()
    rows = [(0, lane) for lane in lanes_seen]
    return TraceData(columns.table(), rows, {0: "rank 0"} if lanes_seen else {}, "horovod")


class _EventColumns:
    """Builds the event table from batches of parsed JSON events, keeping only columns.

    Only what the viewer uses is kept from ``args``. Keeping the dicts themselves (a million
    of them, holding lists) would make every later full garbage collection in the notebook
    walk them all, about a second each time.
    """

    def __init__(self) -> None:
        self._numbers: dict[str, list[np.ndarray]] = {
            key: [] for key in ("rank", "start_us", "duration_us", "bytes", "world_size")}
        self._codes: dict[str, list[np.ndarray]] = {"lane": [], "op": []}
        self._categories: dict[str, dict[str, int]] = {"lane": {}, "op": {}}
        self._names: list[pa.Array] = []
        self._tensors: list[pa.Array] = []

    def add(self, ranks: Sequence[int], lanes: Sequence[str], names: Sequence[str],
            starts: Sequence[float], durations: Sequence[float],
            args: Sequence[dict[str, Any] | None]) -> None:
        """Take one batch of events, given field by field."""
        self._numbers["rank"].append(np.asarray(ranks, dtype=np.int64))
        self._numbers["start_us"].append(_numbers(starts))
        self._numbers["duration_us"].append(_numbers(durations))
        # Only the keys some event's args has are looked up event by event: another tool's
        # trace has none of ours, and a million lookups that find nothing take seconds.
        present = [a for a in args if a]
        keys = set().union(*present) if present else set()

        def values(key: str) -> list[Any] | None:
            return [a.get(key) if a else None for a in args] if key in keys else None

        self._numbers["bytes"].append(_numbers(values("bytes"), len(args)))
        self._numbers["world_size"].append(_numbers(values("size"), len(args)))
        self._add_codes("lane", lanes, len(lanes))
        self._add_codes("op", values("op"), len(args))
        self._names.append(pa.array(names, pa.string()))
        tensors = (list(map(_tensor_names, args)) if keys & {"tensors", "tensor"}
                   else [()] * len(args))
        self._tensors.append(pa.array(tensors, pa.list_(pa.string())))

    def table(self) -> pd.DataFrame:
        """Every batch's events, in the order they were added."""
        numbers = {key: np.concatenate(chunks) if chunks else np.empty(0)
                   for key, chunks in self._numbers.items()}
        return events_table(
            rank=numbers["rank"].astype(np.int64),
            lane=self._categorical("lane"),
            name=pa.chunked_array(self._names, pa.string()),
            start_us=numbers["start_us"],
            duration_us=numbers["duration_us"],
            nbytes=numbers["bytes"],
            world_size=numbers["world_size"],
            op=self._categorical("op"),
            tensors=pa.chunked_array(self._tensors, pa.list_(pa.string())),
        )

    def _add_codes(self, column: str, values: Sequence[Any] | None, count: int) -> None:
        """The batch's values as codes in the whole table's categories (-1 for missing; all
        `count` missing for no values)."""
        if values is None:
            self._codes[column].append(np.full(count, -1, dtype=np.int32))
            return
        try:  # hashed in C++ (twice as fast as pandas on a million strings)
            encoded = pa.array(values, pa.string()).dictionary_encode()
            categories = encoded.dictionary.to_pylist()
            codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # not all strings: whatever pandas makes of them
            batch = pd.Categorical(values)
            categories, codes = list(batch.categories), batch.codes
        known = self._categories[column]
        to_table = np.array([known.setdefault(value, len(known)) for value in categories] + [-1],
                            dtype=np.int32)
        self._codes[column].append(to_table[codes])

    def _categorical(self, column: str) -> pd.Categorical:
        chunks = self._codes[column]
        codes = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int32)
        return pd.Categorical.from_codes(codes, categories=list(self._categories[column]))


def _from_columns(table: pa.Table, rank_names: dict[int, str]) -> TraceData:
    """A trace from the columns ``ddl_magic.timeline.columns`` wrote: no per-event Python object.

    Lane codes follow the Chrome trace's tid order, so rows sort by (rank, lane code).
    """
    lane = _categorical(table.column("lane"))
    events = events_table(
        rank=table.column("rank").to_numpy().astype(np.int64),
        lane=lane,
        name=table.column("name"),
        start_us=table.column("start_us").to_numpy(),
        duration_us=table.column("duration_us").to_numpy(),
        nbytes=table.column("bytes").to_numpy(),
        world_size=table.column("world_size").cast(pa.float64()).to_numpy(),
        op=_categorical(table.column("op")),
        tensors=table.column("tensors"),
    )
    for rank in np.unique(events["rank"].to_numpy()):
        rank_names.setdefault(int(rank), f"rank {rank}")
    codes = pd.DataFrame({"rank": events["rank"].to_numpy(), "lane": lane.codes}).drop_duplicates()
    rows = [(int(rank), lane.categories[code])
            for rank, code in sorted(zip(codes["rank"], codes["lane"]))]
    return TraceData(events, rows, dict(sorted(rank_names.items())), "ddl_magic")


def _categorical(column: pa.ChunkedArray) -> pd.Categorical:
    """A dictionary column as a pandas categorical, codes copied once, missing values -1.

    Every chunk's dictionary extends the one before it (``columns.py`` writes deltas), so
    the longest dictionary holds every chunk's codes.
    """
    chunks = column.chunks
    dictionary = max((c.dictionary for c in chunks), key=len, default=pa.array([], pa.string()))
    codes = np.concatenate([c.indices.fill_null(-1).to_numpy() for c in chunks]) if chunks else []
    return pd.Categorical.from_codes(np.asarray(codes, dtype=np.int32), categories=dictionary.to_pylist())


def _sortable_number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.inf


def _numbers(values: Sequence[Any] | None, count: int | None = None) -> np.ndarray:
    """Floats from JSON values; None and anything not a number become NaN (`count` NaNs for
    no values at all)."""
    if values is None:
        return np.full(count, np.nan)
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(np.float64)


def _tensor_names(args: dict[str, Any] | None) -> tuple[str, ...]:
    """The tensor names an event's args give (a ``tensors`` list or one ``tensor``)."""
    if not args:
        return ()
    if isinstance(args.get("tensors"), list):
        return tuple(args["tensors"])
    return (args["tensor"],) if args.get("tensor") else ()
