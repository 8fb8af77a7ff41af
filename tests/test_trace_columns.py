"""The columnar copy of a run's trace holds exactly the Chrome trace's events, and survives a cut."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from ddl_magic.timeline.columns import ColumnarTraceWriter, TraceFiles, columnar_path, read_columnar_trace
from ddl_magic.timeline.analysis import summarize
from ddl_magic.timeline.load import load_trace

from trace_files import chrome_events, columnar_events, rank_names_of_chrome_trace


def odd_batches() -> dict[int, list[tuple]]:
    """Events with every kind of args the runtime and users record, and some they should not."""
    return {
        0: [
            ("pack", "fc1", 10.0, 2.5, {"bytes": 4096, "tensors": ["fc1.weight", "fc1.bias"]}),
            ("scatter_reduce", "fc1", 12.5, 7.0, {"bytes": 4096, "tensors": ["fc1.weight"], "size": 2}),
            ("shared_memory", "ddl0.allreduce.3", 20.0, 1.0, {"op": "allreduce", "size": 2, "bytes": 8}),
            ("user", "step 0", 0.0, 40.0, {"step": 0, "loss": math.nan}),  # a diverged loss
            ("my lane", "custom", 5.123456, 1.0, {"tensors": 3, "note": "a count, not names"}),
            ("wait", "handle 7", 30.0, 0.0, None),
            ("queue", "bad time", math.inf, 1.0, None),  # dropped by both files
            ("unpack", "empty list", 31.0, 1.0, {"tensors": []}),
            ("user", "one tensor", 31.5, 1.0, {"tensor": "fc2.weight"}),
            ("broadcast", "np scalar", 32.0, 1.0, {"bytes": np.int64(12), "dtype": np.dtype("float32")}),
        ],
        1: [("allgather", "grads", 11.0, 3.0, {"bytes": 1e3, "tensors": ["g"], "size": 2.0})],
    }


def write_run(path: Path, batches: dict[int, list[tuple]]) -> Path:
    with TraceFiles(path) as trace:
        for rank in batches:
            trace.add_rank(rank, f"node-{rank}")
        for rank, events in batches.items():
            trace.write(rank, events[:3])
            trace.write(rank, events[3:])
    return path


def test_the_columns_hold_exactly_the_events_of_the_chrome_trace(tmp_path: Path) -> None:
    path = write_run(tmp_path / "run.timeline.json", odd_batches())
    assert columnar_path(path).exists()
    events = columnar_events(path)
    assert events == chrome_events(path)
    assert len(events) == 10  # the event with an infinite start is in neither
    _, rank_names, truncated = read_columnar_trace(columnar_path(path))
    assert rank_names == rank_names_of_chrome_trace(path) == {0: "rank 0 (node-0)", 1: "rank 1 (node-1)"}
    assert not truncated


def test_lanes_and_tensor_names_are_stored_once_not_per_event(tmp_path: Path) -> None:
    path = tmp_path / "run.timeline.arrow"
    with ColumnarTraceWriter(path) as trace:
        for batch in range(20):
            trace.write(0, [("allgather", f"op {i}", float(i), 1.0, {"tensors": ["layer.weight"] * 3})
                            for i in range(batch * 1000, (batch + 1) * 1000)])
    table, _, _ = read_columnar_trace(path)
    assert table.num_rows == 20_000
    # Per event: rank, lane code, name, two times, bytes, size, op code, three tensor codes.
    assert path.stat().st_size < 20_000 * 80


def test_a_file_cut_mid_batch_reads_up_to_its_last_whole_batch(tmp_path: Path) -> None:
    path = tmp_path / "run.timeline.arrow"
    with ColumnarTraceWriter(path) as trace:
        trace.add_rank(0, "node-a")
        for batch in range(3):
            trace.write(0, [("pack", f"op {batch}.{i}", float(i), 1.0, None) for i in range(100)])
    whole = path.read_bytes()
    for cut, whole_batches in ((len(whole) - 10, 2), (len(whole) // 2, None)):
        path.write_bytes(whole[:cut])
        table, rank_names, truncated = read_columnar_trace(path)
        assert truncated
        if whole_batches is not None:
            assert table.num_rows == 100 * whole_batches
        assert table.num_rows < 300
        assert table.column("name").to_pylist() == [
            f"op {batch}.{i}" for batch in range(table.num_rows // 100) for i in range(100)]
        if table.num_rows:
            assert rank_names == {0: "rank 0 (node-a)"}


def test_a_file_holding_less_than_its_schema_is_an_empty_cut_trace(tmp_path: Path) -> None:
    path = tmp_path / "run.timeline.arrow"
    path.write_bytes(b"\xff\xff")
    table, rank_names, truncated = read_columnar_trace(path)
    assert (table.num_rows, rank_names, truncated) == (0, {}, True)


def test_a_rank_named_after_the_last_batch_is_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.timeline.arrow"
    with ColumnarTraceWriter(path) as trace:
        trace.write(0, [("pack", "a", 0.0, 1.0, None)])
        trace.add_rank(0, "late-host")
    assert read_columnar_trace(path)[1] == {0: "rank 0 (late-host)"}


def test_the_viewer_reads_the_columns_and_summarises_them_as_the_json(tmp_path: Path) -> None:
    path = write_run(tmp_path / "run.timeline.json", odd_batches())
    from_columns = load_trace(path)
    assert load_trace(columnar_path(path)).events.shape == from_columns.events.shape
    columnar_path(path).unlink()
    from_json = load_trace(path)
    assert from_columns.rows == from_json.rows
    assert from_columns.rank_names == from_json.rank_names
    pytest.importorskip("pandas").testing.assert_frame_equal(
        summarize(from_columns), summarize(from_json), check_dtype=False)


def test_a_json_trace_newer_than_its_columns_is_read_from_the_json(tmp_path: Path) -> None:
    path = write_run(tmp_path / "run.timeline.json", odd_batches())
    assert load_trace(path).events["rank"].tolist().count(1) == 1
    # Another program (Horovod, with HOROVOD_TIMELINE) writes the same path later.
    path.write_text('[{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "w"}},'
                    '{"ph": "X", "name": "NCCL_ALLREDUCE", "ts": 5, "dur": 2, "pid": 1}]')
    os.utime(path, ns=(columnar_path(path).stat().st_mtime_ns + 1,) * 2)
    trace = load_trace(path)
    assert trace.source == "horovod" and trace.events["lane"].tolist() == ["NCCL_ALLREDUCE"]


def test_a_closed_writer_says_so(tmp_path: Path) -> None:
    trace = ColumnarTraceWriter(tmp_path / "t.arrow")
    trace.close()
    trace.close()  # a second close does nothing
    with pytest.raises(ValueError, match="closed"):
        trace.write(0, [("pack", "a", 0.0, 1.0, None)])
