"""The run view: what each rank's row, tab and the failure panel show as events arrive.

ipywidgets works without a notebook frontend, so these tests feed events straight in and
read the view's ``state()`` and its widgets' values.
"""

import re
import threading
import time

import pytest

from ddl_magic.driver.events import FailureKind, RankFailed, RankFinished, RankOutput, RankStarted, TimelineBatch
from ddl_magic.ui import RunView
from ddl_magic.ui.run_view import FAILED_ROW_BACKGROUND
from displays import fed

TRACEBACK = 'Traceback (most recent call last):\n  File "<cell>", line 3\nRuntimeError: loss is NaN <1>\n'


def out(rank, text, stream="stdout", replace=False):
    return RankOutput(rank=rank, stream=stream, text=text, replace=replace)


def make_view(np=2, **kwargs):
    kwargs.setdefault("log_dir", "/tmp/ddl_magic/run-7")
    return fed(lambda records: RunView(records, "%%horovod -np 2", **kwargs), np, kwargs["log_dir"])


def tab_text(view, index):
    """The HTML shown in tab ``index`` (0 is "all ranks", 1 + r is rank r)."""
    return view.widget.children[3].children[index].value


def tab_titles(view):
    return view.widget.children[3].titles


def test_ranks_start_run_and_finish():
    view = make_view()
    assert [r["status"] for r in view.state()["ranks"]] == ["starting", "starting"]

    view.handle(RankStarted(rank=0, host="node-a", pid=101))
    view.handle(RankStarted(rank=1, host="node-b", pid=102))
    view.handle(RankFinished(rank=0))
    state = view.state()
    assert [r["status"] for r in state["ranks"]] == ["done", "running"]
    assert [r["host"] for r in state["ranks"]] == ["node-a", "node-b"]
    assert state["status"] == "running"

    view.handle(RankFinished(rank=1))
    view.finish("done")
    assert view.state()["status"] == "done"
    assert "done in" in view.widget.children[0].value


def test_row_shows_status_host_and_last_line():
    view = make_view()
    view.handle(RankStarted(rank=1, host="node-b", pid=7))
    view.handle(out(1, "epoch 1 loss <0.5>"))
    view.refresh()
    table = view.widget.children[1].value
    assert "node-b" in table
    assert "running" in table
    assert "epoch 1 loss &lt;0.5&gt;" in table  # escaped, so output cannot break the page
    assert view.state()["ranks"][1]["last_line"] == "epoch 1 loss <0.5>"


def test_widgets_change_only_on_refresh():
    view = make_view()
    view.handle(out(0, "hello"))
    assert "hello" not in tab_text(view, 1)
    view.refresh()
    assert "hello" in tab_text(view, 1)


def test_each_rank_output_goes_to_its_own_tab():
    view = make_view()
    view.handle(out(0, "from zero"))
    view.handle(out(1, "from one", stream="stderr"))
    view.refresh()
    assert "from zero" in tab_text(view, 1) and "from one" not in tab_text(view, 1)
    assert "from one" in tab_text(view, 2) and "from zero" not in tab_text(view, 2)
    assert view.state()["ranks"][0]["lines"] == ["from zero"]
    assert view.state()["ranks"][1]["lines"] == ["from one"]
    assert tab_titles(view) == ("all ranks", "rank 0", "rank 1")


def test_all_ranks_tab_merges_in_arrival_order_with_labels():
    view = make_view()
    view.handle(out(1, "b"))
    view.handle(out(0, "a"))
    view.handle(out(1, "c"))
    view.refresh()
    assert view.state()["all_ranks"]["lines"] == ["[1] b", "[0] a", "[1] c"]
    assert "[1] b\n[0] a\n[1] c" in tab_text(view, 0)


def test_progress_redraws_collapse_into_one_line():
    view = make_view()
    view.handle(out(0, "starting"))
    for percent in range(0, 101):
        view.handle(out(0, f"epoch 1: {percent}%", stream="stderr", replace=True))
    view.handle(out(1, "rank one talks in between"))
    view.handle(out(0, "epoch 1: 100%", stream="stderr", replace=True))
    view.refresh()

    state = view.state()
    assert state["ranks"][0]["lines"] == ["starting", "epoch 1: 100%"]
    assert state["all_ranks"]["lines"] == [
        "[0] starting",
        "[0] epoch 1: 100%",
        "[1] rank one talks in between",
    ]
    assert "epoch 1: 50%" not in tab_text(view, 1)


