"""A pool's two sides of one connection per rank: its control server (`PoolServer`: cells
stopped instead of ranks, requests and their answers) and one cell's view of the pool's
events (`CellEvents`: a rank's cell ends after the last line of its output).
"""

from __future__ import annotations

import collections
import itertools
import queue
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import cloudpickle

from .attribution import FAILURE_SETTLE_S, LAST_WORDS_TIMEOUT_S, describe_exit
from .control import ControlServer
from .events import FailureKind, ProcessExited, RankFailed, RankFinished, RankOutput
from ..wire.channel import ABORTED_EXIT_CODE, Channel
from ..wire.messages import (CELL_END_MARK, CancelCell, CellEnded, Failed, Finished, ProbeReply,
                             Pull, Pulled)

# How long a cell's end waits for the marks that close each rank's output.
OUTPUT_MARKS_TIMEOUT_S = 2.0
# The failures that lose a rank for good: the pool is broken.
LOST = (FailureKind.VANISHED, FailureKind.UNREACHABLE, FailureKind.DIED)


class PoolError(RuntimeError):
    """The pool cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class CellEndedOn:
    """A pool rank said a cell ended (`CellEnded`)."""

    rank: int
    message: CellEnded



class PoolServer(ControlServer):
    """The control server of a pool: what ranks say about cells, pulls and probes, and
    `abort` stops the running cell instead of the ranks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cell: tuple[int, list[int]] | None = None
        self._ids = itertools.count()
        self._answers: dict[int, queue.Queue] = {}
        self.pulled_bytes = 0
        """How many pickled bytes the last `pull` brought, for the line that confirms it."""

    def begin_cell(self, epoch: int, ranks: list[int]) -> None:
        self._cell = (epoch, ranks)

    def end_cell(self) -> None:
        self._cell = None

    def abort(self, reason: str) -> None:
        """Stop the running cell on its ranks, once (the ranks stay)."""
        cell, self._cell = self._cell, None
        if cell is not None:
            epoch, ranks = cell
            for rank in ranks:
                self.send(rank, CancelCell(epoch, reason))

    def stop_ranks(self, reason: str) -> None:
        """Every rank exits now."""
        self._cell = None
        super().abort(reason)

    def ask(self, ranks: list[int], request, timeout_s: float) -> dict:
        """Send `request(id)` to each rank and wait for their answers (what came in time)."""
        answers: queue.Queue = queue.Queue()
        ids = {}
        for rank in ranks:
            request_id = next(self._ids)
            self._answers[request_id] = answers
            ids[request_id] = rank
            self.send(rank, request(request_id))
        replies = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(replies) < len(ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    reply = answers.get(timeout=left)
                except queue.Empty:
                    break
                replies[ids[reply.id]] = reply
        finally:
            for request_id in ids:
                self._answers.pop(request_id, None)
        return replies

    def pull(self, ranks: list[int], name: str, timeout_s: float) -> list[Any]:
        """The value of `name` on each of `ranks`: KeyError where a rank has no such name,
        PoolError where one cannot send it or does not answer in time."""
        replies = self.ask(ranks, lambda request_id: Pull(request_id, name), timeout_s)
        values = []
        self.pulled_bytes = 0
        for rank in ranks:
            reply = replies.get(rank)
            if reply is None:
                raise PoolError(f"rank {rank} did not answer within {timeout_s:.0f} s")
            if reply.error:
                raise KeyError(reply.error) if reply.missing else PoolError(reply.error)
            values.append(cloudpickle.loads(reply.value))
            self.pulled_bytes += len(reply.value)
        return values

    def _relay_other(self, rank: int, message: object) -> bool:
        match message:
            case CellEnded():
                self.events.put(CellEndedOn(rank, message))
            case Pulled(request_id) | ProbeReply(request_id):
                answers = self._answers.get(request_id)
                if answers is not None:
                    answers.put(message)
            case _:
                return False
        return True

    def _connection_ended(self, rank: int, timed_out: bool, channel: Channel) -> None:
        self._finished.discard(rank)  # a pool's rank never finishes: its end is a loss
        super()._connection_ended(rank, timed_out, channel)


class CellsPool(Protocol):
    """What one cell's events need of their pool's ranks (`pool_ranks.PoolRanks`)."""

    hosts: list[str]
    events: queue.Queue  # the pool's, which the cell reads while it runs

    def note_cell_ended(self, rank: int, message: CellEnded) -> None: ...

    def note_lost(self, rank: int, how: str, exited: bool = False) -> None: ...


class CellEvents:
    """The pool's event queue as one cell's watcher sees it (`get`, `get_nowait`).

    A rank's `CellEnded` for this cell becomes `RankFinished` or `RankFailed` once the marks
    that close its output on both streams came (or `OUTPUT_MARKS_TIMEOUT_S` passed), so the
    cell's last lines are its own; a `CellEnded` for another cell is taken in and dropped. A
    lost rank's failure waits for its process's exit status (its last words come first);
    ranks lost together (a host's executor killed: no exit status comes for any) are let go
    together, so that the watcher, which settles on the first, names them all.
    """

    def __init__(self, pool: CellsPool, epoch: int, ranks: list[int]):
        self._pool = pool
        self._source = pool.events
        self.epoch = epoch
        self.ended: dict[int, CellEnded] = {}
        self._marks: dict[int, set[str]] = {rank: set() for rank in ranks}
        self._held: dict[int, tuple[object, float]] = {}  # rank -> (event, release by)
        self._ready: collections.deque = collections.deque()
        self._exited: set[int] = set()

    def get_nowait(self):
        return self.get(timeout=0)

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._release_due()
            if self._ready:
                return self._ready.popleft()
            now = time.monotonic()
            waits = [release_by - now for _, release_by in self._held.values()]
            if deadline is not None:
                waits.append(deadline - now)
            wait = max(0.0, min(waits)) if waits else None
            try:
                self._take(self._source.get(timeout=wait) if wait != 0 else self._source.get_nowait())
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline and not self._due():
                    raise

    def _due(self) -> bool:
        now = time.monotonic()
        return any(release_by <= now for _, release_by in self._held.values())

    def _release_due(self) -> None:
        now = time.monotonic()
        lost_due = [release_by for event, release_by in self._held.values()
                    if isinstance(event, RankFailed) and release_by <= now]
        with_them = max(lost_due) + FAILURE_SETTLE_S if lost_due else now
        for rank, (event, release_by) in list(self._held.items()):
            if (release_by <= now or (isinstance(event, RankFailed) and release_by <= with_them)
                    or (isinstance(event, CellEnded) and len(self._marks[rank]) == 2)):
                del self._held[rank]
                self._release(rank, event)

    def _release(self, rank: int, event) -> None:
        if not isinstance(event, CellEnded):
            self._ready.append(event)
            return
        self.ended[rank] = event
        match event.outcome:
            case Finished(result):
                self._ready.append(RankFinished(rank, result))
            case Failed(kind, text, reason, exit_code, at_ns, lost_rank):
                if exit_code == ABORTED_EXIT_CODE and text.strip():
                    # stopped: the one line saying how its code ended (the error that ended
                    # its collective names the failing rank)
                    last = text.strip().splitlines()[-1]
                    self._ready.append(RankOutput(rank, "stderr", f"stopped: {in_words(last)}"))
                self._ready.append(RankFailed(rank, self._pool.hosts[rank], kind, text, reason,
                                              exit_code, at_ns, lost_rank))

    def _take(self, event) -> None:
        match event:
            case RankOutput(rank, stream, text, replace) if CELL_END_MARK in text:
                before, _, epoch = text.partition(CELL_END_MARK)
                if before:
                    self._ready.append(RankOutput(rank, stream, before, replace))
                if epoch == str(self.epoch) and rank in self._marks:
                    self._marks[rank].add(stream)
            case CellEndedOn(rank, message):
                self._pool.note_cell_ended(rank, message)
                if message.epoch == self.epoch and rank in self._marks and rank not in self.ended:
                    self._held[rank] = (message, time.monotonic() + OUTPUT_MARKS_TIMEOUT_S)
            case RankFailed(rank, _, kind, _, reason) if kind in LOST:
                self._pool.note_lost(rank, reason)
                if rank in self._exited:  # its process's exit came first
                    self._ready.append(event)
                else:
                    self._held[rank] = (event, time.monotonic() + LAST_WORDS_TIMEOUT_S)
            case ProcessExited(rank, returncode):
                self._pool.note_lost(rank, event.out_of_memory or describe_exit(returncode),
                                     exited=True)
                self._ready.append(event)
                self._exited.add(rank)
                held = self._held.pop(rank, None)
                if held is not None:
                    self._release(rank, held[0])
            case _:
                self._ready.append(event)


_STOPPED_BY_US = re.compile(r"^(?:[\w.]*\.)?(?:CollectiveAbortedError|KeyboardInterrupt): "
                            r"(?:the cell was stopped: )?")


def in_words(last_line: str) -> str:
    """How a stopped rank's code ended, without the exception that the stop itself raised.

    >>> in_words("ddl_magic.runtime.errors.CollectiveAbortedError: the cell was stopped: the cell was interrupted")
    'the cell was interrupted'
    >>> in_words("RuntimeError: rank 0 failed")
    'RuntimeError: rank 0 failed'
    """
    return _STOPPED_BY_US.sub("", last_line)
