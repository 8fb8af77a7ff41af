"""How one pool cell's watcher sees the pool's event queue (`driver/pool_server.CellEvents`), without
processes: a rank's end of the cell comes after its last line, a late word about another cell
is dropped, and a lost rank's failure waits for its exit status."""

import queue
import time

import pytest

from ddl_magic.driver import pool_server
from ddl_magic.driver.events import FailureKind, ProcessExited, RankFailed, RankFinished, RankOutput
from ddl_magic.driver.pool_server import CellEndedOn, CellEvents
from ddl_magic.wire.channel import ABORTED_EXIT_CODE
from ddl_magic.wire.messages import CELL_END_MARK, CellEnded, Failed, Finished


class _Pool:
    """What `CellEvents` reads and tells of its pool's ranks."""

    def __init__(self):
        self.events = queue.Queue()
        self.hosts = ["a", "b"]
        self.ended, self.lost = [], {}

    def note_cell_ended(self, rank, message):
        self.ended.append((rank, message.epoch))

    def note_lost(self, rank, how, exited=False):
        if exited or rank not in self.lost:
            self.lost[rank] = how


def _drain(events):
    got = []
    while True:
        try:
            got.append(events.get(timeout=0))
        except queue.Empty:
            return got


def _marks(rank, epoch):
    return [RankOutput(rank, stream, f"{CELL_END_MARK}{epoch}") for stream in ("stdout", "stderr")]


def test_a_ranks_end_of_the_cell_comes_after_its_last_lines():
    pool = _Pool()
    events = CellEvents(pool, epoch=3, ranks=[0])
    pool.events.put(CellEndedOn(0, CellEnded(3, Finished(b"x"), True)))
    pool.events.put(RankOutput(0, "stdout", "last line"))
    assert [type(e) for e in _drain(events)] == [RankOutput]  # the end waits for the marks
    for mark in _marks(0, 3):
        pool.events.put(mark)
    assert _drain(events) == [RankFinished(0, b"x")]
    assert 0 in events.ended and pool.ended == [(0, 3)]


def test_a_line_the_mark_ended_without_a_newline_is_still_shown():
    pool = _Pool()
    events = CellEvents(pool, epoch=1, ranks=[0])
    pool.events.put(RankOutput(0, "stdout", f"progress 99%{CELL_END_MARK}1"))
    assert _drain(events) == [RankOutput(0, "stdout", "progress 99%")]


def test_what_a_rank_says_about_another_cell_is_taken_in_and_dropped():
    pool = _Pool()
    events = CellEvents(pool, epoch=5, ranks=[0, 1])
    pool.events.put(CellEndedOn(1, CellEnded(4, Finished(None), False)))
    for mark in _marks(1, 4):
        pool.events.put(mark)
    assert _drain(events) == [] and not events.ended
    assert pool.ended == [(1, 4)]  # the pool still learns that its ring was left unusable


def test_a_cell_end_whose_marks_never_come_is_released_after_a_while(monkeypatch):
    monkeypatch.setattr(pool_server, "OUTPUT_MARKS_TIMEOUT_S", 0.05)
    pool = _Pool()
    events = CellEvents(pool, epoch=2, ranks=[0])
    pool.events.put(CellEndedOn(0, CellEnded(2, Finished(None), True)))
    assert events.get(timeout=5) == RankFinished(0, None)


def test_a_stopped_rank_says_in_one_line_how_its_code_ended():
    pool = _Pool()
    events = CellEvents(pool, epoch=1, ranks=[1])
    traceback = ("Traceback (most recent call last):\n  ...\n"
                 "CollectiveAbortedError: the cell was stopped: rank 0 failed\n")
    stopped = Failed(FailureKind.RAISED, traceback, "stopped: rank 0 failed", ABORTED_EXIT_CODE, 7)
    pool.events.put(CellEndedOn(1, CellEnded(1, stopped, False)))
    for mark in _marks(1, 1):
        pool.events.put(mark)
    line, failed = _drain(events)
    assert line == RankOutput(1, "stderr", "stopped: rank 0 failed")  # in words, once
    assert failed.rank == 1 and failed.exit_code == ABORTED_EXIT_CODE and failed.host == "b"


@pytest.mark.parametrize("exit_first", [False, True])
def test_a_lost_ranks_failure_follows_its_exit_status(exit_first):
    pool = _Pool()
    events = CellEvents(pool, epoch=1, ranks=[0, 1])
    lost = RankFailed(1, "b", FailureKind.VANISHED, "", "connection lost")
    exited = ProcessExited(1, -9)
    for event in ([exited, lost] if exit_first else [lost, exited]):
        pool.events.put(event)
    assert _drain(events) == [exited, lost]
    assert "SIGKILL" in pool.lost[1]  # how it ended, not how its connection did


def test_ranks_lost_together_with_no_exit_status_are_let_go_together(monkeypatch):
    """A host's executor killed: neither rank's exit status ever comes. Once the first one's
    wait is over, the other lost a moment later goes with it, and the watcher names both."""
    monkeypatch.setattr(pool_server, "LAST_WORDS_TIMEOUT_S", 0.2)
    pool = _Pool()
    events = CellEvents(pool, epoch=1, ranks=[0, 1])
    first = RankFailed(0, "b", FailureKind.VANISHED, "", "connection lost")
    second = RankFailed(1, "b", FailureKind.VANISHED, "", "connection lost")
    pool.events.put(first)
    assert _drain(events) == []
    time.sleep(0.1)
    pool.events.put(second)
    assert _drain(events) == []  # both wait for an exit status
    assert events.get(timeout=1) == first
    assert _drain(events) == [second]  # at once, not 0.1 s later
