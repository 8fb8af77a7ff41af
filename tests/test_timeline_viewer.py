"""The viewer reads our traces and Horovod's, summarises them correctly and draws them lightly."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from ddl_magic.runtime.timeline import TimelineRecorder
from ddl_magic.timeline.analysis import format_summary, lane_category, summarize
from ddl_magic.timeline.columns import TraceFiles, columnar_path
from ddl_magic.timeline.load import load_trace
from ddl_magic.timeline.trace import TraceData
from ddl_magic.ui.show_timeline import show_timeline
from ddl_magic.ui.timeline_figure import build_figure, lane_color

MB = 1_000_000

# Which of a run's two files the tests of our format read: every such test runs on both.
READ_COLUMNS = True


@pytest.fixture(autouse=True, params=["columns", "chrome json"])
def our_trace_format(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "READ_COLUMNS", request.param == "columns")


def write_trace(path: Path, batches: dict[int, list[tuple]], hosts: dict[int, str] | None = None) -> Path:
    """A run's trace files; without its columnar copy when the test reads the Chrome trace."""
    with TraceFiles(path) as trace:
        for rank in sorted(batches):
            trace.add_rank(rank, (hosts or {}).get(rank, "node-a"))
        for rank, events in batches.items():
            trace.write(rank, events)
    if not READ_COLUMNS:
        columnar_path(path).unlink()
    return path


def hand_made_trace(path: Path) -> Path:
    """Two ranks, times in µs; the expected summary is worked out in the tests below."""
    big = 6 * MB
    return write_trace(path, {
        0: [
            ("pack", "op", 0.0, 10.0, {"tensors": ["a"]}),
            ("pack", "op", 5.0, 10.0, {"tensors": ["a"]}),  # overlaps the first: 0-15 is busy
            ("scatter_reduce", "op", 10.0, 30.0, {"bytes": big, "tensors": ["a", "b"], "size": 2}),
            ("allgather", "op", 40.0, 30.0, {"bytes": big, "tensors": ["a", "b"], "size": 2}),
            ("unpack", "op", 70.0, 10.0, None),
            ("negotiate", "handle 1", 80.0, 20.0, None),
            ("user", "step 0", 0.0, 100.0, None),
        ],
        1: [
            ("scatter_reduce", "op", 1000.0, 50.0, {"bytes": big, "tensors": ["a", "b"], "size": 2}),
            ("negotiate", "handle 1", 1050.0, 150.0, None),
        ],
    }, hosts={0: "node-a", 1: "node-b"})


# Horovod's timeline writer, re-enacted: one process per tensor, B/E pairs per activity, a
# tick (X, dur 0, named after the rank) per rank ready in negotiation, global CYCLE_START
# instants. ``style="old"`` is horovod < 0.21 (every line ends in ",", no closing "]"),
# ``style="new"`` rewrites a closing "]" after every event.
HOROVOD_RECORDS: list[tuple[Any, ...]] = [
    ("marker", "CYCLE_START", 0),
    ("event", "fc1.weight", "B", "NEGOTIATE_ALLREDUCE", "", 100),
    ("event", "fc1.weight", "X", "0", "", 105),
    ("event", "fc1.bias", "B", "NEGOTIATE_ALLREDUCE", "", 110),
    ("event", "fc1.weight", "X", "1", "", 140),
    ("event", "fc1.weight", "E", "", "", 150),
    ("event", "fc1.weight", "B", "ALLREDUCE", "", 150),
    ("event", "fc1.weight", "B", "QUEUE", "", 150),
    ("event", "fc1.weight", "E", "", "", 170),
    ("event", "fc1.weight", "B", "MEMCPY_IN_FUSION_BUFFER", "", 170),
    ("event", "fc1.weight", "E", "", "", 180),
    ("event", "fc1.weight", "B", "NCCL_ALLREDUCE", "", 180),
    ("event", "fc1.weight", "E", "", "", 250),
    ("event", "fc1.weight", "B", "MEMCPY_OUT_FUSION_BUFFER", "", 250),
    ("event", "fc1.weight", "E", "", "", 260),
    ("event", "fc1.weight", "E", "", '"dtype": "float32", "shape": "[128,64]"', 260),
    ("marker", "CYCLE_START", 300),
    ("event", "fc1.bias", "E", "", "", 310),
    ("event", "fc1.bias", "B", "ALLREDUCE", "", 310),
    ("event", "fc1.bias", "B", "NCCL_ALLREDUCE", "", 320),
    ("event", "fc1.bias", "E", "", "", 340),
    ("event", "fc1.bias", "E", "", '"dtype": "float32", "shape": "[128]"', 345),
]


