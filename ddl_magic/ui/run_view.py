"""The notebook's live view of a run: a status row per rank, each rank's output in its own tab.

Peers lose rank labels (ipyparallel interleaves engines' output, HorovodRunner and
TorchDistributor show one merged stream), so this view keeps every rank apart::

    %%horovod -np 4 · running · 1/4 done · 12.3 s
    ┌ rank ┬ status  ┬ host   ┬ elapsed ┬ last line ─────────────┐
    │ 0    │ running │ node-a │ 12.1 s  │ epoch 3: 45%|████▌     │
    │ 1    │ failed  │ node-b │ 3.2 s   │ RuntimeError: NaN loss │   <- row in red
    └──────┴─────────┴────────┴─────────┴────────────────────────┘
    rank 1 on node-b failed: exception        <- its traceback, above the tabs
    wait / communicate / compute % per rank   <- a --timeline run: its lanes, growing once a
    [ lanes: rank · lane over time ]             second; zoom redraws, a click opens that rank's tab
    [ all ranks | rank 0 | rank 1 ✗ | ... ]   <- "all ranks" labels each line [r]

``handle(event)`` only changes Python-side state and ``refresh()`` pushes what changed to
the widgets, so a flood of lines costs one widget update per refresh, not one per line.
Each log keeps only its last ``max_lines`` lines; the full logs are on disk in ``log_dir``.

Widgets cost: each is a model the kernel opens in the frontend, its state sent whole. The
view's HTML parts share one layout and one style (a dozen models instead of 25), and the
text a frontend without widgets shows is the view's own report, not ipywidgets' repr of
every trait. With ``widget_after_s`` (tqdm's ``delay``), no widget is made until the run
has lasted that long: a run that ends sooner shows its final report as HTML and text (what
a saved notebook shows of any run, without tabs); a longer one, or one with a timeline,
gets the full view. The front-ends ask for half a second
(`frontends/options.RUN_VIEW_WIDGETS_AFTER_S`): most pool cells end sooner.
"""

from __future__ import annotations

import html
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from ..driver.events import Event, GroupRestarted, RankFailed, RankOutput, TimelineBatch, WorldReset
from ..driver.records import RankRecord, RankStatus
from ..driver.run_report import FAILED_ROW_BACKGROUND, MONOSPACE, STATUS_COLOURS, html_table
from ..driver.run_status import SHOWN_ENDS, RunStatus
from ..driver.tracebacks import without_machinery_frames

__all__ = ["FAILED_ROW_BACKGROUND", "RunView"]
FINISHED_CLASS = "ddl-magic-run-finished"
# After a kernel restart a widget shows a red broken-link icon (ipywidgets' "disconnected"):
# a finished run's view has nothing left to update, so it stays as it ended, without them.
FINISHED_STYLE = (f"<style>.{FINISHED_CLASS}.jupyter-widgets-disconnected::before, "
                  f".{FINISHED_CLASS} .jupyter-widgets-disconnected::before "
                  "{ display: none; }</style>")
LAST_LINE_CHARS = 160
LOG_HEIGHT = "360px"
LIVE_TIMELINE_INTERVAL_S = 1.0
LIVE_TIMELINE_SHARE = 0.02
"""The most of the driver's time that redrawing the live lanes may take: on a busy machine
(the driver shares its cores with the ranks) a slow redraw waits longer for the next..."""
LIVE_TIMELINE_LONGEST_WAIT_S = 10.0
"""...but never longer than this."""
DRAWING_MODULES_WAIT_S = 120.0
"""The longest the view, or the next cell, waits for the thread that loads the drawing modules."""
DRAWING_STARTS_AFTER_S = 1.0
"""A --timeline run still going after this long loads plotly for its live lanes, on the
driver's thread (the view pauses for it, once a kernel). A shorter run does not pay for it:
its cell ends at once, and plotly loads between it and the next cell (`DrawingLoader`)."""


class LogLine:
    """One line of a rank's output; a progress line's text changes as its bar redraws.

    The same object sits in the rank's log and in the "all ranks" log, so one redraw
    updates both.
    """

    __slots__ = ("rank", "text")

    def __init__(self, rank: int | str, text: str) -> None:
        self.rank = rank
        self.text = text


