"""The rank-side recorder: free while off, one append while on, drained onto the driver's clock."""

from __future__ import annotations

import threading
import time

import pytest

from ddl_magic.runtime.timeline import TimelineRecorder, recorder


@pytest.fixture
def recording() -> TimelineRecorder:
    rec = TimelineRecorder()
    rec.enabled = True
    return rec


def test_the_process_wide_recorder_starts_switched_off() -> None:
    assert isinstance(recorder, TimelineRecorder)
    assert recorder.enabled is False


def test_records_nothing_while_off() -> None:
    rec = TimelineRecorder()
    rec.record("pack", "fc1.weight", 0, 100, {"bytes": 4})
    with rec.span("user", "step"):
        pass
    assert rec.drain() == []


def test_recording_calls_while_off_are_cheap_and_allocate_nothing() -> None:
    rec = TimelineRecorder()
    # The runtime calls these on its hot path; a generous bound, far above the ~50 ns a call
    # takes, so that only doing real work while off would fail it.
    started = time.perf_counter()
    for _ in range(200_000):
        rec.record("queue", "t", 0, 1)
    assert time.perf_counter() - started < 2.0
    assert rec.span("user", "a") is rec.span("wait", "b", step=1)
    assert rec.drain() == []


def test_records_one_event_per_call_while_on(recording: TimelineRecorder) -> None:
    recording.record("scatter_reduce", "allreduce.fc1", 1_000, 4_000,
                     {"bytes": 64, "tensors": ["fc1.weight"], "size": 4})
    recording.record("allgather", "allreduce.fc1", 4_000, 6_000)
    assert recording.drain() == [
        ("scatter_reduce", "allreduce.fc1", 1.0, 3.0, {"bytes": 64, "tensors": ["fc1.weight"], "size": 4}),
        ("allgather", "allreduce.fc1", 4.0, 2.0, None),
    ]


def test_drain_moves_events_onto_the_driver_clock_in_microseconds(recording: TimelineRecorder) -> None:
    recording.clock_offset_ns = 5_000_000_000 - 2_000  # driver_clock - local clock
    recording.record("pack", "grads", 2_000, 2_500)
    [(lane, name, start_us, duration_us, args)] = recording.drain()
    assert (lane, name, args) == ("pack", "grads", None)
    assert start_us == pytest.approx(5_000_000.0)
    assert duration_us == pytest.approx(0.5)


def test_drain_empties_the_buffer(recording: TimelineRecorder) -> None:
    recording.record("wait", "handle 3", 0, 10)
    assert len(recording.drain()) == 1
    assert recording.drain() == []


def test_an_event_that_ends_before_it_starts_gets_zero_duration(recording: TimelineRecorder) -> None:
    recording.record("queue", "t", 500, 400)
    assert recording.drain()[0][3] == 0.0


def test_span_records_its_body_with_keyword_args(recording: TimelineRecorder) -> None:
    before = time.monotonic_ns()
    with recording.span("user", "epoch 1", epoch=1):
        pass
    after = time.monotonic_ns()
    [(lane, name, start_us, duration_us, args)] = recording.drain()
    assert (lane, name, args) == ("user", "epoch 1", {"epoch": 1})
    assert before / 1000 <= start_us <= start_us + duration_us <= after / 1000


def test_span_records_even_when_its_body_raises(recording: TimelineRecorder) -> None:
    with pytest.raises(ZeroDivisionError), recording.span("user", "bad step"):
        raise ZeroDivisionError
    assert [event[1] for event in recording.drain()] == ["bad step"]


def test_drain_while_other_threads_record_loses_no_event(recording: TimelineRecorder) -> None:
    threads, per_thread = 4, 20_000
    drained: list[tuple] = []

    def record_many(lane: str) -> None:
        for i in range(per_thread):
            recording.record(lane, str(i), i, i + 1)

    workers = [threading.Thread(target=record_many, args=(f"lane{t}",)) for t in range(threads)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 30
    while any(worker.is_alive() for worker in workers) and time.monotonic() < deadline:
        drained.extend(recording.drain())
    for worker in workers:
        worker.join(timeout=30)
        assert not worker.is_alive()
    drained.extend(recording.drain())

    assert len(drained) == threads * per_thread
    for t in range(threads):
        names = [name for lane, name, *_ in drained if lane == f"lane{t}"]
        assert names == [str(i) for i in range(per_thread)]