def test_normal_line_freezes_progress_line_and_next_bar_starts_anew():
    view = make_view()
    view.handle(out(0, "epoch 1: 100%", replace=True))
    view.handle(out(0, "epoch 1 loss 0.4"))
    view.handle(out(0, "epoch 2: 10%", replace=True))
    view.handle(out(0, "epoch 2: 20%", replace=True))
    assert view.state()["ranks"][0]["lines"] == ["epoch 1: 100%", "epoch 1 loss 0.4", "epoch 2: 20%"]


def test_progress_line_pushed_out_of_all_ranks_comes_back_at_the_bottom():
    view = make_view(max_lines=3)
    view.handle(out(0, "bar 1%", replace=True))
    for i in range(5):
        view.handle(out(1, f"line {i}"))
    view.handle(out(0, "bar 2%", replace=True))
    assert view.state()["all_ranks"]["lines"] == ["[1] line 3", "[1] line 4", "[0] bar 2%"]
    assert view.state()["ranks"][0]["lines"] == ["bar 2%"]


def test_failed_rank_is_highlighted_with_its_traceback():
    view = make_view()
    view.handle(RankStarted(rank=0, host="node-a", pid=1))
    view.handle(RankStarted(rank=1, host="node-b", pid=2))
    view.handle(RankFailed(rank=1, host="node-b", kind=FailureKind.RAISED, traceback=TRACEBACK, reason="exception"))
    view.refresh()

    state = view.state()
    assert state["failed_rank"] == 1
    assert state["ranks"][1]["status"] == "failed"
    assert state["ranks"][1]["failure"] == {"reason": "exception", "traceback": TRACEBACK}
    assert tab_titles(view) == ("all ranks", "rank 0", "rank 1 ✗")
    failure_panel = view.widget.children[2].value
    assert "rank 1 on node-b failed: exception" in failure_panel
    assert "RuntimeError: loss is NaN &lt;1&gt;" in failure_panel
    table = view.widget.children[1].value
    assert re.search(f'<tr style="background:{FAILED_ROW_BACKGROUND}"><td[^>]*>1</td>', table), table
    assert re.search(r"<tr><td[^>]*>0</td>", table), table


def test_first_failure_stays_the_headline():
    view = make_view(np=3)
    view.handle(RankFailed(rank=2, host="node-c", kind=FailureKind.RAISED, traceback=TRACEBACK, reason="exception"))
    view.handle(RankFailed(rank=0, host="node-a", kind=FailureKind.VANISHED, traceback="", reason="connection lost"))
    view.handle(RankFailed(rank=2, host="node-c", kind=FailureKind.DIED, traceback="again", reason="exit code 1"))
    view.finish("failed")

    state = view.state()
    assert state["failed_rank"] == 2
    assert state["ranks"][2]["failure"]["reason"] == "exception"
    assert [r["status"] for r in state["ranks"]] == ["failed", "stopped", "failed"]
    failure_panel = view.widget.children[2].value
    assert "rank 2 on node-c failed: exception" in failure_panel
    assert "also failed: rank 0 (connection lost)" in failure_panel
    assert "failed after" in view.widget.children[0].value


def test_finish_stops_the_clocks_and_marks_unfinished_ranks_stopped():
    view = make_view()
    view.handle(RankStarted(rank=0, host="node-a", pid=1))
    view.finish("interrupted")
    first = view.state()
    time.sleep(0.02)
    second = view.state()
    assert first["elapsed_s"] == second["elapsed_s"]
    assert first["ranks"][0]["elapsed_s"] == second["ranks"][0]["elapsed_s"]
    assert [r["status"] for r in second["ranks"]] == ["stopped", "stopped"]
    assert second["status"] == "interrupted"
    assert "interrupted after" in view.widget.children[0].value


def test_finish_rejects_unknown_status_and_ignores_a_second_call():
    view = make_view()
    with pytest.raises(ValueError, match="'done', 'failed' or 'interrupted'"):
        view.finish("ok")
    view.finish("done")
    view.finish("failed")
    assert view.state()["status"] == "done"


def test_unknown_ranks_are_rejected():
    view = make_view()
    with pytest.raises(ValueError, match="rank 2"):
        view.handle(out(2, "who am I"))
    with pytest.raises(ValueError, match="rank 2"):
        view.handle(TimelineBatch(rank=2, events=[("allgather", "ring", 0.0, 5.0, None)]))


