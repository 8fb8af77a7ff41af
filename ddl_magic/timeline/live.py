"""A run's timeline while it trains: the lanes so far, and where each rank's time went.

The driver already receives every rank's timeline in batches (about one a second per rank)
to write the trace files; the displays (the notebook's run view, the driver's text display)
hand the same batches to a ``LiveTimeline``, which keeps what drawing and a running summary
need and nothing else:

- per rank, the time spent computing, communicating and waiting, added up batch by batch
  (``summary``, ``summary_line``), so the slow rank is visible while it is slow;
- every event's (rank, lane, start, end), merged into fewer intervals when a long run makes
  them many (``trace`` gives them to ``ui/timeline_figure.py``, which draws busy intervals).

Cheap by design: a batch costs a few numpy calls, and the figure is drawn by the display at
most once a second. Numbers only, no widget: a display without a notebook uses it too.

Example:
    >>> live = LiveTimeline()
    >>> live.add(0, [("scatter_reduce", "grads", 0.0, 300.0, None), ("negotiate", "n", 300.0, 700.0, None)])
    >>> live.summary_line(elapsed_s=1.0)
    '[timeline] 1.0 s · % of time waiting/communicating: rank 0 70/30'
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .analysis import NOT_MEASURED, format_percent, lane_category, merge_intervals, union_length
from .lanes import KINDS, LANE_ORDER
from .trace import TraceData, events_table

_KIND_WORDS = {"wait": "waiting", "communicate": "communicating", "compute": "computing"}
COMPACT_AT = 200_000
"""When this many intervals are kept, each row's are merged (``_compact``)."""