class BoundedLog:
    """The last ``max_lines`` lines of a log, and how many earlier lines were let go."""

    def __init__(self, max_lines: int) -> None:
        self.lines: deque[LogLine] = deque(maxlen=max_lines)
        self.appended = 0

    def append(self, line: LogLine) -> int:
        """Add ``line`` and return its position: how many lines were appended before it."""
        self.lines.append(line)
        self.appended += 1
        return self.appended - 1

    def holds(self, position: int) -> bool:
        """Whether the line appended at ``position`` is still kept."""
        return position >= self.dropped

    @property
    def dropped(self) -> int:
        return self.appended - len(self.lines)


@dataclass
class RankOutputView:
    """What the view keeps of one rank's output (its status is in the rank's `RankRecord`)."""

    rank: int
    log: BoundedLog
    last_line: str = ""
    # The rank's progress line that a redraw replaces, and where it sits in "all ranks";
    # None once a normal line follows it (it then stays in the log as it last read).
    progress: LogLine | None = None
    progress_position_in_all: int = -1
    log_changed: bool = True


class RunView:
    """A live ipywidgets view of one run's ranks.

    ``ranks`` is the run's list of `RankRecord`: the driver applies each event to its rank's
    record (`RankRecord.apply`, its own decisions besides), then hands the event to the view,
    which renders the records.

    Example::

        records = new_records(4, "/tmp/ddl_magic/run-1")
        view = RunView(records, title="%%horovod -np 4", log_dir="/tmp/ddl_magic/run-1")
        view.display()
        for event in events:           # the driver's drain loop
            records[event.rank].apply(event)
            view.handle(event)
            view.refresh()             # the driver calls this at most every ~100 ms
        view.finish(RunStatus.DONE)
    """

    def __init__(self, ranks: list[RankRecord], title: str, log_dir: str | None,
                 max_lines: int = 500, timeline_interval_s: float = LIVE_TIMELINE_INTERVAL_S,
                 timeline_share: float = LIVE_TIMELINE_SHARE, timeline_path: str | None = None,
                 widget_after_s: float | None = None) -> None:
        np = len(ranks)
        if np < 1:
            raise ValueError(f"np must be at least 1, got {np}")
        if max_lines < 1:
            raise ValueError(f"max_lines must be at least 1, got {max_lines}")
        self._records = ranks
        self.np = np
        self.title = title
        self.log_dir = log_dir
        self.max_lines = max_lines
        self.timeline_interval_s = timeline_interval_s
        self.timeline_share = timeline_share
        # Where the run's trace is written: when the run ends, the lanes and the summary are
        # drawn from it (every event's name for hovering), and no second figure is needed.
        self.timeline_path = timeline_path
        self._ranks = [RankOutputView(rank, BoundedLog(max_lines)) for rank in range(np)]
        self._all = BoundedLog(max_lines)
        self._all_changed = True
        self._failures: dict[int, RankFailed] = {}  # as shown: the first is the cause
        self._outcome = RunStatus.RUNNING
        self._started_at = time.monotonic()
        self._finished_at: float | None = None

        self.widget_after_s = widget_after_s
        self._shown_at: float | None = None  # when display() was asked for
        self._root: widgets.VBox | None = None  # the widgets, once made (`_make_widgets`)
        # A --timeline run's lanes; made when its first batch arrives (plotly is slow to import).
        self._live = None
        self._live_lanes = None
        self._live_drawn = (-1, -math.inf)  # the LiveTimeline version drawn, and the next draw's time
        self._timeline_problem = ""
        self._lanes_picture = ""  # the finished run's lanes as SVG, for renderers without widgets
        self._drawing_timeline = False
        self.timeline_text = ""
        """The finished run's timeline summary as text (for frontends without widgets)."""
        self._display_handle = None
        self._drawing_modules: DrawingLoader | None = None
        self._drawing_asked = False
        self._lanes_placeholder = None  # the lanes' picture, until plotly can draw them
        self._batches_aside: list[TimelineBatch] = []  # while the drawing modules load
        if widget_after_s is None:
            self._make_widgets()

    def _make_widgets(self) -> None:
        """The view's widgets, with the state so far."""
        # One layout and one style for every HTML part: each would otherwise be two more
        # models to open in the frontend.
        shared = dict(layout=widgets.Layout(), style=HTMLStyle())
        self._banner = widgets.HTML(**shared)
        self._table = widgets.HTML(**shared)
        self._failure = widgets.HTML(**shared)
        self._all_tab = widgets.HTML(**shared)
        self._rank_tabs = [widgets.HTML(**shared) for _ in range(self.np)]
        self._tabs = widgets.Tab(children=[self._all_tab, *self._rank_tabs])
        self._live_summary = widgets.HTML(**shared)
        self._root = widgets.VBox([self._banner, self._table, self._failure, self._tabs])
        for rank in self._ranks:
            rank.log_changed = True
        self._all_changed = True
        self.refresh()

    @property
    def widget(self) -> widgets.VBox:
        """The root widget, to embed the view in another layout."""
        if self._root is None:
            self._make_widgets()
        return self._root

    def display(self) -> None:
        """Show the view in the current notebook cell's output (with ``widget_after_s``:
        once the run has lasted that long, or its report when it ends sooner).

        What a frontend without widgets shows (nbconvert, GitHub, a CI log) is the output's
        text and HTML, which ``finish`` replaces with the final report: without that, a saved
        notebook would show the first frame, "running · 0/2 done", for ever.
        """
        self._shown_at = time.monotonic()
        if self._root is not None:
            self._show_widgets()

    def _show_widgets(self) -> None:
        from IPython.display import display

        self._display_handle = display(self._widget_bundle(self._banner_text(self._now())),
                                       raw=True, display_id=True)

    def _widget_bundle(self, text: str) -> dict:
        """The output showing the view: the root widget, and `text` where widgets do not show."""
        return {"application/vnd.jupyter.widget-view+json": {
                    "version_major": 2, "version_minor": 0, "model_id": self._root.model_id},
                "text/plain": text}

    def handle(self, event: Event) -> None:
        """Take one event into the view's state; the widgets change on the next ``refresh()``."""
        if isinstance(event, TimelineBatch):
            self._add_timeline(event)
            return
        if isinstance(event, WorldReset):  # an elastic run re-formed its world: a line for all
            self._all.append(LogLine("elastic", event.describe()))
            self._all_changed = True
            return
        if isinstance(event, GroupRestarted):  # the whole group starts again: a line for all
            self._all.append(LogLine("restart", event.describe()))
            self._all_changed = True
            self._failures.clear()
            return
        rank = self._rank(event.rank)
        if isinstance(event, RankOutput):
            self._add_output(rank, event)
        elif isinstance(event, RankFailed) and self._records[event.rank].status is RankStatus.FAILED:
            self._failures.setdefault(event.rank, event)

    def refresh(self) -> None:
        """Push the changes since the last refresh to the widgets (with ``widget_after_s``,
        made and shown once the run has lasted that long)."""
        now = self._now()
        if (self.timeline_path is not None and not self._drawing_asked
                and now - self._started_at >= DRAWING_STARTS_AFTER_S):
            self._load_drawing_modules()
        if self._root is None:
            if self._shown_at is None or now - self._shown_at < self.widget_after_s:
                return
            self._make_widgets()  # refreshes
            self._show_widgets()
            return
        self._banner.value = self._render_banner(now) + (
            FINISHED_STYLE if self._finished_at is not None else "")
        self._table.value = self._render_table(now)
        self._failure.value = self._render_failure()
        self._tabs.titles = ("all ranks", *(self._tab_title(record) for record in self._records))
        # No rank printed anything yet: no empty bordered box under the table.
        self._tabs.layout.display = None if self._all.appended else "none"
        for rank, tab in zip(self._ranks, self._rank_tabs):
            if rank.log_changed:
                tab.value = self._render_log(rank.log, self._log_note(rank.log, rank.rank), labelled=False)
                rank.log_changed = False
        if self._all_changed:
            self._all_tab.value = self._render_log(self._all, self._log_note(self._all, None), labelled=True)
            self._all_changed = False
        self._take_batches_aside()
        if self._live is not None and now >= self._live_drawn[1]:
            self._draw_timeline(now)

    def show_rank(self, rank: int) -> None:
        """Open rank ``rank``'s log tab (what clicking one of its lanes does)."""
        self.widget  # noqa: B018 - made if they were not yet
        self._tabs.selected_index = self._rank(rank).rank + 1

    def finish(self, status: RunStatus) -> None:
        """End the run with ``status`` (done, failed or interrupted): final banner, clocks stop.

        Ranks that had not ended are marked "stopped". Calling it again changes nothing.
        """
        if status not in SHOWN_ENDS:
            raise ValueError(f"status must be 'done', 'failed' or 'interrupted', got {status!r}")
        if self._finished_at is not None:
            return
        self._finished_at = time.monotonic()
        self._outcome = RunStatus(status)
        for record in self._records:
            if not record.ended:
                record.end(RankStatus.STOPPED)
        if self._root is None and self._live is None and self.timeline_path is None:
            if self._shown_at is not None:  # it ended before its widgets were due: its report
                from IPython.display import display

                display({"text/plain": self.report_text(), "text/html": self.report_html()},
                        raw=True)
            return
        if self._root is None:
            self._make_widgets()
            if self._shown_at is not None:
                self._show_widgets()
        self._root.add_class(FINISHED_CLASS)
        # The banner says the figure is being drawn, until it is: the cell is busy till then.
        self._drawing_timeline = self.timeline_path is not None or self._live is not None
        self.refresh()
        self._show_final_timeline()
        self._drawing_timeline = False
        self.refresh()
        if self._display_handle is not None:
            bundle = self._widget_bundle(self.report_text())
            bundle["text/html"] = self.report_html()
            self._display_handle.update(bundle, raw=True)

    def report_text(self) -> str:
        """The run as plain text: the banner, a row per rank, the failure, every rank's
        output as "all ranks" keeps it, and the timeline's summary."""
        now = self._now()
        header = ("rank", "status", "host", "elapsed", "last line")
        rows = [(str(record.rank), record.status.value, record.host or "—",
                 "—" if (elapsed := self._elapsed(record, now)) is None else _format_elapsed(elapsed),
                 _shortened(rank.last_line)) for rank, record in zip(self._ranks, self._records)]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
        table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                 for row in (header, *rows)]
        parts = [self._banner_text(now), "\n".join(line.rstrip() for line in table)]
        if self._failures:
            first = next(iter(self._failures.values()))
            parts.append(f"rank {first.rank} on {first.host or self._records[first.rank].host or '?'} "
                         f"failed: {first.reason}\n{self._shown_traceback(first)}".rstrip())
        if self._all.appended:
            note = self._log_note(self._all, None)
            parts.append((f"{note}\n" if note else "")
                         + "\n".join(f"[{line.rank}] {line.text}" for line in self._all.lines))
        if self.timeline_text:
            parts.append(f"timeline\n{self.timeline_text}")
        return "\n\n".join(parts)

    def report_html(self) -> str:
        """The run as static HTML, for renderers without widgets: what ``report_text`` says."""
        now = self._now()
        log = self._render_log(self._all, self._log_note(self._all, None), labelled=True) if self._all.appended else ""
        return (self._render_banner(now) + self._render_table(now) + self._render_failure() + log
                + (self._live_summary.value + self._lanes_picture if self.timeline_text else ""))

    def state(self) -> dict:
        """A plain snapshot of the view, for tests and for the run's record."""
        now = self._now()
        return {
            "title": self.title,
            "status": self._outcome,
            "elapsed_s": now - self._started_at,
            "failed_rank": next(iter(self._failures), None),
            "log_dir": self.log_dir,
            "ranks": [
                {
                    "rank": rank.rank,
                    "status": record.status.value,
                    "host": record.host,
                    "pid": record.pid,
                    "elapsed_s": self._elapsed(record, now),
                    "last_line": rank.last_line,
                    "lines": [line.text for line in rank.log.lines],
                    "dropped": rank.log.dropped,
                    "log_path": self._log_path(rank.rank),
                    "failure": (
                        {"reason": failure.reason, "traceback": failure.traceback}
                        if (failure := self._failures.get(rank.rank))
                        else None
                    ),
                }
                for rank, record in zip(self._ranks, self._records)
            ],
            "all_ranks": {
                "lines": [f"[{line.rank}] {line.text}" for line in self._all.lines],
                "dropped": self._all.dropped,
            },
            "selected_tab": None if self._root is None else self._tabs.selected_index,
            "timeline": None if self._live_lanes is None else {
                "summary": None if self._live is None else self._live.summary(),
                "rows": list(self._live_lanes.trace.rows),
                "events_drawn": len(self._live_lanes.trace.events),
            },
        }

    def _load_drawing_modules(self, after_the_cell: bool = False) -> None:
        """Load what drawing the timeline needs, once a kernel: here, once the run has lasted
        `DRAWING_STARTS_AFTER_S` (for its live lanes), or, after a shorter run, in the
        `DrawingLoader` thread between its cell and the next (`after_the_cell`).

        The first figure of a kernel imports plotly, which imports nbformat and jsonschema
        (seconds on some machines: jsonschema's format checkers build grammars), then loads
        its validators and template. Until the thread is done this view imports none of those
        modules itself: it keeps the timeline's batches aside, and the finished run shows its
        lanes as a picture until the thread draws the figure in its place.
        """
        global _drawing_thread
        self._drawing_asked = True
        if _drawing_prepared.is_set():
            return
        loading = _drawing_thread is not None and _drawing_thread.is_alive()
        if not after_the_cell:
            if loading:  # outside a notebook cell, the last run's thread may still be loading
                self._drawing_modules = _drawing_thread
                _drawing_thread.join(timeout=DRAWING_MODULES_WAIT_S)
            else:
                _prepare_timeline_drawing()
            return
        # One thread a kernel: a view whose run was interrupted while it loaded leaves it
        # running, and the next run's view waits for the same one.
        if not loading and (_drawing_thread is None or _drawing_thread.ident is not None):
            _drawing_thread = DrawingLoader()
            _between_this_cell_and_the_next(_drawing_thread.start_once, _drawing_thread.finish)
        self._drawing_modules = _drawing_thread

    def _drawing_modules_loaded(self, wait_s: float = 0.0) -> bool:
        """Whether plotly and the rest are loaded, or failed to load (the view's own imports
        then raise it where it is shown); waits up to `wait_s` for a thread that runs."""
        if _drawing_prepared.is_set():
            return True
        loader = self._drawing_modules
        if loader is None:  # tried here (a run of a second), or no trace file: the view's own
            return self._drawing_asked or self.timeline_path is None
        if loader.ident is None:
            return False
        loader.join(timeout=wait_s)
        return not loader.is_alive()

    def _add_timeline(self, batch: TimelineBatch) -> None:
        self._rank(batch.rank)
        self._batches_aside.append(batch)
        self._take_batches_aside()

    def _take_batches_aside(self) -> None:
        """Hand the timeline's batches to the live timeline, once the drawing modules are loaded."""
        if not self._batches_aside or not self._drawing_modules_loaded():
            return
        if self._live is None:
            from ..timeline.live import LiveTimeline

            self._live = LiveTimeline()
        for batch in self._batches_aside:
            self._live.add(batch.rank, batch.events)
        self._batches_aside.clear()

    def _draw_timeline(self, now: float) -> None:
        """Redraw the lanes and the running summary, if a batch arrived since the last time.

        The next redraw waits ``timeline_interval_s``, or longer if this one took more than
        ``timeline_share`` of that: the view stays live without slowing the training. The
        first draw, which makes the widget (and imports plotly), does not count.
        """
        if self._live.version == self._live_drawn[0]:
            return
        first = self._live_lanes is None
        started = time.monotonic()
        self._draw_timeline_now()
        took = 0.0 if first else time.monotonic() - started
        wait = min(max(self.timeline_interval_s, took / self.timeline_share), LIVE_TIMELINE_LONGEST_WAIT_S)
        self._live_drawn = (self._live.version, now + wait)

    def _draw_timeline_now(self) -> None:
        self._live.rank_names = {r.rank: f"rank {r.rank} ({r.host})" if r.host else f"rank {r.rank}"
                                 for r in self._records}
        self._live_summary.value = self._render_timeline_summary("timeline so far")
        self._show_lanes(self._live.trace())

    def _show_lanes(self, trace) -> None:
        """Draw ``trace`` in the view's one figure, made (above the tabs) the first time."""
        if self._live_lanes is None:
            from .timeline_widget import ZoomableTimeline

            self._live_lanes = ZoomableTimeline(trace, on_rank_click=self.show_rank)
            children = list(self._root.children)
            self._root.children = (*children[:-1], self._live_summary, self._live_lanes.widget, children[-1])
        else:
            self._live_lanes.replace_trace(trace)

    def _show_final_timeline(self) -> None:
        """The run is over: the figure and the summary become the whole trace's, read from
        its file (what the live lanes lack: event names, the bandwidth, slowest tensors)."""
        if self.timeline_path is not None and not self._drawing_asked:
            self._load_drawing_modules(after_the_cell=True)  # a run shorter than DRAWING_STARTS_AFTER_S
        loader = self._drawing_modules
        if loader is not None and loader.ident is not None:  # the summary's modules: tenths of a second
            loader.own_modules_loaded.wait(timeout=DRAWING_MODULES_WAIT_S)
        self._take_batches_aside()  # if plotly is loaded; else the trace's file has them all
        from .lanes_svg import lanes_svg

        trace = None
        if self.timeline_path is not None and os.path.exists(self.timeline_path):
            from ..timeline.analysis import summary_report
            from ..timeline.load import load_trace

            try:
                trace = load_trace(self.timeline_path)
            except (OSError, ValueError) as exc:
                self._timeline_problem = f"the timeline at {self.timeline_path} could not be read: {exc}"
        if trace is not None:
            self.timeline_text, summary_html = summary_report(trace)
            self._lanes_picture = lanes_svg(trace)
            self._live_summary.value = f"<b>timeline</b>{summary_html}"
            if len(trace.events):
                self._show_final_lanes(trace)
            elif self._live_summary not in self._root.children:  # the summary says it is empty
                children = self._root.children
                self._root.children = (*children[:-1], self._live_summary, children[-1])
            return
        if self._batches_aside:  # no trace to read: the live timeline's batches it is
            if loader is not None:
                loader.start_once()
            self._drawing_modules_loaded(wait_s=DRAWING_MODULES_WAIT_S)
            self._take_batches_aside()
        if self._live is not None:
            self._draw_timeline_now()
            self._live_summary.value = self._render_timeline_summary("timeline")
            self.timeline_text = self._live.summary_line(self._finished_at - self._started_at)
            self._lanes_picture = lanes_svg(self._live.trace())

    def _show_final_lanes(self, trace) -> None:
        """The whole trace's lanes: in the view's zoomable figure if plotly is loaded; if not
        yet (the first timeline of a kernel, after a short run), at once as a picture, which
        the figure replaces when the thread loading plotly is done: the cell does not wait."""
        loader = self._drawing_modules
        if loader is None or not loader.after_plotly(lambda: self._picture_becomes_zoomable(trace)):
            self._show_lanes(trace)
            return
        note = ("<div style=\"color:#666\">the lanes become zoomable once plotly has loaded (the "
                "first time in a kernel: a second or two)</div>")
        self._lanes_placeholder = widgets.HTML(value=note + self._lanes_picture)
        children = self._root.children
        self._root.children = (*children[:-1], self._live_summary, self._lanes_placeholder, children[-1])

    def _picture_becomes_zoomable(self, trace) -> None:
        """From the thread that loaded plotly: the zoomable figure takes the picture's place."""
        try:
            from .timeline_widget import ZoomableTimeline

            self._live_lanes = ZoomableTimeline(trace, on_rank_click=self.show_rank)
        except Exception as exc:  # noqa: BLE001 - said under the picture, which stays
            self._lanes_placeholder.value = (
                f'<div style="color:{STATUS_COLOURS[RankStatus.FAILED]}">the zoomable lanes '
                f"could not be drawn: {html.escape(f'{type(exc).__name__}: {exc}')}</div>"
                + self._lanes_picture)
            return
        self._root.children = tuple(self._live_lanes.widget if child is self._lanes_placeholder
                                    else child for child in self._root.children)

    def _render_timeline_summary(self, heading: str) -> str:
        from ..timeline.live import KINDS

        summary, shares, kinds = self._live.summary(), self._live.shares(), self._live.recorded_kinds()
        rows = [("", [str(rank), *(shares[rank][i] for i in kinds), f"{summary[rank]['wall_ms'] / 1000.0:.1f}"])
                for rank in summary]
        header = ["rank", *(f"{KINDS[i]} %" for i in kinds), "recorded s"]
        problem = (f'<div style="color:{STATUS_COLOURS[RankStatus.FAILED]}">{html.escape(self._timeline_problem)}</div>'
                   if self._timeline_problem else "")
        return f"<b>{heading}</b>{problem}{html_table(header, rows)}"

    def _rank(self, rank: int) -> RankOutputView:
        if not 0 <= rank < self.np:
            raise ValueError(f"event for rank {rank}, but this run has ranks 0..{self.np - 1}")
        return self._ranks[rank]

    def _add_output(self, rank: RankOutputView, event: RankOutput) -> None:
        if event.replace and rank.progress is not None:
            rank.progress.text = event.text
            # Other ranks' lines can push the bar out of "all ranks"; it comes back at the bottom.
            if not self._all.holds(rank.progress_position_in_all):
                rank.progress_position_in_all = self._all.append(rank.progress)
        else:
            line = LogLine(rank.rank, event.text)
            rank.log.append(line)
            position = self._all.append(line)
            if event.replace:
                rank.progress, rank.progress_position_in_all = line, position
            else:
                rank.progress, rank.progress_position_in_all = None, -1
        rank.last_line = event.text
        rank.log_changed = True
        self._all_changed = True

    def _now(self) -> float:
        return self._finished_at if self._finished_at is not None else time.monotonic()

    def _elapsed(self, record: RankRecord, now: float) -> float | None:
        if record.started_at is None:
            return None
        return record.duration_s  # on the records' clock (epoch seconds), not the view's

    def _log_path(self, rank: int) -> str | None:
        return os.path.join(self.log_dir, f"rank-{rank}.log") if self.log_dir else None

    def _tab_title(self, record: RankRecord) -> str:
        return f"rank {record.rank} ✗" if record.status is RankStatus.FAILED else f"rank {record.rank}"

    def _outcome_summary(self, now: float) -> str:
        elapsed = _format_elapsed(now - self._started_at)
        if self._outcome is RunStatus.RUNNING:
            done = sum(record.status is RankStatus.DONE for record in self._records)
            return f"running · {done}/{self.np} done · {elapsed}"
        drawing = ""
        if self._drawing_timeline:
            loading = self._drawing_modules is not None and self._drawing_modules.is_alive()
            drawing = " · loading plotly to draw the timeline (once a kernel)…" if loading else \
                " · drawing the timeline…"
        if self._outcome is RunStatus.DONE:
            return f"done in {elapsed}{drawing}"
        return f"{self._outcome} after {elapsed}{drawing}"

    def _banner_text(self, now: float) -> str:
        logs = f" · logs in {self.log_dir}" if self.log_dir else ""
        return f"{self.title} · {self._outcome_summary(now)}{logs}"

    def _render_banner(self, now: float) -> str:
        colour = STATUS_COLOURS[self._outcome]
        logs = f" · logs in <code>{html.escape(self.log_dir)}</code>" if self.log_dir else ""
        return (
            f"<div><b>{html.escape(self.title)}</b> · "
            f'<b style="color:{colour}">{self._outcome_summary(now)}</b>{logs}</div>'
        )

    def _render_table(self, now: float) -> str:
        rows = []
        for rank, record in zip(self._ranks, self._records):
            elapsed = self._elapsed(record, now)
            failed = record.status is RankStatus.FAILED
            background = f' style="background:{FAILED_ROW_BACKGROUND}"' if failed else ""
            last_line = _shortened(rank.last_line)
            rows.append((background, [
                str(rank.rank), _badge(record.status), html.escape(record.host) or "—",
                "—" if elapsed is None else _format_elapsed(elapsed),
                f'<code style="{MONOSPACE}">{html.escape(last_line)}</code>']))
        return html_table(["rank", "status", "host", "elapsed", "last line"], rows)

    def _render_failure(self) -> str:
        if not self._failures:
            return ""
        first, *rest = self._failures.values()
        others = [f"rank {failure.rank} ({html.escape(failure.reason)})" for failure in rest]
        also = f"<div>also failed: {', '.join(others)}</div>" if others else ""
        return (
            f'<div style="border-left:4px solid {STATUS_COLOURS[RankStatus.FAILED]};'
            f'background:{FAILED_ROW_BACKGROUND};padding:4px 8px">'
            f"<b>rank {first.rank} on {html.escape(first.host or self._records[first.rank].host or '?')} failed: "
            f"{html.escape(first.reason)}</b>"
            f'<pre style="margin:4px 0;{MONOSPACE}">{html.escape(self._shown_traceback(first))}</pre>{also}</div>'
        )

    def _shown_traceback(self, failure: RankFailed) -> str:
        return without_machinery_frames(failure.traceback, self._log_path(failure.rank) or "the rank's log")

    def _log_note(self, log: BoundedLog, rank: int | None) -> str:
        if not log.dropped:
            return ""
        note = f"{log.dropped:,} earlier lines not shown"
        if self.log_dir:
            where = self._log_path(rank) if rank is not None else os.path.join(self.log_dir, "rank-N.log")
            note += f" · full log: {where}"
        return note

    def _render_log(self, log: BoundedLog, note: str, labelled: bool) -> str:
        if labelled:
            text = "\n".join(f"[{line.rank}] {line.text}" for line in log.lines)
        else:
            text = "\n".join(line.text for line in log.lines)
        note_html = f'<div style="color:#757575"><i>{html.escape(note)}</i></div>' if note else ""
        # column-reverse keeps the scroll position at the newest line, without any JavaScript.
        return (
            f"{note_html}<div style=\"max-height:{LOG_HEIGHT};overflow:auto;"
            f'display:flex;flex-direction:column-reverse">'
            f'<pre style="margin:0;{MONOSPACE}">{html.escape(text)}</pre></div>'
        )


