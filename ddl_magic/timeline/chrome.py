"""The driver writes every rank's timeline into one Chrome trace that is always valid JSON.

Horovod's timeline could leave a file holding only ``[`` or an unterminated array when the
job died, and chrome://tracing refused some of them. This writer keeps the file a complete
JSON object at all times::

    {"displayTimeUnit":"ms","otherData":{"producer":"ddl_magic"},"traceEvents":[
    {"ph":"M",...},
    {"ph":"X",...}
    ]}

It is created whole (header and tail written to a temporary file that is renamed into
place), and each batch is appended by one ``pwrite`` that overwrites the closing tail and
puts it back after the new events. Killing the driver between two writes therefore leaves a
valid file. The only moment a reader could see a torn file is inside that one system call,
and ``ddl_magic.timeline.load.load_trace`` reads such a file up to its last complete
event anyway.

Events are complete events (``"ph": "X"``) with ``pid`` = rank and ``tid`` = lane, so
chrome://tracing, Perfetto and our viewer show one row per (rank, lane); our lanes' rows
follow the lane table (``lanes.py``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from .lanes import LANE_ORDER

_HEADER = b'{"displayTimeUnit":"ms","otherData":{"producer":"ddl_magic"},"traceEvents":[\n'
_TAIL = b"\n]}\n"


class TraceWriter:
    """Appends ranks' timeline batches to one Chrome trace file at ``path``.

    Use it from one thread (the driver's event loop). ``event_count`` counts the complete
    events written so far, metadata not included.

    Example:
        >>> import json, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "run.timeline.json")
        >>> with TraceWriter(path) as trace:
        ...     trace.add_rank(0, "node-a")
        ...     trace.write(0, [("pack", "fc1.weight", 10.0, 2.5, {"bytes": 4096})])
        >>> trace.event_count
        1
        >>> [e["name"] for e in json.load(open(path))["traceEvents"]]
        ['process_name', 'process_sort_index', 'thread_name', 'thread_sort_index', 'fc1.weight']
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.event_count = 0
        self._lane_ids: dict[str, int] = {lane: i + 1 for i, lane in enumerate(LANE_ORDER)}
        self._named_lanes: set[tuple[int, int]] = set()
        self._has_events = False
        self._create_complete_file()
        self._fd: int | None = os.open(self.path, os.O_RDWR)
        self._tail_offset = len(_HEADER)

    def add_rank(self, rank: int, host: str) -> None:
        """Name rank ``rank``'s rows "rank N (host)" and sort them by rank.

        Example:
            >>> import tempfile, os
            >>> trace = TraceWriter(os.path.join(tempfile.mkdtemp(), "t.json"))
            >>> trace.add_rank(1, "node-b")
            >>> trace.close()
        """
        self._append(
            [
                _metadata("process_name", rank, 0, {"name": f"rank {rank} ({host})"}),
                _metadata("process_sort_index", rank, 0, {"sort_index": rank}),
            ]
        )

    def write(self, rank: int, events: Iterable[tuple[Any, ...]]) -> None:
        """Append one batch of rank ``rank``'s events in a single write.

        Each event is ``(lane, name, start_us, duration_us, args)`` as drained by
        ``ddl_magic.runtime.timeline.TimelineRecorder.drain``. A (rank, lane) seen for the
        first time also gets its ``thread_name`` and ``thread_sort_index`` metadata. Events
        with a non-finite time are dropped: they would make the file invalid JSON.

        Example:
            >>> import tempfile, os
            >>> with TraceWriter(os.path.join(tempfile.mkdtemp(), "t.json")) as trace:
            ...     trace.write(2, [("allgather", "grads", 0.0, 1.5, None),
            ...                     ("custom lane", "step", 0.0, 9.0, {"step": 3})])
            >>> trace.event_count
            2
        """
        lines: list[bytes] = []
        batch: list[dict[str, Any]] = []
        for lane, name, start_us, duration_us, args in events:
            if not (math.isfinite(start_us) and math.isfinite(duration_us)):
                continue
            tid = self._lane_id(lane)
            if (rank, tid) not in self._named_lanes:
                self._named_lanes.add((rank, tid))
                lines.append(_metadata("thread_name", rank, tid, {"name": lane}))
                lines.append(_metadata("thread_sort_index", rank, tid, {"sort_index": tid}))
            batch.append({
                "ph": "X",
                "pid": rank,
                "tid": tid,
                "name": name,
                "cat": lane,
                "ts": round(start_us, 3),
                "dur": round(max(duration_us, 0.0), 3),
                "args": args or {},
            })
        if batch:
            lines.append(_encode_batch(batch))
            self.event_count += len(batch)
        self._append(lines)

    def close(self) -> None:
        """Flush the file to disk and close it; calling it again does nothing."""
        if self._fd is None:
            return
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _create_complete_file(self) -> None:
        """Put an empty but complete trace at ``path`` without ever exposing a partial one."""
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(_HEADER + _TAIL)
        os.replace(temporary, self.path)

    def _lane_id(self, lane: str) -> int:
        """Known lanes keep their LANE_ORDER row; others follow in order of first sight."""
        tid = self._lane_ids.get(lane)
        if tid is None:
            tid = self._lane_ids[lane] = len(self._lane_ids) + 1
        return tid

    def _append(self, lines: list[bytes]) -> None:
        """Overwrite the tail with ``lines`` and a fresh tail, in one system call."""
        if self._fd is None:
            raise ValueError(f"TraceWriter for {self.path} is closed")
        if not lines:
            return
        separator = b",\n" if self._has_events else b""
        body = separator + b",\n".join(lines)
        _write_all(self._fd, body + _TAIL, self._tail_offset)
        self._tail_offset += len(body)
        self._has_events = True


