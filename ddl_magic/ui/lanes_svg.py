"""A run's lanes as a static SVG: what a notebook keeps of its timeline where no widget is
drawn (nbconvert's HTML, GitHub, a frontend without the widget manager).

The interactive figure lives in the kernel; the saved notebook keeps this picture beside the
summary. Each row is a (rank, lane) as in the figure, in the lanes' own colours; time is cut
into ``width_px`` columns and a column is drawn busy where any event of the row covers it,
so the picture's size depends on the rows and the width, never on the number of events.

Example::

    svg = lanes_svg(load_trace("timeline.json"))   # '<svg ...>...</svg>'
"""

from __future__ import annotations

import html

import numpy as np

from ..timeline.lanes import LANE_BY_NAME
from ..timeline.trace import TraceData

__all__ = ["lanes_svg"]

LABEL_PX = 200
ROW_PX = 14
AXIS_PX = 16
OTHER_LANE_COLOUR = "#9e9e9e"


def lanes_svg(trace: TraceData, width_px: int = 720) -> str:
    """The trace's lanes, ``width_px`` wide beside their labels; "" for a trace without events."""
    events = trace.events
    if events.empty or not trace.rows:
        return ""
    start = events["start_us"].to_numpy()
    end = start + events["duration_us"].to_numpy()
    first, span = float(start.min()), max(float(end.max() - start.min()), 1e-9)
    row_of = {row: index for index, row in enumerate(trace.rows)}
    rows = np.array([row_of.get((rank, lane), -1) for rank, lane in
                     zip(events["rank"].to_numpy(), events["lane"].astype(str).to_numpy())])
    kept = rows >= 0
    left = np.clip(((start[kept] - first) / span * width_px).astype(int), 0, width_px - 1)
    right = np.clip(np.ceil((end[kept] - first) / span * width_px).astype(int), left + 1, width_px)
    # A column is busy where more events of its row began than ended before it.
    coverage = np.zeros((len(trace.rows), width_px + 1), dtype=np.int64)
    np.add.at(coverage, (rows[kept], left), 1)
    np.add.at(coverage, (rows[kept], right), -1)
    busy = np.cumsum(coverage, axis=1)[:, :width_px] > 0
    height = len(trace.rows) * ROW_PX + AXIS_PX
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_PX + width_px}" height="{height}" '
             'font-family="sans-serif" font-size="10">']
    for index, (rank, lane) in enumerate(trace.rows):
        y = index * ROW_PX
        label = f"{trace.rank_names.get(rank, f'rank {rank}')} · {lane}"
        parts.append(f'<text x="{LABEL_PX - 6}" y="{y + ROW_PX - 4}" text-anchor="end">{html.escape(label)}</text>')
        colour = LANE_BY_NAME[lane].color if lane in LANE_BY_NAME else OTHER_LANE_COLOUR
        columns = np.flatnonzero(np.diff(np.concatenate(([0], busy[index].astype(np.int8), [0]))))
        for begin, stop in zip(columns[::2], columns[1::2]):
            parts.append(f'<rect x="{LABEL_PX + begin}" y="{y + 2}" width="{stop - begin}" '
                         f'height="{ROW_PX - 4}" fill="{colour}"/>')
    axis = len(trace.rows) * ROW_PX + AXIS_PX - 4
    parts.append(f'<text x="{LABEL_PX}" y="{axis}">0 ms</text>'
                 f'<text x="{LABEL_PX + width_px}" y="{axis}" text-anchor="end">{span / 1000.0:.1f} ms</text>'
                 "</svg>")
    return "".join(parts)
