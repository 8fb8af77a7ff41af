"""The text display: rank-prefixed lines, collapsed progress bars, one block per failure.

Also which display ``make_display`` picks, since the text display is its fallback.
"""

import io

import pytest

from ddl_magic.driver.events import FailureKind, RankFailed, RankFinished, RankOutput, RankStarted, TimelineBatch
from ddl_magic.driver.records import new_records
from ddl_magic.driver.text_display import TextDisplay
from ddl_magic.frontends.options import RUN_VIEW_WIDGETS_AFTER_S, make_display
from displays import fed
from ddl_magic.ui.run_view import RunView
from ddl_magic.driver.text_display import TIMELINE_SUMMARY_INTERVAL_S

TRACEBACK = 'Traceback (most recent call last):\n  File "<cell>", line 3\nRuntimeError: loss is NaN\n'


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def out(rank, text, stream="stdout", replace=False):
    return RankOutput(rank=rank, stream=stream, text=text, replace=replace)


@pytest.fixture
def streams():
    return io.StringIO(), io.StringIO()


@pytest.fixture
def clock():
    return FakeClock()


def make_text_display(streams, clock, np=2, **kwargs):
    stdout, stderr = streams
    return fed(lambda records: TextDisplay(records, stdout, error_stream=stderr, clock=clock,
                                           **kwargs), np, kwargs.get("log_dir"))


