"""JSON traces read a chunk at a time give exactly what parsing the whole file gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddl_magic.timeline.chrome import TraceWriter
from ddl_magic.timeline.json_reader import JsonTraceEvents


def our_trace(path: Path) -> Path:
    with TraceWriter(path) as trace:
        trace.add_rank(0, "nœud-α")  # names that take several bytes in UTF-8, split by chunks
        trace.write(0, [("pack", f"λ{i}", float(i), 1.0, {"tensors": ["poids·é"], "bytes": i})
                        for i in range(300)])
    return path


def read(path: Path, chunk_bytes: int) -> tuple[list[dict], JsonTraceEvents]:
    events = JsonTraceEvents(path, chunk_bytes=chunk_bytes)
    return [event for batch in events for event in batch], events


@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096, 1 << 24])
def test_chunks_of_any_size_give_the_events_of_the_whole_file(tmp_path: Path, chunk_bytes: int) -> None:
    path = our_trace(tmp_path / "t.json")
    events, reader = read(path, chunk_bytes)
    assert events == json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    assert (reader.kind, reader.truncated) == ("object", False)


def test_a_bare_array_without_its_closing_bracket_is_read_and_marked_cut(tmp_path: Path) -> None:
    path = tmp_path / "horovod.json"
    lines = [json.dumps({"ph": "B", "name": "QUEUE", "ts": i, "pid": 1}) for i in range(50)]
    path.write_text("[\n" + ",\n".join(lines) + ",\n")  # horovod < 0.21: a comma after every event
    events, reader = read(path, 64)
    assert [e["ts"] for e in events] == list(range(50))
    assert (reader.kind, reader.truncated) == ("array", True)


def test_half_an_event_at_the_end_is_left_out(tmp_path: Path) -> None:
    text = our_trace(tmp_path / "t.json").read_text(encoding="utf-8")
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex("299") + 2], encoding="utf-8")  # inside the last event
    events, reader = read(cut, 100)
    assert [e["name"] for e in events if e["ph"] == "X"] == [f"λ{i}" for i in range(299)]
    assert reader.truncated


def test_an_object_with_other_keys_around_its_events(tmp_path: Path) -> None:
    path = tmp_path / "chrome.json"
    path.write_text(json.dumps({"otherData": {"note": "traceEvents"}, "traceEvents": [
        {"ph": "X", "name": "a", "ts": 1, "dur": 2}], "stackFrames": {}}))
    events, reader = read(path, 5)
    assert events == [{"ph": "X", "name": "a", "ts": 1, "dur": 2}] and not reader.truncated


@pytest.mark.parametrize("text, message", [
    ("hello", "neither a JSON array of events nor a Chrome trace"),
    ('"a string"', "its JSON is a str"),
    ('{"no": "events", "oops"', "neither a JSON array of events nor a Chrome trace"),
])
def test_a_file_that_is_no_trace_says_so(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "notes.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read(path, 4)


def test_an_object_without_events_is_an_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text('{"displayTimeUnit": "ms"}')
    events, reader = read(path, 4)
    assert events == [] and (reader.kind, reader.truncated) == ("object", False)


def test_events_spread_over_several_lines_are_read_one_by_one(tmp_path: Path) -> None:
    document = json.loads(our_trace(tmp_path / "t.json").read_text(encoding="utf-8"))
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(document, indent=2))  # "tensors": [ ... ] on lines of their own
    events, reader = read(pretty, 512)
    assert events == document["traceEvents"] and not reader.truncated


def test_a_trace_on_one_line_is_read_in_batches_with_lists_of_objects_inside_events(
        tmp_path: Path) -> None:
    # Another tool's layout: the whole trace on one line. Some events hold a list of
    # objects ("}, {" inside an event), where a batch cut there cannot parse: that stretch
    # is decoded event by event, and nothing is lost or made up.
    events = [{"ph": "X", "name": f"op{i}", "pid": i % 3, "tid": 1, "ts": i, "dur": 1,
               "args": {"inputs": [{"shape": [i]}, {"shape": [2]}]} if i % 3 == 0 else {}}
              for i in range(2000)]
    path = tmp_path / "one_line.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    for chunk_bytes in (1000, 1 << 24):
        read_events, reader = read(path, chunk_bytes)
        assert read_events == events and not reader.truncated


def test_without_orjson_the_standard_library_parses_the_batches(tmp_path: Path, monkeypatch) -> None:
    from ddl_magic.timeline import json_reader

    monkeypatch.setattr(json_reader, "_orjson_loads", json.loads)
    monkeypatch.setattr(json_reader, "_OrjsonError", json.JSONDecodeError)
    path = our_trace(tmp_path / "t.json")
    events, reader = read(path, 4096)
    assert events == json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