def horovod_timeline(records: list[tuple[Any, ...]], style: str) -> str:
    text = "[\n"
    if style == "new":
        text += ('{"name": "process_name", "ph": "M", "pid": 0, '
                 '"args": {"start_time_since_epoch_in_micros":1700000000000000}},\n'
                 '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},\n')
    tensor_pids: dict[str, int] = {}
    first = True
    for record in records:
        if style == "new" and not first:
            text = text[:-1] + ","
        first = False
        if record[0] == "marker":
            line = f'{{"ph": "i", "name": "{record[1]}", "ts": {record[2]}, "s": "g"}}'
        else:
            _, tensor, phase, op, args, ts = record
            if tensor not in tensor_pids:
                pid = tensor_pids[tensor] = len(tensor_pids) + 1
                text += (f'{{"name": "process_name", "ph": "M", "pid": {pid}, '
                         f'"args": {{"name": "{tensor}"}}}},\n'
                         f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, '
                         f'"args": {{"sort_index": {pid}}}}},\n')
            line = f'{{"ph": "{phase}"'
            if phase != "E":
                line += f', "name": "{op}"'
            line += f', "ts": {ts}, "pid": {tensor_pids[tensor]}'
            if phase == "X":
                line += ', "dur": 0'
            if args:
                line += f', "args": {{{args}}}'
            line += "}"
        text += line + ("]" if style == "new" else ",\n")
    return text


@pytest.fixture
def horovod_new(tmp_path: Path) -> Path:
    path = tmp_path / "horovod_new.json"
    path.write_text(horovod_timeline(HOROVOD_RECORDS, "new"))
    return path


def horovod_events(trace: TraceData) -> set[tuple[str, str, float, float]]:
    frame = trace.events
    return set(zip(frame["lane"].astype(str), frame["name"], frame["start_us"], frame["duration_us"]))


# Loading our format.

def test_loads_every_event_of_our_trace_with_ranks_lanes_and_sizes(tmp_path: Path) -> None:
    trace = load_trace(hand_made_trace(tmp_path / "t.json"))
    assert trace.source == "ddl_magic" and not trace.truncated
    assert len(trace.events) == 9
    assert trace.rank_names == {0: "rank 0 (node-a)", 1: "rank 1 (node-b)"}
    scatter = trace.events[(trace.events["rank"] == 1) & (trace.events["lane"] == "scatter_reduce")].iloc[0]
    assert (scatter["start_us"], scatter["duration_us"], scatter["bytes"], scatter["world_size"]) == (
        1000.0, 50.0, 6 * MB, 2)
    assert scatter["tensors"] == ["a", "b"]
    assert trace.events.loc[trace.events["lane"] == "unpack", "tensors"].iloc[0] == []


def test_tensors_given_only_as_a_count_are_no_names(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.json", {0: [
        ("scatter_reduce", "3 tensors", 0.0, 5.0, {"bytes": 64, "tensors": 3, "size": 2}),
        ("broadcast", "fc1.weight", 5.0, 5.0, {"bytes": 64, "tensor": "fc1.weight"}),
    ]})
    trace = load_trace(path)
    assert trace.events["tensors"].tolist() == [[], ["fc1.weight"]]
    assert summarize(trace).loc[0, "top_tensors"] == "fc1.weight 0.005 ms"


def test_a_fused_buckets_name_is_said_in_words(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.json", {0: [
        ("broadcast", "b", 0.0, 5.0, {"bytes": 64, "tensor": "allreduce.fc1.bias+5"}),
        ("broadcast", "c", 5.0, 4.0, {"bytes": 64, "tensor": "allreduce.fc2.bias+1"}),
    ]})
    assert summarize(load_trace(path)).loc[0, "top_tensors"] == (
        "allreduce.fc1.bias (and 5 more tensors fused with it) 0.005 ms, "
        "allreduce.fc2.bias (and 1 more tensor fused with it) 0.004 ms")


def test_rows_follow_the_fixed_lane_order_per_rank(tmp_path: Path) -> None:
    trace = load_trace(hand_made_trace(tmp_path / "t.json"))
    assert trace.rows == [
        (0, "user"), (0, "negotiate"), (0, "pack"), (0, "scatter_reduce"), (0, "allgather"),
        (0, "unpack"), (1, "negotiate"), (1, "scatter_reduce"),
    ]