class LiveTimeline:
    """What a display keeps of a run's timeline batches. Use it from one thread."""

    def __init__(self) -> None:
        self.rank_names: dict[int, str] = {}
        self._lanes: dict[str, int] = {}
        self._ranks: list[np.ndarray] = []
        self._lane_codes: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []
        self._kept = 0
        self._rows: set[tuple[int, int]] = set()  # (rank, lane code) seen
        self._time_by_kind: dict[int, dict[str, float]] = {}
        self._span_by_rank: dict[int, tuple[float, float]] = {}
        self.version = 0
        """Counts the batches taken in: a display redraws when it changed."""

    def add(self, rank: int, events: Iterable[tuple[Any, ...]]) -> None:
        """Take one ``TimelineBatch``'s ``(lane, name, start_us, duration_us, args)`` events."""
        lanes, starts, durations = [], [], []
        for lane, _name, start_us, duration_us, _args in events:
            if math.isfinite(start_us) and math.isfinite(duration_us):
                lanes.append(self._lanes.setdefault(lane, len(self._lanes)))
                starts.append(start_us)
                durations.append(max(duration_us, 0.0))
        if not lanes:
            return
        codes = np.asarray(lanes, dtype=np.int32)
        start = np.asarray(starts)
        end = start + np.asarray(durations)
        self._ranks.append(np.full(len(codes), rank, dtype=np.int64))
        self._lane_codes.append(codes)
        self._starts.append(start)
        self._ends.append(end)
        self._kept += len(codes)
        self._rows.update((rank, int(code)) for code in np.unique(codes))
        self._count_time(rank, codes, start, end)
        self.version += 1
        if self._kept >= COMPACT_AT:
            self._compact()

    def summary(self) -> dict[int, dict[str, float]]:
        """Per rank: ``wall_ms`` so far and the milliseconds spent in each of ``KINDS``
        (NaN for a kind the rank recorded nothing of)."""
        return {
            rank: {"wall_ms": (last - first) / 1000.0,
                   **{f"{kind}_ms": self._time_by_kind[rank].get(kind, math.nan) / 1000.0
                      for kind in KINDS}}
            for rank, (first, last) in sorted(self._span_by_rank.items())
        }

    def shares(self) -> dict[int, list[str]]:
        """Per rank, the percent of its time so far that went to each of ``KINDS``, as the
        summary shows it ("–" for a kind not recorded)."""
        shown = {}
        for rank, numbers in self.summary().items():
            wall = numbers["wall_ms"]
            shown[rank] = [format_percent(100.0 * numbers[f"{kind}_ms"] / wall) if wall > 0 else NOT_MEASURED
                           for kind in KINDS]
        return shown

    def recorded_kinds(self) -> list[int]:
        """The positions in ``KINDS`` of the kinds some rank recorded: a kind none did
        (compute, where ranks share memory) is left out of summaries rather than dashed."""
        shares = self.shares()
        return [i for i in range(len(KINDS)) if any(shares[rank][i] != NOT_MEASURED for rank in shares)]

    def summary_line(self, elapsed_s: float) -> str:
        """One line saying, per rank, what share of its time went to each kind so far."""
        shares, kinds = self.shares(), self.recorded_kinds()
        parts = [f"rank {rank} {'/'.join(shown[i] for i in kinds)}" for rank, shown in shares.items()]
        return (f"[timeline] {elapsed_s:.1f} s · % of time "
                f"{'/'.join(_KIND_WORDS[KINDS[i]] for i in kinds)}: " + " · ".join(parts))

    def trace(self) -> TraceData:
        """The events so far, as ``build_figure`` draws them: times and lanes, no names (the
        trace file has those)."""
        rank, lane_code, start, end = self._concatenated()
        lane_names = list(self._lanes)
        count = len(rank)
        events = events_table(
            rank=rank, lane=pd.Categorical.from_codes(lane_code, categories=lane_names),
            name=pa.repeat(pa.scalar("", pa.string()), count), start_us=start, duration_us=end - start,
            nbytes=np.full(count, math.nan), world_size=np.full(count, math.nan),
            op=pd.Categorical.from_codes(np.full(count, -1), categories=[]),
            tensors=pa.ListArray.from_arrays(pa.array(np.zeros(count + 1, np.int32)), pa.array([], pa.string())),
        )
        rows = sorted(((rank, lane_names[code]) for rank, code in self._rows),
                      key=lambda row: (row[0], _lane_position(row[1])))
        names = {r: self.rank_names.get(r, f"rank {r}") for r in sorted(self._span_by_rank)}
        return TraceData(events, rows, names, "ddl_magic")

    def _concatenated(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every kept interval's rank, lane code, start and end; kept as one chunk from now on."""
        self._ranks = [_concatenate(self._ranks, np.int64)]
        self._lane_codes = [_concatenate(self._lane_codes, np.int32)]
        self._starts = [_concatenate(self._starts, np.float64)]
        self._ends = [_concatenate(self._ends, np.float64)]
        return self._ranks[0], self._lane_codes[0], self._starts[0], self._ends[0]

    def _count_time(self, rank: int, codes: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        kinds = np.array([lane_category(lane) for lane in self._lanes])[codes]
        totals = self._time_by_kind.setdefault(rank, {})
        for kind in KINDS:
            chosen = kinds == kind
            if chosen.any():
                totals[kind] = totals.get(kind, 0.0) + union_length(start[chosen], end[chosen])
        first, last = self._span_by_rank.get(rank, (math.inf, -math.inf))
        self._span_by_rank[rank] = (min(first, float(start.min())), max(last, float(end.max())))

    def _compact(self) -> None:
        """Merge each row's intervals, closing gaps too short to see at the figure's resolution,
        so that a long run keeps at most about half of ``COMPACT_AT`` intervals."""
        rank, lane_code, start, end = self._concatenated()
        row_of = rank * max(len(self._lanes), 1) + lane_code
        rows = np.unique(row_of)
        # Intervals more than ``gap`` apart number at most span / gap per row: half the budget.
        gap = (end.max() - start.min()) * 2 * len(rows) / COMPACT_AT
        ranks, codes, starts, ends = [], [], [], []
        for row in rows:
            at = row_of == row
            merged_start, merged_end, _ = merge_intervals(start[at], end[at], gap)
            ranks.append(np.full(len(merged_start), rank[at][0]))
            codes.append(np.full(len(merged_start), lane_code[at][0], dtype=np.int32))
            starts.append(merged_start)
            ends.append(merged_end)
        self._ranks, self._lane_codes, self._starts, self._ends = ranks, codes, starts, ends
        self._kept = sum(len(s) for s in starts)


def _lane_position(lane: str) -> int:
    """Known lanes in the Chrome trace's row order, others after them."""
    return LANE_ORDER.index(lane) if lane in LANE_ORDER else len(LANE_ORDER)


def _concatenate(chunks: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=dtype)