def step_events(step, wait_us):
    """One training step's timeline on one rank: communicate 300 µs, then wait."""
    start = step * 1000.0
    return [("scatter_reduce", f"grads {step}", start, 300.0, {"bytes": 4096, "size": 2}),
            ("negotiate", f"handle {step}", start + 300.0, wait_us, None)]


def test_a_timeline_run_shows_lanes_that_grow_with_each_batch_and_a_running_summary():
    view = make_view(timeline_interval_s=0.0, timeline_share=1.0)
    for rank, host in enumerate(("node-a", "node-b")):
        view.handle(RankStarted(rank=rank, host=host, pid=100 + rank))
    view.refresh()
    assert view.state()["timeline"] is None  # a run without a timeline shows no lanes

    view.handle(TimelineBatch(rank=0, events=step_events(0, 100.0)))
    view.handle(TimelineBatch(rank=1, events=step_events(0, 600.0)))
    view.refresh()
    first = view.state()["timeline"]
    assert first["rows"] == [(0, "negotiate"), (0, "scatter_reduce"), (1, "negotiate"), (1, "scatter_reduce")]
    assert first["events_drawn"] == 4
    # Rank 1 waited 600 of its 900 µs: the slow partner shows while the run trains.
    assert first["summary"][1]["wait_ms"] == pytest.approx(0.6)
    assert first["summary"][1]["wall_ms"] == pytest.approx(0.9)

    view.handle(TimelineBatch(rank=0, events=step_events(1, 100.0)))
    view.refresh()
    assert view.state()["timeline"]["events_drawn"] == 6
    lanes = view.widget.children[-2]
    assert "rank 1 (node-b) · negotiate" in lanes.layout.yaxis.ticktext
    summary_html = view.widget.children[-3].value
    assert "wait %" in summary_html and re.search(r"<td[^>]*>67</td>", summary_html)  # 600 of 900 µs


def test_clicking_a_ranks_lane_opens_its_log_tab():
    from plotly.callbacks import InputDeviceState, Points

    view = make_view(timeline_interval_s=0.0, timeline_share=1.0)
    view.handle(TimelineBatch(rank=0, events=step_events(0, 100.0)))
    view.handle(TimelineBatch(rank=1, events=step_events(0, 100.0)))
    view.refresh()
    lanes = view.widget.children[-2]
    rows = view.state()["timeline"]["rows"]
    clicked = next(bars for bars in lanes.data if bars.name == "negotiate")
    clicked._dispatch_on_click(
        Points(point_inds=[0], xs=[0.3], ys=[rows.index((1, "negotiate"))], trace_name=clicked.name,
               trace_index=0),
        InputDeviceState(ctrl=False, alt=False, shift=False, meta=False, button=0, buttons=1))
    assert view.state()["selected_tab"] == 2  # "all ranks", "rank 0", "rank 1"


def test_the_lanes_are_drawn_once_more_when_the_run_ends():
    view = make_view(timeline_interval_s=3600.0, timeline_share=1.0)
    view.handle(TimelineBatch(rank=0, events=step_events(0, 100.0)))
    view.refresh()  # the first batch is drawn at once
    view.handle(TimelineBatch(rank=0, events=step_events(1, 100.0)))
    view.refresh()  # within the interval: not redrawn
    assert view.state()["timeline"]["events_drawn"] == 2
    view.finish("done")
    assert view.state()["timeline"]["events_drawn"] == 4