def test_a_trace_cut_mid_event_loads_up_to_its_last_complete_event(tmp_path: Path) -> None:
    whole = hand_made_trace(tmp_path / "t.json").read_text()
    cut_at = whole.rindex('"tensors"')  # inside rank 1's scatter_reduce, its batch's first event
    (tmp_path / "cut.json").write_text(whole[:cut_at])
    trace = load_trace(tmp_path / "cut.json")
    assert trace.truncated
    assert len(trace.events) == 7
    assert set(trace.events["rank"]) == {0}
    assert trace.rank_names[1] == "rank 1 (node-b)"


def test_events_recorded_on_ranks_come_back_on_the_driver_clock(tmp_path: Path) -> None:
    batches = {}
    for rank, offset_ns in ((0, 1_000_000), (1, -500_000)):  # each rank's clock is off differently
        rec = TimelineRecorder()
        rec.enabled, rec.clock_offset_ns = True, offset_ns
        rec.record("pack", "fc1", 2_000_000 - offset_ns, 2_010_000 - offset_ns, {"tensors": ["fc1"]})
        batches[rank] = rec.drain()
    path = write_trace(tmp_path / "t.json", batches)
    events = load_trace(path).events
    assert list(events["start_us"]) == [2000.0, 2000.0]
    assert list(events["duration_us"]) == [10.0, 10.0]


# Loading Horovod's format.

def test_horovod_activities_become_lanes_of_rank_0_with_events_named_by_tensor(horovod_new: Path) -> None:
    trace = load_trace(horovod_new)
    assert trace.source == "horovod" and not trace.truncated
    assert set(trace.events["rank"]) == {0}
    events = horovod_events(trace)
    assert {
        ("NEGOTIATE_ALLREDUCE", "fc1.weight", 100.0, 50.0),
        ("ALLREDUCE", "fc1.weight", 150.0, 110.0),
        ("QUEUE", "fc1.weight", 150.0, 20.0),
        ("MEMCPY_IN_FUSION_BUFFER", "fc1.weight", 170.0, 10.0),
        ("NCCL_ALLREDUCE", "fc1.weight", 180.0, 70.0),
        ("MEMCPY_OUT_FUSION_BUFFER", "fc1.weight", 250.0, 10.0),
        ("NEGOTIATE_ALLREDUCE", "fc1.bias", 110.0, 200.0),
        ("NCCL_ALLREDUCE", "fc1.bias", 320.0, 20.0),
        ("ALLREDUCE", "fc1.bias", 310.0, 35.0),
        ("NEGOTIATE_RANK_READY", "fc1.weight: rank 0 ready", 105.0, 0.0),
        ("NEGOTIATE_RANK_READY", "fc1.weight: rank 1 ready", 140.0, 0.0),
        ("CYCLE_START", "CYCLE_START", 0.0, 0.0),
        ("CYCLE_START", "CYCLE_START", 300.0, 0.0),
    } == events
    tensors = trace.events.set_index("name")["tensors"]
    assert {tuple(t) for t in tensors["fc1.bias"]} == {("fc1.bias",)}
    assert tensors["fc1.weight: rank 0 ready"] == ["fc1.weight"]
    assert {tuple(t) for t in tensors["CYCLE_START"]} == {()}


def test_horovod_files_without_closing_bracket_or_cut_short_load_too(
    tmp_path: Path, horovod_new: Path
) -> None:
    complete = horovod_events(load_trace(horovod_new))

    old_style = tmp_path / "old.json"
    old_style.write_text(horovod_timeline(HOROVOD_RECORDS, "old"))  # trailing ",\n", no "]"
    old = load_trace(old_style)
    assert old.truncated and horovod_events(old) == complete

    no_bracket = tmp_path / "no_bracket.json"
    no_bracket.write_text(horovod_new.read_text().rstrip("]"))
    assert horovod_events(load_trace(no_bracket)) == complete

    mid_event = tmp_path / "mid_event.json"
    text = horovod_timeline(HOROVOD_RECORDS, "old")
    mid_event.write_text(text[: text.rindex('"args"') + 12])  # inside the last E's args
    assert len(load_trace(mid_event).events) == len(complete)


