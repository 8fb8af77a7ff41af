"""A timeline as a plotly figure: a row per (rank, lane), a bar per event, light at any size.

Zoomed out over many events, a row shows the share of each stretch of time its lane was busy,
so a million events still make a figure of a megabyte or two at most instead of crashing the
browser, as Horovod's 400 MB timelines did in chrome://tracing. ``figure_parts`` gives the
figure as plotly's plain dicts, which the zoomable widget (``timeline_widget.py``) updates in
place.

Example:
    >>> from ddl_magic.timeline.load import load_trace
    >>> from ddl_magic.ui.timeline_figure import build_figure
    >>> build_figure(load_trace("run.timeline.json")).show()   # doctest: +SKIP
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from ..timeline.analysis import merge_intervals
from ..timeline.lanes import LANE_BY_NAME
from ..timeline.trace import TraceData

__all__ = ["DEFAULT_MAX_SHAPES", "build_figure", "figure_parts", "lane_color"]

DEFAULT_MAX_SHAPES = 5_000
"""Above this many events the figure draws merged busy intervals instead of every event."""
_BETWEEN_HINT = "trace.between(start_ms, end_ms) gives a window in full detail"

# A lane keeps its colour in every run and every figure: ours the lane table's (lanes.py),
# any other a colour chosen by its name, so it too keeps it from run to run.
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
        # Two lines: the first, short, stays clear of plotly's toolbar at the top right.
        title=dict(text=f"{len(events):,} events from {len(trace.rank_names)} rank(s)"
                        + (" (file was cut short)" if trace.truncated else "")
                        + f"<br><span style='font-size:12px'>{shown}</span>",
                   x=0, xanchor="left", y=1, yanchor="top", yref="container", pad=dict(t=20)),
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


def lane_color(lane: str) -> str:
    """The colour of ``lane``, the same in every figure and every run.

    Example:
        >>> lane_color("scatter_reduce") == lane_color("scatter_reduce")
        True
    """
    if lane in LANE_BY_NAME:
        return LANE_BY_NAME[lane].color
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
