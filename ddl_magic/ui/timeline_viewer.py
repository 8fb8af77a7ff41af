"""Read a run's timeline, summarise it, and draw it in the notebook.

The viewer summarises before it draws: ``summarize`` says per rank how much time went to
computing, communicating and waiting, and what bus bandwidth the collectives achieved
(numbers, for programs), ``format_summary`` turns that into the table a person reads; the
figure then shows a row per (rank, lane). Zoomed out over many events, a row shows the share of
each stretch of time its lane was busy, so a million events still make a figure of a megabyte
or two at most instead of crashing the browser, as Horovod's 400 MB timelines did in
chrome://tracing.

Two formats are read:

* ours, written by ``ddl_magic.timeline.chrome.TraceWriter``: a Chrome trace object of
  complete (``"ph": "X"``) events with ``pid`` = rank and ``cat`` = lane;
* Horovod's ``HOROVOD_TIMELINE`` file: a JSON array, often without its closing ``]``, with
  one process per tensor and ``B``/``E`` pairs per activity. It becomes rank 0 with one lane
  per activity (``NEGOTIATE_ALLREDUCE``, ``QUEUE``, ``NCCL_ALLREDUCE``, ...), each event
  named after its tensor.

Example:
    >>> from ddl_magic.ui.timeline_viewer import load_trace, summarize, format_summary, build_figure
    >>> trace = load_trace("run.timeline.json")            # doctest: +SKIP
    >>> summarize(trace)[["communicate_ms", "busy_fraction"]]  # doctest: +SKIP
    >>> format_summary(summarize(trace))                   # doctest: +SKIP
    >>> build_figure(trace).show()                         # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import html
import itertools
import math
import operator
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
import pyarrow as pa

from ..timeline.columns import COLUMNAR_SUFFIX, columnar_path, read_columnar_trace
from ..timeline.json_reader import JsonTraceEvents

DEFAULT_MAX_SHAPES = 5_000
"""Above this many events the figure draws merged busy intervals instead of every event."""
_BETWEEN_HINT = "trace.between(start_ms, end_ms) gives a window in full detail"

# What each of our lanes spends the rank's time on. A tensor negotiates from its submission
# until every rank has submitted it, so that is time waiting for the slowest rank. "user"
# spans are whatever the user marked (often a whole step): left out of the three kinds.
_OUR_LANE_CATEGORIES = {
    "pack": "compute",
    "unpack": "compute",
    "compress": "compute",
    "negotiate": "wait",
    "scatter_reduce": "communicate",
    "allgather": "communicate",
    "broadcast": "communicate",
    "shared_memory": "communicate",
    "wait": "wait",
    "queue": "wait",
}

# Bus bandwidth follows NCCL's convention, whatever carried the bytes: each ring phase
# (scatter-reduce, allgather) puts (n-1)/n of the buffer on every link, so a whole allreduce
# moves 2(n-1)/n of it, and a broadcast moves the whole buffer. Ranks that share memory
# record one "shared_memory" event per collective, its kind in ``op``; a hierarchical
# allreduce's span also holds the ring phases it ran between hosts, counted in it already.
_RING_PHASES = ("scatter_reduce", "allgather")
_RING_PHASES_OF_SHARED_MEMORY_OP = {"allreduce": 2, "hierarchical allreduce": 2, "allgather": 1}

# The kinds of time a lane records, as ``lane_category`` names them.
_KINDS = ("compute", "communicate", "wait", "other")

# What the shown summary says for a number the trace did not record.
NOT_MEASURED = "\N{EN DASH}"

# Horovod's top-level operation spans every activity of its tensor, so it is not counted.
_HOROVOD_OPERATIONS = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER",
                       "JOIN", "BARRIER"}
_COLLECTIVE_WORDS = ("ALLREDUCE", "ALLGATHER", "BCAST", "BROADCAST", "REDUCESCATTER",
                     "ALLTOALL")
_HOROVOD_RANK_READY = "NEGOTIATE_RANK_READY"

_CHROME_EVENT_FIELDS = operator.itemgetter("pid", "tid", "cat", "name", "ts", "dur", "args")

# A lane keeps its colour in every run and every figure: waiting reds and oranges,
# communicating blues and greens, computing browns and purples. Lanes not named here take a
# colour chosen by their name, so they too keep it from run to run.
_FIXED_LANE_COLORS = {
    "user": "#78909c",
    "wait": "#e53935",
    "negotiate": "#fb8c00",
    "queue": "#fdd835",
    "compress": "#8e24aa",
    "pack": "#6d4c41",
    "scatter_reduce": "#1e88e5",
    "allgather": "#43a047",
    "broadcast": "#00acc1",
    "shared_memory": "#3949ab",
    "unpack": "#d81b60",
}
_OTHER_LANE_COLORS = plotly.colors.qualitative.Dark24

# Zoomed out, a row shows the share of each stretch of time its lane was busy, in this many
# stretches at most (about two pixels each on a notebook-wide figure)...
_COVERAGE_BINS = 600
# ... unless every row's events can be seen one by one: fewer than this many of them are
# narrower than a stretch (many thin bars drawn a pixel wide each would look solid).
_THIN_EVENTS_SHOWN_ONE_BY_ONE = 60
# A busy share this small still shows a faint bar, so a lane that did something is seen.
_FAINTEST_OPACITY = 0.06
# Rows keep this many pixels each, whatever their number; the rest is title, legend and axis.
_ROW_HEIGHT_PX = 26
_FIGURE_MARGIN_PX = 170


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


def load_trace(path: str | os.PathLike[str]) -> TraceData:
    """Read a ddl_magic trace or a Horovod timeline file.

    A run of ddl_magic writes its events twice: the Chrome trace at ``path`` and the same
    events in columns beside it (``run.timeline.arrow``, see ``ddl_magic.timeline.columns``).
    The columns are read when they are there, which takes a fraction of a second where
    parsing the JSON takes many; ``path`` may also name the ``.arrow`` file itself. Other
    traces (Horovod's, Chrome's) are parsed as JSON a chunk at a time (``trace_json``), so
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