def test_a_horovod_span_left_open_runs_to_the_end_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "hung.json"
    path.write_text(horovod_timeline(HOROVOD_RECORDS[:5], "old"))  # fc1.bias never finished negotiating
    trace = load_trace(path)
    stuck = trace.events[trace.events["name"].str.startswith("fc1.bias")].iloc[0]
    assert (stuck["lane"], stuck["name"], stuck["start_us"], stuck["duration_us"]) == (
        "NEGOTIATE_ALLREDUCE", "fc1.bias (unfinished)", 110.0, 30.0)


@pytest.mark.parametrize("text", ["", "[", "[\n"])
def test_an_empty_file_or_a_lone_bracket_is_an_empty_trace(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.json"
    path.write_text(text)
    trace = load_trace(path)
    assert trace.events.empty and trace.truncated
    assert isinstance(build_figure(trace), go.Figure)
    assert summarize(trace).empty


def test_a_file_that_is_no_trace_says_so(tmp_path: Path) -> None:
    path = tmp_path / "notes.json"
    path.write_text("hello")
    with pytest.raises(ValueError, match="neither a JSON array of events nor a Chrome trace"):
        load_trace(path)


# Summary.

def test_summary_of_a_hand_made_trace(tmp_path: Path) -> None:
    summary = summarize(load_trace(hand_made_trace(tmp_path / "t.json")))
    rank0, rank1 = summary.loc[0], summary.loc[1]

    assert rank0["name"] == "rank 0 (node-a)"
    assert rank0["events"] == 7
    assert rank0["wall_ms"] == pytest.approx(0.100)
    assert rank0["compute_ms"] == pytest.approx(0.025)      # packs 0-15 (overlap once) + unpack 10
    assert rank0["communicate_ms"] == pytest.approx(0.060)  # scatter-reduce 30 + allgather 30
    assert rank0["wait_ms"] == pytest.approx(0.020)
    assert rank0["busy_fraction"] == pytest.approx(0.80)    # 0-80 busy of 0-100
    # Each phase puts (n-1)/n = 1/2 of 6 MB on the bus: 6 MB in 60 µs is 100 GB/s.
    assert rank0["bus_bytes"] == 6 * MB
    assert rank0["bus_gbps"] == pytest.approx(100.0)
    assert rank0["top_tensors"] == "a 0.08 ms, b 0.06 ms"

    assert rank1["wall_ms"] == pytest.approx(0.200)
    assert math.isnan(rank1["compute_ms"])                  # rank 1 recorded no compute at all
    assert rank1["busy_fraction"] == pytest.approx(0.25)
    assert rank1["bus_gbps"] == pytest.approx(3 * MB / 50 / 1000)


def test_summary_of_a_horovod_trace_sorts_its_activities(horovod_new: Path) -> None:
    rank0 = summarize(load_trace(horovod_new)).loc[0]
    assert rank0["wait_ms"] == pytest.approx(0.210)                # negotiations 100-310, QUEUE inside
    assert rank0["compute_ms"] == pytest.approx(0.020)             # the two fusion-buffer copies
    assert rank0["communicate_ms"] == pytest.approx(0.090)         # the two NCCL_ALLREDUCEs
    # Horovod's ALLREDUCE spans the activities inside it, so it is not counted again.
    assert rank0["top_tensors"] == "fc1.bias 0.22 ms, fc1.weight 0.16 ms"
    assert math.isnan(rank0["bus_bytes"]) and math.isnan(rank0["bus_gbps"])  # Horovod records no sizes


def test_ranks_that_share_memory_put_their_collectives_bytes_on_the_bus(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.json", {0: [
        ("negotiate", "grads", 0.0, 10.0, None),
        ("shared_memory", "grads", 10.0, 100.0, {"bytes": 8 * MB, "op": "allreduce", "size": 4}),
        ("shared_memory", "shapes", 110.0, 50.0, {"bytes": 4 * MB, "op": "allgather", "size": 4}),
        ("shared_memory", "weights", 160.0, 50.0, {"bytes": 1 * MB, "op": "broadcast"}),
    ]})
    rank0 = summarize(load_trace(path)).loc[0]
    # NCCL's convention: an allreduce 2(n-1)/n of its buffer, an allgather (n-1)/n, a broadcast all.
    assert rank0["bus_bytes"] == pytest.approx(12 * MB + 3 * MB + 1 * MB)
    assert rank0["bus_gbps"] == pytest.approx(16 * MB / 200 / 1000)  # over 200 µs: 80 GB/s
    assert rank0["communicate_ms"] == pytest.approx(0.200)