_drawing_prepared = threading.Event()


class DrawingLoader(threading.Thread):
    """The thread that loads what drawing a timeline takes after a short run, between its
    cell and the next, once a kernel.

    It starts when the cell has ended, and the next cell waits for it before it starts
    (`finish`): the kernel's own thread must not run Python beside it. Importing plotly
    builds Python syntax trees (jsonschema's grammars, `inspect.signature`), as IPython does
    with every cell, and CPython 3.11 keeps one counter for that per interpreter: two
    threads at it at once fail with `SystemError: AST constructor recursion depth mismatch`
    (python/cpython#106905), which a lab's next cell once raised in CI.

    First the timeline's own modules (tenths of a second: `own_modules_loaded`), which a
    finished run needs for its summary and the picture of its lanes; then plotly, with one
    figure drawn and thrown away (a second or more the first time in a process: `plotly.io`
    imports nbformat, whose jsonschema builds grammars as it loads). The finished run leaves
    the drawing of its zoomable figure here (`after_plotly`), which runs it once plotly is
    loaded, or has failed to load (the draw then says why)."""

    def __init__(self):
        super().__init__(daemon=True, name="ddl-magic-timeline-drawing")
        self.own_modules_loaded = threading.Event()
        self._lock = threading.Lock()
        self._waiting: list = []
        self._over = False

    def run(self) -> None:
        _prepare_timeline_drawing(self.own_modules_loaded)
        with self._lock:
            self._over = True
            waiting, self._waiting = self._waiting, []
        for draw in waiting:
            draw()

    def start_once(self) -> None:
        if self.ident is None:
            self.start()

    def finish(self) -> None:
        """Wait until it is done (a second or two), as the next cell does before it starts;
        an interrupt stops the waiting."""
        try:
            self.join(timeout=DRAWING_MODULES_WAIT_S)
        except KeyboardInterrupt:
            pass

    def after_plotly(self, draw) -> bool:
        """Have `draw()` called from this thread once it is done; False if it is done
        already (call it yourself)."""
        with self._lock:
            if self._over:
                return False
            self._waiting.append(draw)
            return True


