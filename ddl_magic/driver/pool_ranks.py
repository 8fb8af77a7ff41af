"""What the driver knows of a pool's ranks outside its cells, taken in from the pool's
events by one `PoolRanks.take`: where each rank runs (host, pid), whether it is alive
(`wire/liveness.py`), which were lost and how, what each said last and how it ended its
last cell. Inside a cell its watcher reads the events (`pool_server.CellEvents`, which tells
this record of the losses and cell ends it sees).

The pool's waits outside cells are the driver's one watch loop (`watch_loop.py`) over these
events: the ranks forming a ring (`await_ring`), replacements registering
(`await_registered`); and between cells, what came meanwhile is taken in at once (`absorb`).
"""

from __future__ import annotations

import collections
import queue
import time
from dataclasses import dataclass
from typing import Callable

from .attribution import describe_exit
from .events import ProcessExited, RankFailed, RankOutput, RankProcessState, RankStarted, describe_ranks
from .pool_server import LOST, CellEndedOn, PoolError
from .watch_loop import KEEP_WATCHING, Decision, EventSource, Failed, Finished, watch
from ..wire.channel import peer_timeout_s
from ..wire.liveness import LivenessWatch, ProcessState
from ..wire.messages import CELL_END_MARK, CellEnded, Failed as CellFailed

LAST_WORDS_KEPT = 20  # lines of a rank's output quoted when it fails outside a cell


@dataclass
class _Wait:
    """One wait of the pool's, as the watch loop sees it."""

    events: EventSource
    take: Callable[[object], None]
    decide: Callable[[float], Decision]


class PoolRanks:
    """The pool's ranks as the driver knows them between cells (the module doc)."""

    def __init__(self, np: int, events: queue.Queue, log: Callable[[int, str], None],
                 cell_ended: Callable[[int, CellEnded], None]):
        """`log(rank, line)` keeps a line a rank wrote outside a cell; `cell_ended` hears
        every rank's word that a cell (or a ring forming) ended."""
        self.np = np
        self.events = events
        self.hosts: list[str] = [""] * np
        self.pids: list[int | None] = [None] * np
        self.gone: dict[int, str] = {}  # rank -> how it was lost
        self.liveness = LivenessWatch(peer_timeout_s())
        self.replacing: set[int] = set()  # lost ranks whose replacement has not registered yet
        self._log = log
        self._cell_ended = cell_ended
        self._said: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=LAST_WORDS_KEPT))
        self._ended: dict[int, str] = {}  # rank -> how its process ended, outside a cell
        self._failed: dict[int, str] = {}  # rank -> why it failed, outside a cell
        self._last_ended: dict[int, CellEnded] = {}  # rank -> its last word that a cell (or ring) ended

    def take(self, event: object) -> None:
        """Take in one event of the pool's, outside its cells."""
        match event:
            case RankStarted(rank, host, pid):
                self.hosts[rank], self.pids[rank] = host, pid
                self.replacing.discard(rank)
            case RankProcessState(rank, state, periodic) if rank not in self.gone:
                self.liveness.reported(rank, ProcessState(state), time.monotonic(), periodic)
            case RankOutput(rank, _, text) if CELL_END_MARK not in text:
                self._said[rank].append(text)
                self._log(rank, text)
            case CellEndedOn(rank, message):
                self.note_cell_ended(rank, message)
            case ProcessExited(rank) if rank in self.replacing:
                pass  # the lost process's end, reported before its replacement's start
            case ProcessExited(rank, returncode, output):
                self.liveness.forget(rank)
                how = event.out_of_memory or describe_exit(returncode)
                self._ended[rank] = how
                if output and not self._said[rank]:
                    self._said[rank].extend(output.splitlines())
                self.note_lost(rank, how, exited=True)
            case RankFailed(rank, _, kind, _, reason):
                self._failed[rank] = reason
                if kind in LOST:
                    self.note_lost(rank, reason)

    def note_cell_ended(self, rank: int, message: CellEnded) -> None:
        """`rank` said a cell (or the forming of a ring) ended."""
        self._last_ended[rank] = message
        self._cell_ended(rank, message)

    def note_lost(self, rank: int, how: str, exited: bool = False) -> None:
        """`exited`: its process's exit status says how (better than a lost connection)."""
        if exited or rank not in self.gone:
            self.gone[rank] = how

    def absorb(self) -> None:
        """Take in what came since the last look, and judge who fell silent: a rank of a host
        whose tasks stopped reporting for the peer timeout is lost."""
        while True:
            try:
                self.take(self.events.get_nowait())
            except queue.Empty:
                break
        timeout = self.liveness.peer_timeout_s
        for rank, _ in self.liveness.verdicts(time.monotonic(), stopped_too=False,
                                              hosts=self.hosts):
            self.note_lost(rank, f"{self.hosts[rank] or 'its host'} stopped answering: no "
                                 f"word from the Spark task that runs it for {timeout:g} s")

    # ---- waits -----------------------------------------------------------------------------

    def await_ring(self, epoch: int, timeout_s: float, starting: bool, where: str,
                   log_dir: str) -> None:
        """Wait until every rank says it formed the ring of `epoch` (at the pool's start:
        epoch 0, unasked); PoolError naming the rank that failed or ended meanwhile, or the
        ranks that did not come in time."""
        self._last_ended = {}
        self._ended, self._failed = {}, {}
        deadline = time.monotonic() + timeout_s

        def decide(now: float) -> Decision:
            for rank, message in sorted(self._last_ended.items()):
                if message.epoch == epoch and isinstance(message.outcome, CellFailed):
                    return Failed(PoolError(f"rank {rank} could not form the ring: "
                                            f"{message.outcome.reason}\n{message.outcome.traceback}"))
            for ends, verb in ((self._ended, "ended"), (self._failed, "failed")):
                for rank, how in sorted(ends.items()):
                    said = "\n".join(self._said[rank])
                    return Failed(PoolError(f"rank {rank} {verb} while the pool was starting "
                                            f"({how}){':' if said else ''}\n{said}"))
            formed = {rank for rank, message in self._last_ended.items() if message.epoch == epoch}
            if len(formed) == self.np:
                return Finished()
            if now > deadline:
                missing = sorted(set(range(self.np)) - formed)
                return Failed(PoolError(f"ranks {missing} did not "
                                        f"{'start' if starting else 'form a ring'} within "
                                        f"{timeout_s:.0f} s ({where}); their output is in "
                                        f"{log_dir}"))
            return KEEP_WATCHING

        watch(_Wait(self.events, self.take, decide))

    def await_registered(self, ranks: list[int], registered: Callable[[int], bool],
                         timeout_s: float, where: str) -> None:
        """Wait until each of `ranks` (replacements) registered with the control server."""
        deadline = time.monotonic() + timeout_s

        def decide(now: float) -> Decision:
            missing = [rank for rank in ranks if not registered(rank)]
            if not missing:
                return Finished()
            if now > deadline:
                return Failed(PoolError(f"{describe_ranks(missing)} did not start within "
                                        f"{timeout_s:g} s ({where})"))
            return KEEP_WATCHING

        watch(_Wait(self.events, self.take, decide))