def test_a_hierarchical_allreduce_counts_the_ring_phases_inside_it_once(tmp_path: Path) -> None:
    between_hosts = {"bytes": 8 * MB, "tensors": ["grads"], "size": 2}
    path = write_trace(tmp_path / "t.json", {0: [
        ("shared_memory", "grads", 0.0, 100.0, {"bytes": 8 * MB, "op": "hierarchical allreduce", "size": 4}),
        ("scatter_reduce", "grads", 20.0, 20.0, between_hosts),
        ("allgather", "grads", 50.0, 20.0, between_hosts),
        ("scatter_reduce", "later", 200.0, 50.0, between_hosts),  # a plain ring allreduce: counted
    ]})
    rank0 = summarize(load_trace(path)).loc[0]
    assert rank0["bus_bytes"] == pytest.approx(12 * MB + 4 * MB)
    assert rank0["bus_gbps"] == pytest.approx(16 * MB / 150 / 1000)


def test_what_a_rank_did_not_record_is_nan_not_zero(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.json", {0: [
        ("negotiate", "grads", 0.0, 10.0, None),
        ("user", "step 0", 0.0, 50.0, None),
    ]})
    rank0 = summarize(load_trace(path)).loc[0]
    assert rank0["wait_ms"] == pytest.approx(0.010) and rank0["wall_ms"] == pytest.approx(0.050)
    for column in ("compute_ms", "communicate_ms", "busy_fraction", "bus_bytes", "bus_gbps"):
        assert math.isnan(rank0[column]), column


# The summary as shown.

SHOWN_COLUMNS = ["wall ms", "wait ms", "wait %", "busy %", "compute ms", "communicate ms",
                 "bus GB/s", "bus MB", "events", "slowest tensors"]


def test_the_shown_summary_has_units_in_its_headers_rounded_numbers_and_dashes() -> None:
    nan = math.nan
    summary = pd.DataFrame({
        "name": ["rank 0 (vm)", "rank 1 (vm)", "python"],
        "events": [12_345, 7, 1],
        "wall_ms": [3012.4, 8.560421, 0.0],
        "compute_ms": [nan, 0.0, nan],
        "communicate_ms": [41.5386, 0.542334, nan],
        "wait_ms": [355.525, 0.0004, nan],
        "busy_fraction": [0.0893, 0.063, nan],
        "bus_bytes": [11_669_050.0, nan, nan],
        "bus_gbps": [0.28092, nan, nan],
        "top_tensors": ["fc1.weight 39.3 ms", "", ""],
    }, index=pd.Index([0, 1, 2], name="rank"))
    table = format_summary(summary)
    assert list(table.columns) == SHOWN_COLUMNS and table.columns.name == "rank"
    # One label per rank, the figure's own; a name that does not say its rank gets it.
    assert list(table.index) == ["rank 0 (vm)", "rank 1 (vm)", "rank 2 · python"]
    assert table.loc["rank 0 (vm)"].tolist() == [
        "3,012", "356", "12", "8.9", "–", "41.5", "0.281", "11.7", "12,345", "fc1.weight 39.3 ms"]
    # A measured 0 stays 0; a share too small to show is not rounded to 0.
    assert table.loc["rank 1 (vm)"].tolist() == [
        "8.56", "0.0004", "<0.1", "6.3", "0", "0.542", "–", "–", "7", "–"]
    assert table.loc["rank 2 · python"].tolist() == [
        "0", "–", "–", "–", "–", "–", "–", "–", "1", "–"]


def test_the_shown_summary_of_real_traces_has_no_raw_floats(tmp_path: Path, horovod_new: Path) -> None:
    ours = format_summary(summarize(load_trace(hand_made_trace(tmp_path / "t.json"))))
    assert ours.loc["rank 1 (node-b)", "compute ms"] == "–"     # rank 1 packed nothing
    assert ours.loc["rank 0 (node-a)", "bus GB/s"] == "100"
    horovod = format_summary(summarize(load_trace(horovod_new)))
    assert list(horovod.index) == ["rank 0"]
    shown = horovod.loc["rank 0", ["wall ms", "busy %", "bus GB/s", "bus MB"]]
    assert shown.tolist() == ["0.345", "32", "–", "–"]                # Horovod records no sizes
    for cell in [*ours.to_numpy().ravel(), *horovod.to_numpy().ravel()]:
        assert not re.search(r"nan|\d\.\d{4,}|e[+-]\d", cell, re.I), cell


