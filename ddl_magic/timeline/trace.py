"""A timeline once read: ``TraceData``, a table with one row per event, however it was read.

The loaders (``load.py``: our columnar file, our Chrome trace, Horovod's timeline) and a live
run's ``LiveTimeline`` (``live.py``) make one; the analysis (``analysis.py``) and the figure
(``ui/timeline_figure.py``) read it. Event names and tensor lists stay in Arrow memory, so a
trace of ten million events holds no Python object per event.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

__all__ = ["TraceData", "events_table"]


@dataclasses.dataclass
class TraceData:
    """A loaded timeline: one row of ``events`` per event.

    ``events`` columns: ``rank`` (int), ``lane`` (categorical), ``name`` (text), ``start_us``
    and ``duration_us`` (float microseconds), ``bytes`` and ``world_size`` (float, NaN where
    the event does not say), ``op`` (categorical: the collective a ``shared_memory`` event
    ran, as its args give it, "allreduce", "allgather", ...; missing elsewhere) and
    ``tensors`` (a list of the tensor names the event's args give as ``tensors`` or
    ``tensor``; empty if none). ``name`` and ``tensors`` are Arrow-backed columns: a trace
    of ten million events holds no Python object per event.
    ``rows`` lists the
    (rank, lane) rows in display order, ``rank_names`` labels ranks ("rank 0 (node-a)"),
    ``source`` is "ddl_magic" or "horovod", and ``truncated`` says the file was cut short
    (a writer killed mid-write, a Horovod job that died) and was read up to its last
    complete event. ``origin_us`` is the trace's time zero, its first event's start: the
    figure's time axis counts milliseconds from it.
    """

    events: pd.DataFrame
    rows: list[tuple[int, str]]
    rank_names: dict[int, str]
    source: str
    truncated: bool = False
    path: Path | None = None
    origin_us: float = math.nan

    def __post_init__(self) -> None:
        if math.isnan(self.origin_us):
            self.origin_us = float(self.events["start_us"].min()) if len(self.events) else 0.0

    def between(self, start_ms: float, end_ms: float) -> TraceData:
        """The events overlapping ``[start_ms, end_ms]``, in the figure's milliseconds.

        Use it to draw a zoomed-in part of a big trace in full detail.

        Example:
            >>> trace = load_trace("big.timeline.json")        # doctest: +SKIP
            >>> build_figure(trace.between(1200, 1250))        # doctest: +SKIP
        """
        start = self.events["start_us"].to_numpy() - self.origin_us
        end = start + self.events["duration_us"].to_numpy()
        keep = (end >= start_ms * 1000.0) & (start <= end_ms * 1000.0)
        # The window keeps the whole trace's origin, so its figure shows the same times.
        return dataclasses.replace(self, events=self.events[keep].reset_index(drop=True))


def events_table(*, rank: np.ndarray, lane: pd.Categorical, name: pa.Array | pa.ChunkedArray,
                 start_us: np.ndarray, duration_us: np.ndarray, nbytes: np.ndarray,
                 world_size: np.ndarray, op: pd.Categorical,
                 tensors: pa.Array | pa.ChunkedArray) -> pd.DataFrame:
    """The event table ``TraceData`` documents. Names and tensor lists stay in Arrow memory,
    so a big trace holds no Python object per event."""
    return pd.DataFrame({
        "rank": rank,
        "lane": lane,
        "name": pd.arrays.ArrowExtensionArray(name),
        "start_us": start_us,
        "duration_us": np.maximum(duration_us, 0.0),
        "bytes": nbytes,
        "world_size": world_size,
        "op": op,
        "tensors": pd.arrays.ArrowExtensionArray(tensors),
    }, copy=False)
