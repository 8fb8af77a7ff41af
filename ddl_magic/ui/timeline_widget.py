"""The timeline as a live notebook widget: zooming redraws the window at full detail.

A static figure of a big trace shows merged busy intervals (``build_figure``); here the
figure is a plotly ``FigureWidget`` that listens to its own x axis. Zoom into a window and the
widget redraws that window from the trace in memory, every event once few enough are in it;
double-click (autorange) and the whole trace comes back. Nothing is reloaded from the file.

Example::

    timeline = ZoomableTimeline(load_trace("run.timeline.json"))
    display(timeline.widget)
    timeline.show_window(1200.0, 1250.0)     # what a zoom to 1200-1250 ms does
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import plotly.graph_objects as go

from ..timeline.live import LiveTimeline
from ..timeline.trace import TraceData
from .timeline_figure import DEFAULT_MAX_SHAPES, figure_parts

ZOOM_HINT = "zoom in to see every event"


class FullWidthFigureWidget(go.FigureWidget):
    """A plotly ``FigureWidget`` as wide as the cell (or the box) that shows it, also when
    the cell's width changes.

    Plotly's own is drawn before JupyterLab puts it on the page, where it has no width, and
    stays at plotly's fallback of 700 px: since plotly 6 its views never hear of a width again
    (plotly/plotly.py#5208). This one's frontend is plotly's, loaded from plotly's own
    module, with each view watching its width (``full_width_figure.js`` says how).
    """

    _esm = (f"const PLOTLY_WIDGET = {json.dumps(str(go.FigureWidget._esm))};\n"
            + (Path(__file__).parent / "full_width_figure.js").read_text())


class ZoomableTimeline:
    """A ``FigureWidget`` of ``trace`` that redraws the x range shown, at full detail.

    ``on_rank_click(rank)``, when given, is called with the rank of a bar clicked on.
    """

    def __init__(self, trace: TraceData, max_shapes: int = DEFAULT_MAX_SHAPES,
                 on_rank_click: Callable[[int], None] | None = None) -> None:
        self.trace = trace
        self.max_shapes = max_shapes
        self.on_rank_click = on_rank_click
        self.window_ms: tuple[float, float] | None = None
        traces, layout = self._parts(trace)
        self.widget = FullWidthFigureWidget(data=traces, layout=layout)
        self._listen_to_clicks()
        self.widget.layout.on_change(self._on_x_axis_change, "xaxis.range", "xaxis.autorange")

    def show_window(self, start_ms: float, end_ms: float) -> None:
        """Draw only the events in ``[start_ms, end_ms]``, in full detail if few enough."""
        self.window_ms = (start_ms, end_ms)
        self._draw(*self._parts(self.trace.between(start_ms, end_ms)))

    def show_all(self) -> None:
        """Draw the whole trace again (what double-clicking the figure does)."""
        self.window_ms = None
        self._draw(*self._parts(self.trace))

    def replace_trace(self, trace: TraceData) -> None:
        """Show ``trace`` instead (a live run's timeline grew), keeping the window shown."""
        self.trace = trace
        if self.window_ms is None:
            self.show_all()
        else:
            self.show_window(*self.window_ms)

    def _parts(self, trace: TraceData) -> tuple[list[dict], dict]:
        return figure_parts(trace, self.max_shapes, how_to_see_more=ZOOM_HINT)

    def _on_x_axis_change(self, layout: go.Layout, x_range: tuple[float, float] | None,
                          autorange: bool | None) -> None:
        if autorange or x_range is None:
            if self.window_ms is not None:
                self.show_all()
        elif tuple(x_range) != self.window_ms:
            self.show_window(float(x_range[0]), float(x_range[1]))

    def _draw(self, traces: list[dict], layout: dict) -> None:
        """Show ``traces``; the x axis, and so the zoom, stays as it is.

        When the lanes are the same as shown (the usual case: a live run's next second, a
        zoom), each trace's arrays are replaced in place, one message to the browser;
        otherwise the traces are swapped for new ones.
        """
        same_lanes = [(t.type, t.name) for t in self.widget.data] == [(t["type"], t["name"]) for t in traces]
        with self.widget.batch_update():
            self.widget.layout.title.text = layout["title"]["text"]
            self.widget.layout.yaxis.tickvals = layout["yaxis"]["tickvals"]
            self.widget.layout.yaxis.ticktext = layout["yaxis"]["ticktext"]
            self.widget.layout.shapes = layout["shapes"]
            self.widget.layout.height = layout["height"]
            if same_lanes:
                for shown, new in zip(self.widget.data, traces):
                    shown.update({key: value for key, value in new.items() if key != "type"})
        if not same_lanes:
            self.widget.data = ()
            self.widget.add_traces(traces)
            self._listen_to_clicks()

    def _listen_to_clicks(self) -> None:
        if self.on_rank_click is None:
            return
        for bars in self.widget.data:
            bars.on_click(self._on_click)

    def _on_click(self, bars: go.Bar, points, state) -> None:
        rows = self.trace.rows
        for y in points.ys:
            if 0 <= int(y) < len(rows):
                self.on_rank_click(rows[int(y)][0])
                return


def warm_up() -> None:
    """Build a one-event figure and throw it away: a process's first figure waits for plotly
    to load its validators and its default template (tenths of a second), so that the figure
    a user waits for does not."""
    live = LiveTimeline()
    live.add(0, [("allreduce", "warm-up", 0.0, 1.0, None)])
    go.Figure(*figure_parts(live.trace()))