def test_a_finished_run_shows_its_lanes_as_a_picture_until_plotly_has_loaded(tmp_path, monkeypatch):
    """A short run in a fresh kernel ends before it would pay for plotly (a second or more of
    CPU-bound imports there): the cell ends at once with the summary and the lanes as a
    picture; the thread loading plotly starts then, and its figure takes the picture's place.
    A run that needs plotly meanwhile waits for the same thread: no second importer."""
    from ddl_magic.ui import run_view

    released = threading.Event()
    load_for_real = run_view._prepare_timeline_drawing

    def plotly_loads_when_released(own_modules_loaded=None):
        from ddl_magic.timeline import analysis, live, load  # noqa: F401 - the summary's own

        own_modules_loaded.set()
        released.wait(timeout=30)
        load_for_real()

    monkeypatch.setattr(run_view, "_prepare_timeline_drawing", plotly_loads_when_released)
    monkeypatch.setattr(run_view, "_drawing_prepared", threading.Event())
    monkeypatch.setattr(run_view, "_drawing_thread", None)
    # The cell ends, and no next cell waits (an IPython shell another test made may exist).
    monkeypatch.setattr(run_view, "_between_this_cell_and_the_next", lambda start, finish: start())
    try:
        view = make_view(timeline_path=str(two_rank_trace(tmp_path)))
        view.refresh()
        assert view.inner._drawing_modules is None, "plotly loads beside a run under a second"
        view.finish("done")
        loader = view.inner._drawing_modules
        assert loader.name == "ddl-magic-timeline-drawing" and loader.is_alive()
        picture = view.widget.children[-2]
        assert "<svg" in picture.value and "zoomable once plotly has loaded" in picture.value
        assert "Waited longest" in view.widget.children[-3].value  # the summary, from the trace
        banner = view.widget.children[0].value
        assert "done in" in banner and "loading" not in banner and "drawing" not in banner
        second = make_view(timeline_path=str(tmp_path / "next.json"))
        second.inner._started_at -= run_view.DRAWING_STARTS_AFTER_S  # a second of its run
        second_refresh = threading.Thread(target=second.refresh, daemon=True)
        second_refresh.start()
        second_refresh.join(timeout=0.5)
        assert second_refresh.is_alive(), "the second view waits for the loading thread"
    finally:
        released.set()
    second_refresh.join(timeout=60)
    assert not second_refresh.is_alive() and second.inner._drawing_modules is loader
    loader.join(timeout=60)
    assert not loader.is_alive()
    assert type(view.widget.children[-2]).__name__ == "FullWidthFigureWidget"
    assert view.state()["timeline"]["events_drawn"] > 0


def test_a_run_of_a_second_loads_plotly_on_its_own_thread(monkeypatch):
    """Beside a running cell no thread of ours imports plotly: the cell's own thread would
    build syntax trees beside it (IPython, user code), which CPython 3.11 cannot do in two
    threads at once. The live lanes' view loads it on the driver's thread."""
    from ddl_magic.ui import run_view

    monkeypatch.setattr(run_view, "_drawing_prepared", threading.Event())
    monkeypatch.setattr(run_view, "_drawing_thread", None)
    view = make_view(timeline_path="/nonexistent/timeline.json")
    view.inner._started_at -= run_view.DRAWING_STARTS_AFTER_S
    threads = set(threading.enumerate())
    view.refresh()
    assert run_view._drawing_prepared.is_set()
    assert set(threading.enumerate()) <= threads and run_view._drawing_thread is None


def test_loading_the_drawing_modules_draws_a_figure_once_per_process(monkeypatch):
    from ddl_magic.ui import run_view

    monkeypatch.setattr(run_view, "_drawing_prepared", threading.Event())
    run_view._prepare_timeline_drawing()  # its errors would be silent: the view's imports raise them
    assert run_view._drawing_prepared.is_set()
    threads = threading.active_count()
    make_view(timeline_path="/nonexistent/timeline.json")
    assert threading.active_count() == threads  # loaded once: no second thread


def test_sixteen_ranks_and_many_lines_stay_bounded():
    np, lines_per_rank, max_lines = 16, 10_000, 500
    view = fed(lambda records: RunView(records, "%%horovod -np 16", "/tmp/ddl_magic/run-9",
                                       max_lines=max_lines), np, "/tmp/ddl_magic/run-9")
    started = time.perf_counter()
    for i in range(lines_per_rank):
        for rank in range(np):
            view.handle(out(rank, f"step {i}"))
        if i % 1000 == 0:
            view.refresh()
    view.finish("done")
    assert time.perf_counter() - started < 10

    state = view.state()
    for rank_state in state["ranks"]:
        assert len(rank_state["lines"]) == max_lines
        assert rank_state["lines"][-1] == f"step {lines_per_rank - 1}"
        assert rank_state["dropped"] == lines_per_rank - max_lines
    assert len(state["all_ranks"]["lines"]) == max_lines
    assert state["all_ranks"]["dropped"] == np * lines_per_rank - max_lines

    rank_3_tab = tab_text(view, 1 + 3)
    assert "9,500 earlier lines not shown" in rank_3_tab
    assert "/tmp/ddl_magic/run-9/rank-3.log" in rank_3_tab
    assert state["ranks"][3]["log_path"] == "/tmp/ddl_magic/run-9/rank-3.log"
    assert "159,500 earlier lines not shown" in tab_text(view, 0)
    assert rank_3_tab.count("\n") < max_lines + 5