def join_traces(paths: list[str], path: str) -> str:
    """Write one Chrome trace at `path` of every event of the traces at `paths` (a pool's
    cells, recorded on one clock, the driver's), each rank's name once; returns `path`."""
    events, names = [], set()
    for part in paths:
        with open(part, encoding="utf-8") as trace:
            loaded = json.load(trace)
        for event in loaded if isinstance(loaded, list) else loaded.get("traceEvents", []):
            if event.get("ph") == "M":  # a rank's name, in every cell's trace
                key = json.dumps(event, sort_keys=True)
                if key in names:
                    continue
                names.add(key)
            events.append(event)
    with open(path, "w", encoding="utf-8") as trace:
        json.dump(events, trace)
    return path


def _metadata(kind: str, pid: int, tid: int, args: dict[str, Any]) -> bytes:
    return _encode({"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args})


def _encode_batch(events: list[dict[str, Any]]) -> bytes:
    """The events as JSON objects separated by commas: one encoder call for the whole batch,
    which costs the driver a third of encoding them one by one."""
    try:
        return _strict_json(events)[1:-1]
    except ValueError:  # some event's args hold a NaN: encode each, mending that one
        return b",\n".join(_encode(event) for event in events)


def _encode(event: dict[str, Any]) -> bytes:
    try:
        return _strict_json(event)
    except ValueError:
        return _strict_json({**event, "args": json_safe_args(event["args"])})


def json_safe_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with every value JSON cannot hold as a number (NaN, infinity: a diverged
    loss) turned into its text; the browser's JSON.parse would reject the whole file.

    Example:
        >>> json_safe_args({"loss": float("nan"), "step": 3})
        {'loss': 'nan', 'step': 3}
    """
    safe = {}
    for key, value in args.items():
        try:
            _strict_json(value)
            safe[key] = value
        except ValueError:
            safe[key] = str(value)
    return safe


def _strict_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False, default=_as_json_value).encode()


def args_json(args: dict[str, Any]) -> str:
    """``args`` as the compact JSON text the trace holds them in, NaN mended as above."""
    try:
        return _strict_json(args).decode()
    except ValueError:
        return _strict_json(json_safe_args(args)).decode()


def _as_json_value(value: Any) -> Any:
    """An argument JSON cannot hold as is: a numpy or torch scalar becomes its number, and
    anything else (a dtype, a device) its text, rather than failing the run's timeline."""
    try:
        return value.item()
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return str(value)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """``pwrite`` until all of ``data`` is written; one call in practice for regular files."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