@pytest.mark.parametrize("lane, category", [
    ("negotiate", "wait"), ("scatter_reduce", "communicate"), ("broadcast", "communicate"),
    ("pack", "compute"), ("unpack", "compute"), ("shared_memory", "communicate"), ("user", "other"),
    ("ring_step", "other"), ("QUEUE", "wait"), ("queue", "wait"),
    ("NEGOTIATE_BROADCAST", "wait"), ("MPI_ALLGATHER", "communicate"), ("NCCL_BCAST", "communicate"),
    ("WAIT_FOR_DATA", "wait"), ("MEMCPY_OUT_FUSION_BUFFER", "compute"), ("BROADCAST", "other"),
])
def test_lane_categories(lane: str, category: str) -> None:
    assert lane_category(lane) == category


# The figure.

def test_figure_draws_one_bar_per_event_in_its_row_with_hover_details(tmp_path: Path) -> None:
    trace = load_trace(hand_made_trace(tmp_path / "t.json"))
    figure = build_figure(trace)
    ticktext = list(figure.layout.yaxis.ticktext)
    assert ticktext[3] == "rank 0 (node-a) · scatter_reduce"
    bars = [bar for bar in figure.data if isinstance(bar, go.Bar)]
    assert sum(len(bar.x) for bar in bars) == len(trace.events)
    # One trace per lane, its bars on every rank's row: the legend hides a lane everywhere.
    assert sorted(bar.name for bar in bars) == sorted(set(trace.events["lane"].astype(str)))
    scatter = next(bar for bar in bars if bar.name == "scatter_reduce")
    assert list(scatter.y) == [3, ticktext.index("rank 1 (node-b) · scatter_reduce")]
    assert list(scatter.base[:1]) == [pytest.approx(0.010)] and list(scatter.x[:1]) == [pytest.approx(0.030)]
    assert list(scatter.customdata[0]) == ["op", "a, b", "5.7 MiB", 0.01, "scatter_reduce on rank 0 (node-a)"]
    assert "%{customdata[1]}" in scatter.hovertemplate and "%{x:.3f} ms" in scatter.hovertemplate


def test_figure_from_a_horovod_trace_marks_instants(horovod_new: Path) -> None:
    figure = build_figure(load_trace(horovod_new))
    ticks = [trace for trace in figure.data if isinstance(trace, go.Scatter)]
    assert sorted(len(trace.x) for trace in ticks) == [2, 2]  # rank-ready ticks, cycle starts
    assert "NEGOTIATE_ALLREDUCE" in " ".join(figure.layout.yaxis.ticktext)


def synthetic_trace(path: Path, event_count: int, ranks: int = 4) -> Path:
    rng = np.random.default_rng(7)
    lanes = ("negotiate", "pack", "scatter_reduce", "allgather", "unpack")
    per_rank = event_count // ranks
    batches = {}
    for rank in range(ranks):
        durations = rng.gamma(2.0, 30.0, per_rank)
        starts = np.cumsum(durations + rng.exponential(10.0, per_rank)) - durations
        batches[rank] = [
            (lanes[i % len(lanes)], f"op {i // len(lanes)}", float(start), float(duration),
             {"bytes": 1 << 20, "tensors": ["w"], "size": ranks})
            for i, (start, duration) in enumerate(zip(starts, durations))
        ]
    return write_trace(path, batches)


def test_a_200k_event_trace_is_drawn_as_a_bounded_figure(tmp_path: Path) -> None:
    trace = load_trace(synthetic_trace(tmp_path / "big.json", 200_000))
    assert len(trace.events) == 200_000
    figure = build_figure(trace, max_shapes=20_000)
    drawn = sum(len(bar.x) for bar in figure.data)
    assert 0 < drawn <= 20_000
    assert len(figure.data) == 5  # a trace per lane
    assert len(figure.to_json()) < 3 * MB
    assert "how busy each lane was" in figure.layout.title.text