def test_lines_are_prefixed_with_their_rank_and_go_to_their_stream(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(RankStarted(rank=0, host="node-a", pid=1))
    display.handle(out(0, "hello"))
    display.handle(out(1, "warning: slow", stream="stderr"))
    display.handle(out(1, "world"))
    stdout, stderr = streams
    assert stdout.getvalue() == "[0] hello\n[1] world\n"
    assert stderr.getvalue() == "[1] warning: slow\n"


def test_progress_line_is_printed_when_a_normal_line_follows(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(out(0, "epoch 1: 0%", stream="stderr", replace=True))
    for percent in range(1, 101):
        display.handle(out(0, f"epoch 1: {percent}%", stream="stderr", replace=True))
    display.handle(out(0, "epoch 1 loss 0.4"))
    stdout, stderr = streams
    assert stderr.getvalue() == "[0] epoch 1: 0%\n[0] epoch 1: 100%\n"
    assert stdout.getvalue() == "[0] epoch 1 loss 0.4\n"


def test_progress_line_is_printed_at_most_every_two_seconds(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(out(0, "bar 1%", replace=True))
    clock.now += 1.0
    display.handle(out(0, "bar 2%", replace=True))
    display.refresh()
    clock.now += 1.5
    display.handle(out(0, "bar 3%", replace=True))
    clock.now += 0.1
    display.handle(out(0, "bar 4%", replace=True))
    clock.now += 2.0
    display.refresh()
    assert streams[0].getvalue() == "[0] bar 1%\n[0] bar 3%\n[0] bar 4%\n"


def test_progress_throttle_is_per_rank(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(out(0, "rank 0 bar", replace=True))
    display.handle(out(1, "rank 1 bar", replace=True))
    assert streams[0].getvalue() == "[0] rank 0 bar\n[1] rank 1 bar\n"


def test_finish_prints_the_last_progress_lines_and_a_closing_line(streams, clock):
    display = make_text_display(streams, clock, log_dir="/tmp/ddl_magic/run-3")
    display.handle(out(1, "bar 1%", replace=True))
    display.handle(out(1, "bar 100%", replace=True))
    display.handle(RankFinished(rank=0))
    display.handle(RankFinished(rank=1))
    clock.now += 12.34
    display.finish("done")
    display.finish("done")
    assert streams[0].getvalue() == (
        "[1] bar 1%\n[1] bar 100%\n==== done: 2 ranks in 12.3 s · full logs in /tmp/ddl_magic/run-3 ====\n"
    )


def test_start_is_not_printed(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(RankStarted(rank=0, host="node-a", pid=1))
    assert streams[0].getvalue() == streams[1].getvalue() == ""


def test_failure_prints_one_block_with_the_traceback(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(RankStarted(rank=1, host="node-b", pid=2))
    display.handle(out(1, "bar 7%", replace=True))
    display.handle(out(1, "bar 8%", replace=True))
    failure = RankFailed(rank=1, host="node-b", kind=FailureKind.RAISED, traceback=TRACEBACK, reason="exception")
    display.handle(failure)
    display.handle(failure)
    display.handle(RankFailed(rank=1, host="node-b", kind=FailureKind.VANISHED, traceback="", reason="connection lost"))
    display.finish("failed")

    stdout, stderr = streams
    assert stderr.getvalue() == "==== rank 1 (node-b) failed: exception ====\n" + TRACEBACK
    assert stdout.getvalue() == (
        "[1] bar 7%\n[1] bar 8%\n==== failed after 0.0 s (rank 1 on node-b: exception) ====\n"
    )


def test_failure_host_falls_back_to_the_host_the_rank_started_on(streams, clock):
    display = make_text_display(streams, clock)
    display.handle(RankStarted(rank=0, host="node-a", pid=1))
    display.handle(RankFailed(rank=0, host="", kind=FailureKind.DIED, traceback="", reason="killed by SIGKILL"))
    assert streams[1].getvalue() == "==== rank 0 (node-a) failed: killed by SIGKILL ====\n"


def test_quiet_prints_only_failures_and_the_closing_line(streams, clock):
    display = make_text_display(streams, clock, quiet=True)
    display.handle(out(0, "chatter"))
    display.handle(out(0, "bar", replace=True))
    display.handle(RankFailed(rank=0, host="node-a", kind=FailureKind.RAISED, traceback=TRACEBACK, reason="exception"))
    display.finish("failed")
    stdout, stderr = streams
    assert "chatter" not in stdout.getvalue() and "bar" not in stdout.getvalue()
    assert stdout.getvalue().startswith("==== failed after")
    assert stderr.getvalue().startswith("==== rank 0 (node-a) failed: exception ====")


def test_defaults_to_the_current_sys_streams(capsys):
    display = fed(TextDisplay, 1)
    display.handle(out(0, "to stdout"))
    display.handle(out(0, "to stderr", stream="stderr"))
    captured = capsys.readouterr()
    assert captured.out == "[0] to stdout\n"
    assert captured.err == "[0] to stderr\n"


class FakeKernelShell:
    kernel = object()


def test_make_display_gives_text_outside_a_kernel(monkeypatch):
    monkeypatch.delenv("DDL_MAGIC_DISPLAY", raising=False)
    assert isinstance(make_display(new_records(2)), TextDisplay)


def test_make_display_gives_the_run_view_in_a_kernel_unless_text_is_asked_for(monkeypatch):
    monkeypatch.setattr("IPython.get_ipython", lambda: FakeKernelShell())
    monkeypatch.delenv("DDL_MAGIC_DISPLAY", raising=False)
    view = make_display(new_records(2))
    assert isinstance(view, RunView) and view.widget_after_s == RUN_VIEW_WIDGETS_AFTER_S
    assert isinstance(make_display(new_records(2), quiet=True), TextDisplay)
    monkeypatch.setenv("DDL_MAGIC_DISPLAY", "widgets")  # the widgets from the run's first moment
    assert make_display(new_records(2)).widget_after_s is None
    monkeypatch.setenv("DDL_MAGIC_DISPLAY", "text")
    assert isinstance(make_display(new_records(2)), TextDisplay)
    monkeypatch.setenv("DDL_MAGIC_DISPLAY", "fancy")
    with pytest.raises(ValueError, match="DDL_MAGIC_DISPLAY='fancy'"):
        make_display(new_records(2))


def test_a_timeline_run_prints_a_running_summary_every_few_seconds_and_at_the_end(streams, clock):
    display = make_text_display(streams, clock)
    step = [("scatter_reduce", "grads", 0.0, 300.0, None), ("negotiate", "handle", 300.0, 700.0, None)]
    display.handle(TimelineBatch(rank=0, events=step))
    display.refresh()
    assert "[timeline]" not in streams[0].getvalue()  # not before the interval has passed

    clock.now += TIMELINE_SUMMARY_INTERVAL_S
    display.refresh()
    assert streams[0].getvalue().splitlines() == [
        f"[timeline] {TIMELINE_SUMMARY_INTERVAL_S:.1f} s · % of time waiting/communicating: "
        "rank 0 70/30"]  # no rank recorded compute: no column of dashes

    clock.now += TIMELINE_SUMMARY_INTERVAL_S
    display.refresh()  # nothing new arrived: nothing printed
    display.handle(TimelineBatch(rank=1, events=[("pack", "fc1", 0.0, 50.0, None)]))
    display.finish("done")
    lines = streams[0].getvalue().splitlines()
    assert len(lines) == 3 and lines[1].endswith("rank 0 70/30/– · rank 1 –/–/100")
    assert lines[2].startswith("==== done")


def test_a_quiet_run_prints_no_timeline_summary(streams, clock):
    display = make_text_display(streams, clock, quiet=True)
    display.handle(TimelineBatch(rank=0, events=[("pack", "fc1", 0.0, 50.0, None)]))
    clock.now += 60
    display.refresh()
    display.finish("done")
    assert "[timeline]" not in streams[0].getvalue()