_drawing_thread: DrawingLoader | None = None


def _between_this_cell_and_the_next(start, finish) -> None:
    """`start()` once the notebook cell running now has ended (IPython's `post_run_cell`),
    and `finish()` before the next one starts (`pre_execute`): work that would slow the
    cell's last steps runs while the kernel waits. Outside a cell, both at once."""
    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is None:
        start()
        finish()
        return

    def cell_ended(*_):
        shell.events.unregister("post_run_cell", cell_ended)
        shell.events.register("pre_execute", next_cell_starts)
        start()

    def next_cell_starts():
        shell.events.unregister("pre_execute", next_cell_starts)
        finish()

    shell.events.register("post_run_cell", cell_ended)


def _prepare_timeline_drawing(own_modules_loaded: threading.Event | None = None) -> None:
    """Import the modules drawing a timeline takes and draw one figure to throw away."""
    try:
        try:
            from ..timeline import analysis, live, load  # noqa: F401
            from . import lanes_svg  # noqa: F401
        finally:  # loaded or not: a view's own import then raises what went wrong
            if own_modules_loaded is not None:
                own_modules_loaded.set()
        from .timeline_widget import warm_up

        warm_up()
    except Exception:  # noqa: BLE001 - the view's own import then raises it where it is shown
        return
    _drawing_prepared.set()


def _shortened(line: str) -> str:
    return line if len(line) <= LAST_LINE_CHARS else line[: LAST_LINE_CHARS - 1] + "…"


def _badge(status: RankStatus) -> str:
    return (
        f'<span style="background:{STATUS_COLOURS[status]};color:white;'
        f'padding:0 6px;border-radius:8px">{status.value}</span>'
    )


def _format_elapsed(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} m {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} m"