def test_no_dropped_note_while_everything_fits():
    view = make_view()
    view.handle(out(0, "only line"))
    view.refresh()
    assert "not shown" not in tab_text(view, 1)
    assert view.state()["ranks"][0]["dropped"] == 0


def test_the_view_renders_the_drivers_records_as_the_driver_decided_them():
    """Given the run's records, the view shows what the driver decided (a rank it stopped
    after another failed), not what the events alone would suggest, and so does the text
    display: one record per rank behind both."""
    from io import StringIO

    from ddl_magic.driver.records import RankStatus, new_records
    from ddl_magic.driver.text_display import TextDisplay

    records = new_records(2)
    view, text = RunView(records, "%%horovod -np 2", None), TextDisplay(records, StringIO(),
                                                                          error_stream=StringIO())
    for rank, host in ((0, "node-a"), (1, "node-b")):
        records[rank].apply(RankStarted(rank=rank, host=host, pid=100 + rank))
    cause = RankFailed(rank=0, host="", kind=FailureKind.RAISED, traceback=TRACEBACK,
                       reason="exception")
    records[0].apply(cause)
    records[1].end(RankStatus.STOPPED)  # the driver's decision: it stopped rank 1
    for display in (view, text):
        display.handle(cause)
        display.finish("failed")
    state = view.state()
    assert [r["status"] for r in state["ranks"]] == ["failed", "stopped"]
    assert state["ranks"][0]["host"] == "node-a" and state["failed_rank"] == 0
    assert "rank 0 on node-a failed: exception" in view.widget.children[2].value
    assert "==== rank 0 (node-a) failed: exception ====" in text._err().getvalue()


def test_the_live_summary_leaves_out_a_kind_no_rank_recorded():
    view = make_view(timeline_interval_s=0.0, timeline_share=1.0)
    view.handle(TimelineBatch(rank=0, events=step_events(0, 100.0)))
    view.refresh()
    summary_html = view.widget.children[-3].value
    assert "<b>timeline so far</b>" in summary_html
    assert "wait %" in summary_html and "compute %" not in summary_html  # nothing packed: no "–" column


def two_rank_trace(tmp_path):
    from ddl_magic.timeline.columns import TraceFiles

    path = tmp_path / "timeline.json"
    with TraceFiles(path) as trace:
        for rank in range(2):
            trace.add_rank(rank, f"node-{rank}")
            trace.write(rank, step_events(0, 100.0 + 500.0 * rank))
    return path


def test_a_finished_timeline_run_draws_the_whole_trace_in_its_one_figure(tmp_path):
    from ddl_magic.ui import run_view

    run_view._prepare_timeline_drawing()  # loaded, as in a kernel after its first timeline run
    path = two_rank_trace(tmp_path)
    view = make_view(timeline_interval_s=0.0, timeline_share=1.0, timeline_path=str(path))
    view.handle(TimelineBatch(rank=0, events=step_events(0, 100.0)))
    view.refresh()
    lanes = view.widget.children[-2]
    drawn = view.inner._show_final_timeline
    banners = []  # what the banner said while the finished run's figure was drawn
    view.inner._show_final_timeline = lambda: banners.append(view.widget.children[0].value) or drawn()
    view.finish("done")
    assert "done in" in banners[0] and "drawing the timeline" in banners[0]
    assert "drawing" not in view.widget.children[0].value
    # Renderers without widgets (nbconvert, GitHub) get the lanes as a picture, row by row.
    picture = re.search(r"<svg .*</svg>", view.report_html()).group(0)
    assert "rank 1 (node-1) · negotiate" in picture and "<rect" in picture
    assert view.widget.children[-2] is lanes  # the same figure, not a second one
    assert [child for child in view.widget.children if "Figure" in type(child).__name__] == [lanes]
    assert "grads 0" in {row[0] for bars in lanes.data for row in bars.customdata}  # names from the file
    summary_html = view.widget.children[-3].value
    assert summary_html.startswith("<b>timeline</b>") and "Waited longest: rank 1" in summary_html
    assert "\n\ntimeline\nWaited longest: rank 1" in view.report_text()