def lane_category(lane: str) -> str:
    """Which kind of time a lane records: "compute", "communicate", "wait" or "other".

    Example:
        >>> lane_category("scatter_reduce"), lane_category("NCCL_ALLREDUCE")
        ('communicate', 'communicate')
        >>> lane_category("NEGOTIATE_ALLREDUCE"), lane_category("MEMCPY_IN_FUSION_BUFFER")
        ('wait', 'compute')
        >>> lane_category("ALLREDUCE")  # Horovod's span around a whole operation
        'other'
    """
    if lane in _OUR_LANE_CATEGORIES:
        return _OUR_LANE_CATEGORIES[lane]
    upper = lane.upper()
    if upper == "QUEUE" or upper.startswith(("WAIT_FOR", "NEGOTIATE")):
        return "wait"
    if upper.startswith("MEMCPY") or "FUSION_BUFFER" in upper or upper == "SCHEDULE":
        return "compute"
    if upper not in _HOROVOD_OPERATIONS and any(word in upper for word in _COLLECTIVE_WORDS):
        return "communicate"
    return "other"


def summarize(trace: TraceData, top: int = 3) -> pd.DataFrame:
    """Per rank: where the time went, the achieved bus bandwidth and the slowest tensors.

    The numbers, for programs; ``format_summary`` makes the table shown under the figure.
    Each category's time is the union of its lanes' events (concurrent events count once):
    ``compute_ms`` (packing, unpacking, compressing, fusion-buffer copies),
    ``communicate_ms`` (the ring's phases, broadcasts, shared-memory collectives) and
    ``wait_ms`` (negotiating until every rank is ready, queued tensors, callers blocked on a
    handle). ``busy_fraction`` is the union of computing and communicating over ``wall_ms``,
    the rank's first event start to last event end. ``bus_bytes`` is what the collectives
    that carry ``bytes`` put on each link (NCCL's convention: (n-1)/n of the buffer per
    scatter-reduce or allgather phase, 2(n-1)/n per allreduce through shared memory, all of
    it per broadcast) and ``bus_gbps`` that over the time they took, in GB/s.
    ``top_tensors`` names the ``top`` tensors whose events in those three kinds of lanes
    took longest in total.

    What a rank did not record is NaN, not 0: a category without a single event of the
    rank's, ``busy_fraction`` without compute or communicate events, ``bus_bytes`` and
    ``bus_gbps`` without an event that says its bytes (Horovod's timelines never do).

    Example:
        >>> summary = summarize(load_trace("run.timeline.json"))   # doctest: +SKIP
        >>> summary.loc[0, ["communicate_ms", "wait_ms", "bus_gbps"]]  # doctest: +SKIP
        communicate_ms    812.4
        wait_ms           120.9
        bus_gbps            9.7
    """
    columns = ["name", "events", "wall_ms", "compute_ms", "communicate_ms", "wait_ms",
               "busy_fraction", "bus_bytes", "bus_gbps", "top_tensors"]
    events = trace.events
    if events.empty:
        return pd.DataFrame(columns=columns).rename_axis("rank")
    category = _per_category(events["lane"], lambda lane: _KINDS.index(lane_category(lane)),
                             _KINDS.index("other"), np.int8)
    start = events["start_us"].to_numpy()
    end = start + events["duration_us"].to_numpy()
    world_size = len(trace.rank_names) or 1
    top_tensors = _top_tensors(events, category != _KINDS.index("other"), top)
    rows = []
    for rank, at in events.groupby("rank", sort=True).indices.items():
        in_category = {kind: at[category[at] == _KINDS.index(kind)] for kind in _KINDS[:3]}
        busy = np.concatenate([in_category["compute"], in_category["communicate"]])
        wall_us = end[at].max() - start[at].min()
        bus_bytes, bus_us = _bus_traffic(events, at, world_size)
        rows.append({
            "rank": rank,
            "name": trace.rank_names.get(rank, f"rank {rank}"),
            "events": len(at),
            "wall_ms": wall_us / 1000.0,
            **{f"{kind}_ms": union_length(start[i], end[i]) / 1000.0 if len(i) else math.nan
               for kind, i in in_category.items()},
            "busy_fraction": (union_length(start[busy], end[busy]) / wall_us
                              if len(busy) and wall_us > 0 else math.nan),
            "bus_bytes": bus_bytes,
            "bus_gbps": bus_bytes / bus_us / 1000.0 if bus_us > 0 else math.nan,
            "top_tensors": top_tensors.get(rank, ""),
        })
    return pd.DataFrame(rows, columns=["rank", *columns]).set_index("rank")


