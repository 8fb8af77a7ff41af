"""The rank-side timeline recorder: cheap enough to leave on, off by default.

Horovod's timeline writes every event from rank 0 as it happens, which users measured at up
to ~40% of throughput. Here each rank only appends a tuple to an in-memory buffer; the worker
drains that buffer every so often and ships the batch to the driver, which writes the one
merged trace (see ``ddl_magic.timeline.chrome``).

The runtime calls the recorder on its hot path, so the pattern there is::

    if recorder.enabled:
        start_ns = time.monotonic_ns()
    ...  # the work
    if recorder.enabled:
        recorder.record("scatter_reduce", "allreduce.fc1", start_ns, time.monotonic_ns(),
                        {"bytes": nbytes, "tensors": names, "size": world_size})

Lanes are short strings naming an activity. Every lane the runtime records is listed, with its
row and the kind of time it records, in one table, ``ddl_magic.timeline.lanes``: a new lane
belongs there too (``tests/test_timeline_lanes.py`` checks that real runs record no other).
The recorder itself takes any string.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager
from typing import Any

TimelineEvent = tuple[str, str, float, float, "dict[str, Any] | None"]
"""A drained event: ``(lane, name, start_us, duration_us, args)`` on the driver's clock."""

_NOT_RECORDING = contextlib.nullcontext()


class TimelineRecorder:
    """Buffers timeline events of this process until the worker drains them.

    ``enabled`` is False until the worker turns recording on for a run, and every recording
    call returns at once while it is. ``clock_offset_ns`` is ``driver_clock - local
    monotonic clock``, measured by the worker at rendezvous, so that drained events from
    every rank share the driver's clock.

    Example:
        >>> rec = TimelineRecorder()
        >>> rec.enabled = True
        >>> rec.clock_offset_ns = 1_000
        >>> rec.record("pack", "fc1.weight", 2_000, 5_000)
        >>> rec.drain()
        [('pack', 'fc1.weight', 3.0, 3.0, None)]
        >>> rec.drain()
        []
    """

    def __init__(self) -> None:
        self.enabled: bool = False
        self.clock_offset_ns: int = 0
        # Raw (lane, name, start_ns, end_ns, args) tuples: converting to the driver's
        # clock and to microseconds is left to drain(), off the hot path.
        self._buffer: list[tuple[str, str, int, int, dict[str, Any] | None]] = []

    def record(
        self, lane: str, name: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None
    ) -> None:
        """Buffer one event that ran from ``start_ns`` to ``end_ns`` (``time.monotonic_ns()``).

        Does nothing while ``enabled`` is False.

        Example:
            >>> rec = TimelineRecorder()
            >>> rec.record("negotiate", "fc1.bias", 0, 10)  # off: nothing kept
            >>> rec.enabled = True
            >>> rec.record("negotiate", "fc1.bias", 0, 10, {"bytes": 40})
            >>> rec.drain()
            [('negotiate', 'fc1.bias', 0.0, 0.01, {'bytes': 40})]
        """
        if self.enabled:
            self._buffer.append((lane, name, start_ns, end_ns, args))

    def span(self, lane: str, name: str, **args: Any) -> AbstractContextManager[None]:
        """A context manager recording the time its body takes as one event.

        The event is recorded even when the body raises: the time was spent either way.
        While recording is off it returns a shared no-op context.

        Example:
            >>> rec = TimelineRecorder()
            >>> rec.enabled = True
            >>> with rec.span("user", "epoch 0", epoch=0):
            ...     pass
            >>> [(lane, name, args) for lane, name, _, _, args in rec.drain()]
            [('user', 'epoch 0', {'epoch': 0})]
        """
        if not self.enabled:
            return _NOT_RECORDING
        return _Span(self, lane, name, args or None)

    def drain(self) -> list[TimelineEvent]:
        """Take every buffered event, as ``(lane, name, start_us, duration_us, args)``.

        Times are microseconds on the driver's clock. Safe to call from one thread while
        others record: an event recorded concurrently lands in this batch or the next,
        never in neither.

        Example:
            >>> rec = TimelineRecorder()
            >>> rec.enabled = True
            >>> rec.record("allgather", "grads", 1_000, 3_500)
            >>> rec.drain()
            [('allgather', 'grads', 1.0, 2.5, None)]
        """
        # Copy then delete exactly what was copied, on the one list every thread appends to.
        # Swapping in a fresh list instead could lose an append from a thread that had
        # already loaded the old list when the swap happened. Both slice operations are
        # single operations on the list, so no lock is needed on the recording side.
        taken = self._buffer[:]
        del self._buffer[: len(taken)]
        offset_ns = self.clock_offset_ns
        return [
            (lane, name, (start_ns + offset_ns) / 1000.0, max(end_ns - start_ns, 0) / 1000.0, args)
            for lane, name, start_ns, end_ns, args in taken
        ]


class _Span:
    """The context manager behind ``TimelineRecorder.span`` while recording is on."""

    __slots__ = ("_recorder", "_lane", "_name", "_args", "_start_ns")

    def __init__(
        self, recorder: TimelineRecorder, lane: str, name: str, args: dict[str, Any] | None
    ) -> None:
        self._recorder = recorder
        self._lane = lane
        self._name = name
        self._args = args
        self._start_ns = 0

    def __enter__(self) -> None:
        self._start_ns = time.monotonic_ns()

    def __exit__(self, *exc_info: object) -> None:
        self._recorder.record(
            self._lane, self._name, self._start_ns, time.monotonic_ns(), self._args
        )


recorder = TimelineRecorder()
"""The process-wide recorder the runtime writes to and the worker drains."""