def test_no_empty_output_box_before_a_rank_prints():
    view = make_view()
    tabs = view.widget.children[3]
    assert tabs.layout.display == "none"
    view.handle(out(0, "hello"))
    view.refresh()
    assert tabs.layout.display is None


def test_the_report_for_frontends_without_widgets_is_the_final_table_and_the_output():
    view = make_view()
    for rank in range(2):
        view.handle(RankStarted(rank=rank, host="node-a", pid=100 + rank))
        view.handle(out(rank, f"hello from {rank}"))
    view.handle(RankFinished(rank=0))
    view.handle(out(1, "RuntimeError: loss is NaN <1>"))
    view.handle(RankFailed(rank=1, host="node-a", kind=FailureKind.RAISED, traceback=TRACEBACK, reason="exception"))
    view.finish("failed")
    text = view.report_text()
    assert text.startswith("%%horovod -np 2 · failed after ")
    assert "logs in /tmp/ddl_magic/run-7" in text.splitlines()[0]
    assert re.search(r"^0 +done +node-a +[\d.]+ s +hello from 0$", text, re.M), text
    assert re.search(r"^1 +failed +node-a", text, re.M), text
    assert "[0] hello from 0\n[1] hello from 1" in text
    assert "rank 1 on node-a failed: exception\nTraceback (most recent call last)" in text
    html_report = view.report_html()
    assert "failed after" in html_report and "hello from 1" in html_report and "&lt;1&gt;" in html_report
    # What nbconvert renders: no negative margin that clips the "rank" header's first letter,
    # and the logs, the traceback and the last lines in monospace.
    assert "margin-left:-" not in html_report
    assert len(re.findall(r'<(?:pre|code) style="[^"]*monospace', html_report)) == 2 + 2  # log, traceback, 2 rows


def test_a_run_over_before_widget_after_s_shows_its_report_and_makes_no_widget(monkeypatch):
    # A pool's cells: most end in milliseconds, and widgets cost more than the cell itself.
    shown = []
    monkeypatch.setattr("IPython.display.display",
                        lambda bundle, **kwargs: shown.append(bundle) or _Handle(shown))
    view = make_view(widget_after_s=60.0)
    view.display()
    view.handle(RankStarted(0, "node-a", 11))
    view.handle(out(0, "hello"))
    view.refresh()
    assert shown == []  # nothing yet: the report comes when the run ends
    view.finish("done")
    assert len(shown) == 1 and "application/vnd.jupyter.widget-view+json" not in shown[0]
    assert "[0] hello" in shown[0]["text/plain"] and "done in" in shown[0]["text/html"]


def test_a_run_that_outlasts_widget_after_s_gets_the_full_view(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display",
                        lambda bundle, **kwargs: shown.append(bundle) or _Handle(shown))
    view = make_view(widget_after_s=0.0)
    view.display()
    view.handle(out(1, "still going"))
    view.refresh()
    assert "application/vnd.jupyter.widget-view+json" in shown[0]
    assert "still going" in tab_text(view, 2)
    view.finish("done")
    assert "[1] still going" in shown[-1]["text/plain"]
    assert shown[-1]["application/vnd.jupyter.widget-view+json"] == shown[0][
        "application/vnd.jupyter.widget-view+json"]


class _Handle:
    """What `display(..., display_id=True)` returns: `update` replaces the output."""

    def __init__(self, shown):
        self.shown = shown

    def update(self, bundle, **kwargs):
        self.shown.append(bundle)


def test_work_left_for_the_cells_end_runs_between_it_and_the_next_cell():
    """What the first timeline of a kernel loads after a short run starts when its cell has
    ended (IPython's post_run_cell) and is finished before the next cell starts, in a real
    shell: once, and not again after the next cell."""
    from IPython.core.interactiveshell import InteractiveShell

    from ddl_magic.ui import run_view

    shell = InteractiveShell.instance()
    calls = []
    shell.user_ns.update(calls=calls, between=run_view._between_this_cell_and_the_next)
    shell.run_cell("between(lambda: calls.append('started'), lambda: calls.append('finished'))\n"
                   "calls.append('in the cell')")
    assert calls == ["in the cell", "started"]
    shell.run_cell("calls.append('the next cell')")
    assert calls == ["in the cell", "started", "finished", "the next cell"]
    shell.run_cell("calls.append('the cell after')")
    assert calls == ["in the cell", "started", "finished", "the next cell", "the cell after"]