def format_summary(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as a report to read: what ``show_timeline`` shows under the figure.

    One row per rank, labelled by its name as the figure's rows are ("rank 0 (node-a)"),
    units in the headers, three significant digits (whole numbers from 100 on), and "–"
    for what the trace did not record. Waiting comes right after the rank's wall time, in
    milliseconds and as a share of it: which rank waited most is usually the first
    question. "compute ms" is left out when no rank recorded any. Every cell is text;
    ``summarize`` keeps the numbers.

    Example:
        >>> print(format_summary(summarize(load_trace("run.timeline.json"))).to_string())  # doctest: +SKIP
        rank        wall ms wait ms wait % busy % compute ms communicate ms bus GB/s bus MB ...
        rank 0 (vm)     465     356     76    8.9          –           41.5    0.281   11.7 ...
        rank 1 (vm)     486    45.5    9.3     15          –           73.5    0.159   11.7 ...
    """
    wall = summary["wall_ms"].astype(float)
    table = pd.DataFrame({
        "wall ms": wall.map(_format_number),
        "wait ms": summary["wait_ms"].map(_format_number),
        "wait %": (100.0 * summary["wait_ms"] / wall.where(wall > 0)).map(format_percent),
        "busy %": (100.0 * summary["busy_fraction"]).map(format_percent),
        "compute ms": summary["compute_ms"].map(_format_number),
        "communicate ms": summary["communicate_ms"].map(_format_number),
        "bus GB/s": summary["bus_gbps"].map(_format_number),
        "bus MB": (summary["bus_bytes"] / 1e6).map(_format_number),
        "events": summary["events"].map("{:,}".format),
        "slowest tensors": summary["top_tensors"].replace("", NOT_MEASURED),
    })
    if summary["compute_ms"].isna().all():
        # Ranks that share memory pack inside their collective, so no rank recorded compute
        # time apart from it: a column of dashes would only look like something went wrong.
        table = table.drop(columns="compute ms")
    table.index = pd.Index([_rank_label(rank, name) for rank, name in summary["name"].items()])
    table.columns.name = "rank"
    return table


def build_figure(trace: TraceData, max_shapes: int = DEFAULT_MAX_SHAPES,
                 how_to_see_more: str = _BETWEEN_HINT) -> go.Figure:
    """A zoomable timeline: one row per (rank, lane), one bar per event.

    Each lane is one trace (its bars on every rank's row), so the figure stays light however
    many events and ranks it has, and clicking a lane in the legend hides it on every rank.
    When the events are too many, or too many are too thin to see one by one, each row shows
    instead the share of every stretch of time (1/600 of the trace) that its lane was busy,
    as the bar's opacity; ``trace.between(start_ms, end_ms)`` gives the events of a window
    to draw in full detail, as the title says (``how_to_see_more``: a zoomable widget says
    "zoom in"). Lane colours are fixed by lane name (``lane_color``).

    Example:
        >>> figure = build_figure(load_trace("run.timeline.json"))   # doctest: +SKIP
        >>> figure.show()                                            # doctest: +SKIP
    """
    traces, layout = figure_parts(trace, max_shapes, how_to_see_more)
    return go.Figure(data=traces, layout=layout)


def figure_parts(trace: TraceData, max_shapes: int = DEFAULT_MAX_SHAPES,
                 how_to_see_more: str = _BETWEEN_HINT) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``build_figure``'s traces and layout as plotly's plain dicts: what a live widget
    updates in place, without building a figure each time."""
    events, rows, origin_us = trace.events, trace.rows, trace.origin_us
    first_us = float(events["start_us"].min()) if len(events) else origin_us
    span_us = float((events["start_us"] + events["duration_us"]).max() - first_us) if len(events) else 0.0
    bins = max(min(_COVERAGE_BINS, max_shapes // max(len(rows), 1)), 1)
    bin_us = span_us / bins if span_us > 0 else 1.0
    indices = events.groupby(["rank", "lane"], observed=True, sort=False).indices
    detailed = len(events) <= max_shapes and all(
        np.count_nonzero(events["duration_us"].to_numpy()[at] < bin_us) < _THIN_EVENTS_SHOWN_ONE_BY_ONE
        for at in indices.values())

    bars_of_lane: dict[str, list[dict[str, np.ndarray]]] = {}
    for y, (rank, lane) in enumerate(rows):
        at = indices.get((rank, lane))
        if at is None:
            continue
        row_label = f"{lane} on {trace.rank_names.get(rank, f'rank {rank}')}"
        if detailed:
            bars = _event_bars(events, at, y, origin_us, row_label)
        else:
            bars = _coverage_bars(events, at, y, origin_us, first_us - origin_us, bin_us, bins, row_label)
        bars_of_lane.setdefault(lane, []).append(bars)

    traces = []
    for lane, parts in bars_of_lane.items():
        bars = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        for lane_trace in (_detailed_traces(bars) if detailed else _coverage_traces(bars)):
            lane_trace["marker"]["color"] = lane_color(lane)
            traces.append({**lane_trace, "name": lane, "legendgroup": lane})

    shown = "every event" if detailed else (
        f"how busy each lane was per {bin_us / 1000.0:.3g} ms (darker: busier); {how_to_see_more}")
    layout = dict(
        title=dict(text=f"{len(events):,} events from {len(trace.rank_names)} rank(s): {shown}"
                        + (" (file was cut short)" if trace.truncated else ""),
                   x=0, xanchor="left", y=1, yanchor="top", yref="container", pad=dict(t=8)),
        autosize=True,  # as wide as the cell (plotly's default is a fixed 700 px)
        barmode="overlay",
        bargap=0.2,
        hovermode="closest",
        height=_FIGURE_MARGIN_PX + _ROW_HEIGHT_PX * len(rows),
        margin=dict(t=90, b=50, r=20),
        # Above the lanes, in a row: beside them it took a third of the width.
        legend=dict(orientation="h", x=0, xanchor="left", y=1.0, yanchor="bottom",
                    title=dict(text="lane (click to hide):")),
        xaxis=dict(title=dict(text="time since the first event (ms)"), showgrid=True, zeroline=False),
        yaxis=dict(
            tickmode="array",
            tickvals=list(range(len(rows))),
            ticktext=[f"{trace.rank_names.get(rank, f'rank {rank}')} · {lane}" for rank, lane in rows],
            autorange="reversed",
            showgrid=False,
            zeroline=False,
            automargin=True,
        ),
        shapes=_rank_separators(rows),
    )
    return traces, layout


def summary_report(trace: TraceData) -> tuple[str, str]:
    """What is shown under a trace's figure, as text and as HTML: the line naming who waited
    longest and shortest, then ``format_summary``'s table."""
    summary = summarize(trace)
    headline, table = _waiting_headline(summary), format_summary(summary)
    text, table_html = headline, ""
    if not table.empty:
        # Two spaces between columns at least: pandas' one space runs "wall ms wait ms" together.
        text += "\n" + table.to_string(col_space={column: len(column) + 1 for column in table})
        with pd.option_context("display.max_colwidth", None):  # the whole list of slowest tensors
            table_html = table.to_html(notebook=True)
    return text, f"<p>{html.escape(headline)}</p>{table_html}"


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
        for e in batch:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
                name = e.get("args", {}).get("name", "")
                if e["name"] == "process_name":
                    rank_names[e.get("pid", 0)] = name
                else:
                    thread_names[(e.get("pid", 0), e.get("tid", 0))] = name
        complete = [e for e in batch if e.get("ph") == "X"]
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
        self._numbers["bytes"].append(_numbers([a.get("bytes") if a else None for a in args]))
        self._numbers["world_size"].append(_numbers([a.get("size") if a else None for a in args]))
        self._add_codes("lane", lanes)
        self._add_codes("op", [a.get("op") if a else None for a in args])
        self._names.append(pa.array(names, pa.string()))
        self._tensors.append(pa.array(list(map(_tensor_names, args)), pa.list_(pa.string())))

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

    def _add_codes(self, column: str, values: Sequence[Any]) -> None:
        """The batch's values as codes in the whole table's categories (-1 for missing)."""
        batch = pd.Categorical(values)
        known = self._categories[column]
        to_table = np.array([known.setdefault(value, len(known)) for value in batch.categories] + [-1],
                            dtype=np.int32)
        self._codes[column].append(to_table[batch.codes])

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


def _categorical(column: pa.ChunkedArray) -> pd.Categorical:
    """A dictionary column as a pandas categorical, codes copied once, missing values -1.

    Every chunk's dictionary extends the one before it (``trace_columns`` writes deltas), so
    the longest dictionary holds every chunk's codes.
    """
    chunks = column.chunks
    dictionary = max((c.dictionary for c in chunks), key=len, default=pa.array([], pa.string()))
    codes = np.concatenate([c.indices.fill_null(-1).to_numpy() for c in chunks]) if chunks else []
    return pd.Categorical.from_codes(np.asarray(codes, dtype=np.int32), categories=dictionary.to_pylist())


def _sortable_number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.inf


def _numbers(values: Sequence[Any]) -> np.ndarray:
    """Floats from JSON values; None and anything not a number become NaN."""
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(np.float64)


def merge_intervals(
    start: np.ndarray, end: np.ndarray, gap: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge intervals whose gap is at most ``gap``.

    Returns the merged starts and ends, and for each merged interval the position, in
    start-sorted order, of its first input interval (what ``np.add.reduceat`` needs).
    """
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    first = np.flatnonzero(np.concatenate(([True], start[1:] > reach[:-1] + gap)))
    last = np.concatenate((first[1:] - 1, [len(start) - 1]))
    return start[first], reach[last], first


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total time covered by at least one interval."""
    if len(start) == 0:
        return 0.0
    merged_start, merged_end, _ = merge_intervals(start, end, 0.0)
    return float((merged_end - merged_start).sum())


def _bus_traffic(events: pd.DataFrame, at: np.ndarray, default_world_size: int) -> tuple[float, float]:
    """Bytes on the bus and the time they took (µs) for one rank's byte-carrying events.

    The bytes are NaN when none of the events says how many it moved.
    """
    lane_code = events["lane"].cat.codes.to_numpy()[at]
    lane_names = events["lane"].cat.categories

    def lane_is(*names: str) -> np.ndarray:
        return np.isin(lane_code, [lane_names.get_loc(name) for name in names if name in lane_names])

    nbytes = events["bytes"].to_numpy()[at]
    world = events["world_size"].to_numpy()[at]
    world = np.where(np.isnan(world), default_world_size, world)
    one_phase = (world - 1) / world
    is_phase, is_shared_memory = lane_is(*_RING_PHASES), lane_is("shared_memory")
    share = np.where(is_phase, one_phase, np.where(lane_is("broadcast"), 1.0, math.nan))
    op = events["op"].iloc[at]
    phases = _per_category(op, lambda name: _RING_PHASES_OF_SHARED_MEMORY_OP.get(name, math.nan),
                           math.nan, np.float64)
    shared_memory_share = np.where((op == "broadcast").to_numpy(), 1.0, phases * one_phase)
    share = np.where(is_shared_memory, shared_memory_share, share)
    carrying = ~np.isnan(nbytes) & ~np.isnan(share)
    start = events["start_us"].to_numpy()[at]
    end = start + events["duration_us"].to_numpy()[at]
    carrying &= ~_within(start, end, is_phase, carrying & is_shared_memory)
    if not carrying.any():
        return math.nan, 0.0
    return float((nbytes[carrying] * share[carrying]).sum()), union_length(start[carrying], end[carrying])


def _within(start: np.ndarray, end: np.ndarray, inner: np.ndarray, outer: np.ndarray) -> np.ndarray:
    """Which of the ``inner`` intervals lie inside one of the ``outer`` intervals."""
    inside = np.zeros(len(start), dtype=bool)
    if not inner.any() or not outer.any():
        return inside
    outer_start, outer_end, _ = merge_intervals(start[outer], end[outer], 0.0)
    enclosing = np.maximum(np.searchsorted(outer_start, start[inner], side="right") - 1, 0)
    inside[inner] = (outer_start[enclosing] <= start[inner]) & (end[inner] <= outer_end[enclosing])
    return inside


def _rank_label(rank: int, name: str) -> str:
    """The rank's name when it says which rank it is ("rank 0 (node-a)"), else both."""
    return name if re.match(rf"rank {rank}\b", name) else f"rank {rank} · {name}"


def _format_number(value: float) -> str:
    """Three significant digits, whole from 100 on, never in scientific notation."""
    if math.isnan(value):
        return NOT_MEASURED
    if value == 0 or abs(value) >= 99.95:
        return f"{value:,.0f}"
    decimals = 2 - math.floor(math.log10(abs(value)))
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".")


def format_percent(value: float) -> str:
    """Whole percents from 10 on, one decimal below; a share too small to show is "<0.1", not 0."""
    if math.isnan(value):
        return NOT_MEASURED
    if value == 0 or value >= 9.95:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 0.05 else "<0.1"


def _waiting_headline(summary: pd.DataFrame) -> str:
    """One sentence on who waited most and least, the first thing to look for in a summary."""
    if summary.empty:
        return "The timeline holds no events."
    waited = summary["wait_ms"].dropna()
    if waited.empty:
        return "No rank recorded any waiting."

    def label(rank: int) -> str:
        return _rank_label(rank, summary.loc[rank, "name"])

    def waiting(rank: int) -> str:
        wall = summary.loc[rank, "wall_ms"]
        share = (f" ({format_percent(100.0 * waited[rank] / wall)}% of its {_format_number(wall)} ms)"
                 if wall > 0 else "")
        return f"{_format_number(waited[rank])} ms{share}"

    most, least = waited.idxmax(), waited.idxmin()
    if len(waited) == 1:
        return f"{label(most)} waited {waiting(most)}."
    if waited[most] == waited[least]:
        return f"Every rank waited {_format_number(waited[most])} ms."
    return f"Waited longest: {label(most)}, {waiting(most)}; shortest: {label(least)}, {waiting(least)}."


def _tensor_names(args: dict[str, Any] | None) -> tuple[str, ...]:
    """The tensor names an event's args give (a ``tensors`` list or one ``tensor``)."""
    if not args:
        return ()
    if isinstance(args.get("tensors"), list):
        return tuple(args["tensors"])
    return (args["tensor"],) if args.get("tensor") else ()


def _top_tensors(events: pd.DataFrame, counted: np.ndarray, top: int) -> dict[int, str]:
    """Per rank, "name 12.3 ms, ..." for the tensors whose ``counted`` events took longest.

    Works through the Arrow list column a chunk at a time, adding each event's duration to
    each of its tensors with one ``bincount`` per chunk, so ten million events need no
    Python object per event.
    """
    if events.empty:
        return {}
    tensors = pa.chunked_array(pa.array(events["tensors"].array))
    ranks, rank_index = np.unique(events["rank"].to_numpy(), return_inverse=True)
    weights = np.where(counted, events["duration_us"].to_numpy(), 0.0)
    dictionary, chunk_codes = _tensor_codes(tensors)
    totals = np.zeros(len(ranks) * max(len(dictionary), 1))
    first_event = 0
    for chunk, codes in zip(tensors.chunks, chunk_codes):
        offsets = chunk.offsets.to_numpy()
        events_of_chunk = slice(first_event, first_event + len(chunk))
        parents = np.repeat(np.arange(len(chunk)), np.diff(offsets))
        keys = rank_index[events_of_chunk][parents] * len(dictionary) + codes[offsets[0]:offsets[-1]]
        totals += np.bincount(keys, weights[events_of_chunk][parents], minlength=len(totals))
        first_event += len(chunk)
    names = dictionary.to_pylist()
    described = {}
    for position, rank in enumerate(ranks):
        per_tensor = totals[position * len(names):(position + 1) * len(names)]
        ranked = [i for i in np.argsort(-per_tensor, kind="stable")[:top] if per_tensor[i] > 0]
        described[int(rank)] = ", ".join(f"{names[i]} {_format_number(per_tensor[i] / 1000.0)} ms"
                                         for i in ranked)
    return described


def _tensor_codes(tensors: pa.ChunkedArray) -> tuple[pa.Array, list[np.ndarray]]:
    """One dictionary of tensor names and, per chunk, each listed tensor's code in it.

    The columnar file's chunks hold codes already (each chunk's dictionary extends the last
    one); names read from JSON are encoded here.
    """
    values = [chunk.values for chunk in tensors.chunks]
    if pa.types.is_dictionary(tensors.type.value_type):
        dictionary = max((v.dictionary for v in values), key=len, default=pa.array([], pa.string()))
        return dictionary, [v.indices.to_numpy(zero_copy_only=False) for v in values]
    encoded = pa.chunked_array(values, tensors.type.value_type).dictionary_encode()
    dictionary = encoded.chunks[0].dictionary if encoded.num_chunks else pa.array([], pa.string())
    return dictionary, [c.indices.to_numpy(zero_copy_only=False) for c in encoded.chunks]


def _per_category(values: pd.Series, function: Any, default: Any, dtype: Any) -> np.ndarray:
    """``function`` of each value of a categorical column, computed once per category
    (``default`` where the value is missing), as one array."""
    categorical = values.array
    table = np.array([function(c) for c in categorical.categories] + [default], dtype=dtype)
    return table[categorical.codes]  # the code of a missing value, -1, picks the default


def lane_color(lane: str) -> str:
    """The colour of ``lane``, the same in every figure and every run.

    Example:
        >>> lane_color("scatter_reduce") == lane_color("scatter_reduce")
        True
    """
    if lane in _FIXED_LANE_COLORS:
        return _FIXED_LANE_COLORS[lane]
    return _OTHER_LANE_COLORS[zlib.crc32(lane.encode()) % len(_OTHER_LANE_COLORS)]


def _event_bars(
    events: pd.DataFrame, at: np.ndarray, y: int, origin_us: float, row_label: str
) -> dict[str, np.ndarray]:
    """One row's events, each a bar from its start to its end (ms); what hovering shows."""
    start_ms = (events["start_us"].to_numpy()[at] - origin_us) / 1000.0
    names = events["name"].iloc[at].tolist()
    tensors = events["tensors"].iloc[at].tolist()
    nbytes = events["bytes"].to_numpy()[at]
    details = np.array(
        [[name, _describe_tensors(t), _describe_bytes(b), round(s, 3), row_label]
         for name, t, b, s in zip(names, tensors, nbytes, start_ms)],
        dtype=object,
    ).reshape(len(at), 5)
    return {"base": start_ms, "x": events["duration_us"].to_numpy()[at] / 1000.0,
            "y": np.full(len(at), y), "customdata": details}


def _detailed_traces(bars: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """One lane's events: a bar each, and a tick each for those that took no time."""
    hover = ("<b>%{customdata[0]}</b><br>%{customdata[4]}<br>start %{customdata[3]} ms, "
             "took %{x:.3f} ms<br>tensors: %{customdata[1]}<br>bytes: %{customdata[2]}"
             "<extra></extra>")
    traces: list[dict[str, Any]] = []
    has_length = bars["x"] > 0
    if has_length.any():
        traces.append(dict(
            type="bar", orientation="h", base=bars["base"][has_length], x=bars["x"][has_length],
            y=bars["y"][has_length], width=0.8, marker=dict(line=dict(width=0)),
            customdata=bars["customdata"][has_length], hovertemplate=hover,
        ))
    if (~has_length).any():
        instants = ~has_length
        traces.append(dict(
            type="scatter", mode="markers", x=bars["base"][instants], y=bars["y"][instants],
            marker=dict(symbol="line-ns-open", size=14, line=dict(width=2)),
            customdata=bars["customdata"][instants], hovertemplate=hover.replace("took %{x:.3f} ms", "instant"),
            showlegend=not has_length.any(),
        ))
    return traces


def _coverage_bars(
    events: pd.DataFrame, at: np.ndarray, y: int, origin_us: float, first_us: float, bin_us: float,
    bins: int, row_label: str
) -> dict[str, np.ndarray]:
    """One row as the share of each ``bin_us`` stretch (from ``first_us``, relative to
    ``origin_us``) that its events covered: a bar per stretch with any, its opacity that share.

    Merging close intervals into solid bars instead would draw a rank that waits 4 % of the
    time as solid as one that waits 93 %; the share keeps that honest at any zoom.
    """
    start = events["start_us"].to_numpy()[at] - origin_us
    end = start + events["duration_us"].to_numpy()[at]
    union_start, union_end, _ = merge_intervals(start, end, 0.0)
    # Covered time up to t is piecewise linear through the unions' ends; sampled at every
    # stretch's edges, its differences are exactly each stretch's covered time.
    covered_before = np.concatenate(([0.0], np.cumsum(union_end - union_start)[:-1]))
    knots_t = np.column_stack((union_start, union_end)).ravel()
    knots_covered = np.column_stack((covered_before, covered_before + union_end - union_start)).ravel()
    edges = first_us + bin_us * np.arange(bins + 1)
    covered = np.diff(np.interp(edges, knots_t, knots_covered))
    share = np.clip(covered / bin_us, 0.0, 1.0)
    # Events that start in a stretch; an event that took no time still marks its stretch.
    counts = np.bincount(np.clip(((start - first_us) // bin_us).astype(np.int64), 0, bins - 1),
                         minlength=bins)
    shown = (share > 0) | (counts > 0)
    details = np.empty((int(shown.sum()), 4), dtype=object)
    details[:, 0], details[:, 1] = counts[shown], np.round(100.0 * share[shown], 1)
    details[:, 2], details[:, 3] = np.round(edges[:-1][shown] / 1000.0, 3), row_label
    return {"base": edges[:-1][shown] / 1000.0, "x": np.full(len(details), bin_us / 1000.0),
            "y": np.full(len(details), y),
            "opacity": _FAINTEST_OPACITY + (1.0 - _FAINTEST_OPACITY) * share[shown],
            "customdata": details}


def _coverage_traces(bars: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """One lane's stretches; a bar's opacity is the share of its stretch the lane was busy."""
    return [dict(
        type="bar", orientation="h", base=bars["base"], x=bars["x"], y=bars["y"], width=0.8,
        marker=dict(line=dict(width=0), opacity=bars["opacity"]), customdata=bars["customdata"],
        hovertemplate=("<b>busy %{customdata[1]} % of %{x:.3g} ms</b><br>%{customdata[3]}<br>"
                       "from %{customdata[2]} ms; %{customdata[0]:,} events start here"
                       "<extra></extra>"),
    )]


def _describe_tensors(tensors: tuple[str, ...], shown: int = 4) -> str:
    text = ", ".join(map(str, tensors[:shown]))
    return text + (f", … ({len(tensors) - shown} more)" if len(tensors) > shown else "") or "-"


def _describe_bytes(nbytes: float) -> str:
    if math.isnan(nbytes):
        return "-"
    if nbytes < 1024:
        return f"{nbytes:,.0f} B"
    exponent = min(int(math.log(nbytes, 1024)), 3)
    return f"{nbytes / 1024 ** exponent:,.1f} {('B', 'KiB', 'MiB', 'GiB')[exponent]}"


def _rank_separators(rows: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """A thin line between one rank's rows and the next rank's."""
    return [
        dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=y - 0.5, y1=y - 0.5,
             line=dict(color="rgba(0,0,0,0.35)", width=1))
        for y in range(1, len(rows)) if rows[y][0] != rows[y - 1][0]
    ]