def test_zoomed_out_every_event_lies_in_a_drawn_stretch_that_counts_it(tmp_path: Path) -> None:
    trace = load_trace(synthetic_trace(tmp_path / "mid.json", 5_000, ranks=1))
    figure = build_figure(trace, max_shapes=500)
    assert "how busy" in figure.layout.title.text
    for bar in figure.data:
        assert len(set(bar.y)) == 1  # one rank: one row per lane
        row = trace.rows[int(bar.y[0])]
        at = (trace.events["rank"] == row[0]) & (trace.events["lane"] == row[1])
        origin = trace.events["start_us"].min()
        starts = (trace.events.loc[at, "start_us"].to_numpy() - origin) / 1000
        bar_start, bar_end = np.asarray(bar.base), np.asarray(bar.base) + np.asarray(bar.x)
        inside = (starts[:, None] >= bar_start - 1e-9) & (starts[:, None] <= bar_end + 1e-9)
        assert inside.any(axis=1).all()
        assert sum(bar.customdata[:, 0]) == at.sum()


def test_zoomed_out_a_lane_looks_as_busy_as_it_was(tmp_path: Path) -> None:
    """Rank 0 waits 4 % of every millisecond, rank 1 93 %: thousands of short waits each,
    which merged into solid bars would look the same."""
    batches = {rank: [("wait", f"w{i}", i * 1000.0, busy_us, None) for i in range(4_000)]
               for rank, busy_us in ((0, 40.0), (1, 930.0))}
    figure = build_figure(load_trace(write_trace(tmp_path / "t.json", batches)))
    (bars,) = figure.data
    opacity = np.asarray(bars.marker.opacity)
    for rank, busy in ((0, 0.04), (1, 0.93)):
        on_row = np.asarray(bars.y) == rank
        shares = np.asarray([float(share) for share in bars.customdata[on_row][:, 1]]) / 100.0
        assert np.median(shares) == pytest.approx(busy, abs=0.01)
        assert np.median(opacity[on_row]) == pytest.approx(0.06 + 0.94 * busy, abs=0.01)


def test_a_lane_keeps_its_colour_whatever_else_the_trace_holds(tmp_path: Path) -> None:
    one = build_figure(load_trace(write_trace(tmp_path / "a.json", {0: [("allgather", "x", 0.0, 5.0, None)]})))
    two = build_figure(load_trace(write_trace(tmp_path / "b.json", {
        0: [("negotiate", "x", 0.0, 5.0, None), ("my lane", "y", 1.0, 5.0, None),
            ("allgather", "x", 9.0, 5.0, None)]})))
    colour = {bar.name: bar.marker.color for bar in [*one.data, *two.data]}
    assert colour["allgather"] == one.data[0].marker.color == lane_color("allgather")
    assert len({colour["allgather"], colour["negotiate"], colour["my lane"]}) == 3
    assert lane_color("my lane") == colour["my lane"]


def test_the_figure_fills_the_cell_with_a_row_height_per_lane_and_the_legend_above(tmp_path: Path) -> None:
    figures = [build_figure(load_trace(synthetic_trace(tmp_path / f"{ranks}.json", 100, ranks=ranks)))
               for ranks in (1, 4)]
    for figure in figures:
        assert figure.layout.autosize is True and figure.layout.width is None
        assert figure.layout.legend.orientation == "h" and figure.layout.legend.y >= 1.0
        rows = len(figure.layout.yaxis.tickvals)
        plot_height = figure.layout.height - figure.layout.margin.t - figure.layout.margin.b
        assert plot_height / rows >= 24
    assert figures[1].layout.height > figures[0].layout.height


def test_a_window_of_a_big_trace_is_drawn_in_detail(tmp_path: Path) -> None:
    trace = load_trace(synthetic_trace(tmp_path / "big.json", 40_000))
    window = trace.between(10.0, 12.0)
    assert 0 < len(window.events) < 1_000
    figure = build_figure(window, max_shapes=20_000)
    assert sum(len(bar.x) for bar in figure.data) == len(window.events)
    assert "every event" in figure.layout.title.text
    for bar in figure.data:  # on the whole trace's time axis, overlapping the window
        assert (np.asarray(bar.base) + np.asarray(bar.x) >= 10.0).all()
        assert (np.asarray(bar.base) <= 12.0).all()


# Showing it in a notebook.

@pytest.fixture
def outside_ipython(monkeypatch: pytest.MonkeyPatch) -> None:
    """No IPython shell in this process, as in a script (one that an earlier test module of the
    same test process made may still be there)."""
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)


