"""What a display keeps of a run's timeline while it trains, and the zoomable figure of a trace."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ddl_magic.timeline import live as live_timeline
from ddl_magic.timeline.columns import TraceFiles
from ddl_magic.timeline.live import LiveTimeline
from ddl_magic.timeline.load import load_trace
from ddl_magic.ui.timeline_widget import ZoomableTimeline


def test_the_running_summary_adds_up_each_kind_of_time_per_rank():
    live = LiveTimeline()
    live.add(0, [("pack", "a", 0.0, 100.0, None), ("pack", "b", 50.0, 100.0, None),  # 150 µs of union
                 ("allgather", "a", 150.0, 200.0, None), ("queue", "q", 350.0, 50.0, None)])
    live.add(0, [("negotiate", "n", 1000.0, 400.0, None), ("user", "step", 0.0, 1400.0, None)])
    live.add(1, [("broadcast", "w", 10.0, 30.0, None)])
    summary = live.summary()
    assert summary[0] == pytest.approx(
        {"wall_ms": 1.4, "compute_ms": 0.15, "communicate_ms": 0.2, "wait_ms": 0.45})
    assert summary[1]["communicate_ms"] == pytest.approx(0.03)
    assert math.isnan(summary[1]["wait_ms"]) and math.isnan(summary[1]["compute_ms"])
    assert live.summary_line(2.5) == (
        "[timeline] 2.5 s · % of time waiting/communicating/computing: "
        "rank 0 32/14/11 · rank 1 –/100/–")


def test_events_with_a_broken_clock_are_left_out():
    live = LiveTimeline()
    live.add(0, [("pack", "a", math.nan, 1.0, None), ("pack", "b", 0.0, math.inf, None)])
    assert live.version == 0 and live.summary() == {}


def test_a_long_run_is_compacted_to_a_bounded_number_of_intervals(monkeypatch):
    monkeypatch.setattr(live_timeline, "COMPACT_AT", 10_000)
    live = LiveTimeline()
    for batch in range(50):
        starts = (batch * 1000 + np.arange(1000)) * 10.0
        live.add(batch % 2, [("allgather", "x", s, 4.0, None) for s in starts.tolist()])
    trace = live.trace()
    assert len(trace.events) < 10_000
    # Compaction closes gaps but never loses busy time's extent: first start, last end.
    end = trace.events["start_us"] + trace.events["duration_us"]
    assert trace.events["start_us"].min() == 0.0 and end.max() == pytest.approx(49_999 * 10.0 + 4.0)
    assert live.summary()[0]["communicate_ms"] == pytest.approx(25 * 1000 * 4.0 / 1000.0)


def test_zooming_redraws_the_window_in_full_detail_and_double_click_brings_back_the_whole(tmp_path: Path):
    path = tmp_path / "run.timeline.json"
    with TraceFiles(path) as trace:
        trace.add_rank(0, "node-a")
        trace.write(0, [("allgather", f"op {i}", i * 100.0, 50.0, {"bytes": 8}) for i in range(20_000)])
    timeline = ZoomableTimeline(load_trace(path), max_shapes=1_000)
    whole = timeline.widget.data
    assert "how busy each lane was" in timeline.widget.layout.title.text

    # What the browser sends when the user drags over 100-110 ms: plotly's relayout event.
    timeline.widget.plotly_relayout({"xaxis.range[0]": 100.0, "xaxis.range[1]": 110.0})
    assert timeline.window_ms == (100.0, 110.0)
    assert "every event" in timeline.widget.layout.title.text
    bars = timeline.widget.data[0]
    assert len(bars.x) == 101 and sorted(row[0] for row in bars.customdata)[:2] == ["op 1000", "op 1001"]

    timeline.widget.plotly_relayout({"xaxis.autorange": True})
    assert timeline.window_ms is None
    assert len(timeline.widget.data[0].x) == len(whole[0].x)
