"""The driver's trace file: valid JSON at every moment, one row per (rank, lane), stable order."""

from __future__ import annotations

import json
import math
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ddl_magic.timeline.chrome import TraceWriter
from ddl_magic.timeline.lanes import LANE_ORDER


def read_trace(path: Path) -> dict[str, Any]:
    """Parse as strictly as a browser's JSON.parse would (no NaN, no Infinity)."""
    def reject(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(path.read_text(), parse_constant=reject)


def complete_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def metadata(trace: dict[str, Any], kind: str) -> dict[tuple[int, int], Any]:
    return {(e["pid"], e["tid"]): e["args"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == kind}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "run.timeline.json"


def test_the_file_is_complete_before_anything_is_written(path: Path) -> None:
    with TraceWriter(path) as trace:
        assert read_trace(path)["traceEvents"] == []
        assert trace.path == path
        assert trace.event_count == 0


def test_the_file_is_valid_json_after_every_call(path: Path) -> None:
    with TraceWriter(path) as trace:
        for rank in range(3):
            trace.add_rank(rank, f"node-{rank}")
            read_trace(path)
        for step in range(5):
            for rank in range(3):
                trace.write(rank, [("pack", f"step {step}", step * 100.0, 10.0, {"bytes": 8}),
                                   ("scatter_reduce", f"step {step}", step * 100.0 + 10, 30.0, None)])
                assert len(complete_events(read_trace(path))) == trace.event_count
    assert len(complete_events(read_trace(path))) == 30


def test_every_rank_is_named_and_sorted(path: Path) -> None:
    with TraceWriter(path) as trace:
        for rank in (1, 0, 2):
            trace.add_rank(rank, f"host{rank}")
    written = read_trace(path)
    names = metadata(written, "process_name")
    assert {pid: args["name"] for (pid, _), args in names.items()} == {
        0: "rank 0 (host0)", 1: "rank 1 (host1)", 2: "rank 2 (host2)"}
    sort_index = metadata(written, "process_sort_index")
    assert {pid: args["sort_index"] for (pid, _), args in sort_index.items()} == {0: 0, 1: 1, 2: 2}


def test_each_rank_and_lane_gets_its_thread_name_once(path: Path) -> None:
    with TraceWriter(path) as trace:
        for _ in range(3):
            trace.write(0, [("allgather", "a", 0.0, 1.0, None), ("pack", "a", 1.0, 1.0, None)])
            trace.write(1, [("allgather", "a", 0.0, 1.0, None)])
    written = read_trace(path)
    thread_names = [e for e in written["traceEvents"] if e["name"] == "thread_name"]
    assert sorted((e["pid"], e["args"]["name"]) for e in thread_names) == [
        (0, "allgather"), (0, "pack"), (1, "allgather")]
    for event in complete_events(written):
        assert metadata(written, "thread_name")[(event["pid"], event["tid"])]["name"] == event["cat"]


def test_events_are_well_formed_complete_events(path: Path) -> None:
    with TraceWriter(path) as trace:
        trace.write(2, [("scatter_reduce", "allreduce.fc1", 1234.5678, 12.25,
                         {"bytes": 4096, "tensors": ["fc1.weight"], "size": 4}),
                        ("queue", "fc2", 1.0, 0.0, None)])
    [first, second] = complete_events(read_trace(path))
    assert first == {"ph": "X", "pid": 2, "tid": first["tid"], "name": "allreduce.fc1",
                     "cat": "scatter_reduce", "ts": 1234.568, "dur": 12.25,
                     "args": {"bytes": 4096, "tensors": ["fc1.weight"], "size": 4}}
    for event in (first, second):
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert event["dur"] >= 0
        assert isinstance(event["args"], dict)


def test_lanes_take_their_fixed_rows_whatever_order_they_arrive_in(path: Path) -> None:
    with TraceWriter(path) as trace:
        trace.write(0, [("my lane", "x", 0.0, 1.0, None), ("unpack", "x", 0.0, 1.0, None),
                        ("negotiate", "x", 0.0, 1.0, None)])
        trace.write(1, [("negotiate", "x", 0.0, 1.0, None), ("another", "x", 0.0, 1.0, None),
                        ("my lane", "x", 0.0, 1.0, None)])
    tids = {(e["pid"], e["cat"]): e["tid"] for e in complete_events(read_trace(path))}
    assert tids[(0, "negotiate")] == tids[(1, "negotiate")] == LANE_ORDER.index("negotiate") + 1
    assert tids[(0, "negotiate")] < tids[(0, "unpack")] < tids[(0, "my lane")]
    assert tids[(0, "my lane")] == tids[(1, "my lane")] < tids[(1, "another")]
    sort_index = metadata(read_trace(path), "thread_sort_index")
    assert all(args["sort_index"] == tid for (_, tid), args in sort_index.items())


def test_events_written_in_order_stay_in_order_within_each_lane(path: Path) -> None:
    rng = np.random.default_rng(1)
    with TraceWriter(path) as trace:
        clock = {rank: 0.0 for rank in range(2)}
        for _ in range(20):
            for rank in range(2):
                batch = []
                for lane in ("pack", "scatter_reduce", "allgather"):
                    duration = float(rng.uniform(0, 50))
                    batch.append((lane, "op", clock[rank], duration, None))
                    clock[rank] += duration
                trace.write(rank, batch)
    by_lane: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in complete_events(read_trace(path)):
        by_lane.setdefault((event["pid"], event["tid"]), []).append(event)
    assert len(by_lane) == 6
    for events in by_lane.values():
        for earlier, later in zip(events, events[1:]):
            assert earlier["ts"] + earlier["dur"] <= later["ts"] + 1e-3


def test_awkward_arguments_never_break_the_json(path: Path) -> None:
    with TraceWriter(path) as trace:
        trace.write(0, [("user", "step", 0.0, 1.0, {"loss": math.nan, "count": np.int64(3)}),
                        ("user", "step", 1.0, 1.0, {"dtype": np.dtype("float32")}),
                        ("user", "dropped", math.inf, 1.0, None)])
        assert trace.event_count == 2
    events = complete_events(read_trace(path))
    assert [e["args"] for e in events] == [{"loss": "nan", "count": 3}, {"dtype": "float32"}]


def test_an_empty_batch_changes_nothing(path: Path) -> None:
    with TraceWriter(path) as trace:
        trace.write(0, [("pack", "a", 0.0, 1.0, None)])
        before = path.read_bytes()
        trace.write(0, [])
        assert path.read_bytes() == before


def test_closing_twice_is_fine_and_writing_after_close_is_an_error(path: Path) -> None:
    trace = TraceWriter(path)
    trace.close()
    trace.close()
    with pytest.raises(ValueError, match="closed"):
        trace.write(0, [("pack", "a", 0.0, 1.0, None)])


def test_starting_again_replaces_an_old_trace(path: Path) -> None:
    path.write_text("[\n{\"ph\": \"B\"")  # a Horovod-style leftover, cut short
    with TraceWriter(path):
        pass
    assert read_trace(path)["traceEvents"] == []


WRITE_FOREVER = textwrap.dedent("""
    import sys
    from ddl_magic.timeline.chrome import TraceWriter

    trace = TraceWriter(sys.argv[1])
    for rank in range(4):
        trace.add_rank(rank, "node")
    batch = 0
    while True:
        for rank in range(4):
            trace.write(rank, [("scatter_reduce", f"op {batch}", batch * 10.0, 5.0,
                                {"bytes": 1024, "tensors": ["w"], "size": 4})] * 8)
        batch += 1
        print(batch, flush=True)
""")


def test_the_file_stays_valid_when_the_writing_process_is_killed(path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITE_FOREVER, str(path)],
                              stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in writer.stdout], daemon=True).start()
    try:
        # Let it get well into writing, then kill it wherever it happens to be.
        for _ in range(50):
            lines.get(timeout=60)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    written = read_trace(path)
    assert len(complete_events(written)) >= 50 * 4 * 8
    assert len(metadata(written, "process_name")) == 4