def test_show_timeline_takes_a_path_or_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], outside_ipython: None
) -> None:
    path = hand_made_trace(tmp_path / "t.json")
    for path_or_run in (str(path), SimpleNamespace(timeline_path=path)):
        show_timeline(path_or_run)
        printed = capsys.readouterr().out  # outside IPython: the summary, as text
        assert "rank 0 (node-a)" in printed and "busy %" in printed


def test_show_timeline_prints_who_waited_then_a_table_a_person_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], outside_ipython: None
) -> None:
    show_timeline(hand_made_trace(tmp_path / "t.json"))
    headline, header, *rows = capsys.readouterr().out.splitlines()
    assert headline == ("Waited longest: rank 1 (node-b), 0.15 ms (75% of its 0.2 ms); "
                        "shortest: rank 0 (node-a), 0.02 ms (20% of its 0.1 ms).")
    # Columns stand at least two spaces apart, so headers of two words still read apart.
    assert re.split(r"\s{2,}", header.strip()) == ["rank", *SHOWN_COLUMNS]
    assert [re.split(r"\s{2,}", row.strip()) for row in rows] == [
        ["rank 0 (node-a)", "0.1", "0.02", "20", "80", "0.025", "0.06", "100", "6", "7",
         "a 0.08 ms, b 0.06 ms"],
        ["rank 1 (node-b)", "0.2", "0.15", "75", "25", "–", "0.05", "60", "3", "2", "a 0.05 ms, b 0.05 ms"],
    ]


def test_show_timeline_of_one_rank_or_of_no_events_says_so(
    tmp_path: Path, horovod_new: Path, capsys: pytest.CaptureFixture[str], outside_ipython: None
) -> None:
    show_timeline(horovod_new)
    assert capsys.readouterr().out.splitlines()[0] == "rank 0 waited 0.21 ms (61% of its 0.345 ms)."
    empty = write_trace(tmp_path / "empty.json", {0: [], 1: []})  # gloo's run: ranks, no events
    show_timeline(empty)
    assert capsys.readouterr().out == "The timeline holds no events.\n"


def test_in_a_notebook_the_figure_comes_with_the_formatted_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import IPython
    import IPython.display

    shown: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace())
    monkeypatch.setattr(IPython.display, "display", lambda obj, **options: shown.append((obj, options)))
    show_timeline(hand_made_trace(tmp_path / "t.json"))
    (figure, _), (summary, options) = shown
    assert isinstance(figure, go.FigureWidget)  # zooming in redraws the window in detail
    assert options == {"raw": True}
    page = summary["text/html"]
    assert page.startswith("<p>Waited longest: rank 1 (node-b), 0.15 ms")
    assert "<th>rank 0 (node-a)</th>" in page and "<th>bus GB/s</th>" in page and "<td>–</td>" in page
    assert "busy_fraction" not in page and "nan" not in page.lower()
    assert summary["text/plain"].splitlines()[2].startswith("rank 0 (node-a)")

    long_name = "model.encoder.layers.11.self_attention.query_key_value.weight"
    show_timeline(write_trace(tmp_path / "long.json", {0: [
        ("pack", "op", 0.0, 1000.0, {"tensors": [long_name, long_name.replace("weight", "bias")]})]}))
    assert f"<td>{long_name} 1 ms, " in shown[-1][0]["text/html"]  # not cut at pandas' 50 characters


def test_the_figure_is_plotlys_widget_whose_views_keep_their_cells_width() -> None:
    """Plotly's own widget module, unchanged, under ``full_width_figure.js``; in JupyterLab
    the figure then fills its cell (tests/test_browser.py measures it)."""
    from ddl_magic.ui.timeline_widget import FullWidthFigureWidget

    plotly_module = str(go.FigureWidget._esm)
    assert json.dumps(plotly_module) in FullWidthFigureWidget._esm
    # What full_width_figure.js builds on: without it, figures would stay 700 px wide.
    assert all(part in plotly_module for part in ("as FigureView", "perform_render(", "autosizeFigure("))


def test_show_timeline_explains_a_run_without_a_timeline() -> None:
    with pytest.raises(ValueError, match="no timeline"):
        show_timeline(SimpleNamespace(timeline_path=None))


def test_summary_is_a_dataframe_indexed_by_rank(tmp_path: Path) -> None:
    summary = summarize(load_trace(hand_made_trace(tmp_path / "t.json")))
    assert isinstance(summary, pd.DataFrame)
    assert list(summary.index) == [0, 1]
    json.dumps(summary.reset_index().to_dict(orient="records"), default=str)
