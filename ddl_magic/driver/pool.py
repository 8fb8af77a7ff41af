"""Ranks that live between cells: a pool, seen from the driver.

A `Pool` starts N ranks once (through a launcher, as a `Job` does), which form their ring
once and then run cell after cell, each in its own namespace that persists. A cell is a
run of its own for the user (its run view, its `RunResult`, `last_run()`), watched by the
same `RunWatcher` as a one-shot run; what differs is what happens at its end:

    the cell succeeded        ranks idle, ring kept, namespaces kept
    a rank raised             the others' cells are stopped (`CancelCell`): their
    (or interrupt, timeout)   collectives end with an error naming why, KeyboardInterrupt
                              where their code runs; the ranks stay, with their
                              namespaces, and form a fresh ring before the next cell
    a rank was lost           (killed, crashed, its host gone) the pool is broken: the other
                              ranks are stopped at once, nothing is left running, and the
                              next cell says so and how to go on (`%horovod restart`)
    ... in an elastic pool    (`min_np`) a fresh rank takes the lost one's place and every
                              rank forms a fresh ring with it (`_replace_lost`); the others
                              keep their namespaces, and the user is told which ranks
                              start empty. Below `min_np` survivors the pool breaks

Between cells nothing else reads the pool's events, so a thread of its own takes them in
every report interval (`_watch_between_cells`): a rank that died, or a host whose Spark
tasks fell silent for the peer timeout (`wire/liveness.py`, the judgement a cell's watcher
makes too, and goes on with), breaks an idle pool at once, releasing its other ranks and
its Spark slots; the tasks' reports never pile up in the queue.

Why a lost rank breaks the pool instead of restarting it behind the user's back, unless
it was started elastic: `pool_losses.py`.

Every message about a cell names its epoch (`wire/messages.py`): what a rank sends late
about a stopped cell is never taken for the next cell's. Each rank's output for a cell ends
with a mark on each stream, so that the cell ends after its last line, whichever way the
lines travelled.

States (`PoolState`): STARTING -> READY <-> RUNNING; READY -> BROKEN (a rank was lost);
any -> STOPPED. Every wait has a deadline: the ranks' start, a stopped cell's end
(`STOP_GRACE_S`), a pull, a status probe.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .display import DisplayFactory, text_display
from .events import RankStarted
from .failure_policies import FailFast
from .job import remember_run
from .launcher import Launcher
from .pool_losses import describe_lost, replaced_message, why_not_replaced
from .pool_ranks import PoolRanks
from .pool_server import LOST, CellEvents, PoolError, PoolServer
from .records import RankStatus, new_records
from .run_options import check_options
from .run_result import RankFailedError, RunResult, RunTimeoutError
from .run_setup import RunSetup, prepare_run
from .run_status import RunStatus
from .watch_loop import KEEP_WATCHING, Decision, Failed, Finished, watch
from .watcher import REGISTER_TIMEOUT_S, RunWatcher, ended_as
from ..timeline.chrome import join_traces
from ..wire.elastic_settings import REPLACEMENT_START_S
from ..wire.liveness import report_interval_s
from ..wire.messages import CellEnded, FormRing, Probe, ProbeReply, RunCell, RunSettings

# After a cell was stopped, how long its ranks may take to end it. One that has not by then
# is stuck where no interrupt reaches (native code): the pool is broken, and stopped.
STOP_GRACE_S = 10.0
FORM_RING_TIMEOUT_S = 120.0
PULL_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 2.0


class PoolState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    BROKEN = "broken"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


class RankState(str, enum.Enum):
    """A pool rank's state, as `Pool.status()` shows it. A str: it prints and compares as
    its value."""

    IDLE = "idle"
    RUNNING = "running"  # a cell runs on it
    GONE = "gone"  # lost, or the pool broke or stopped

    def __str__(self) -> str:
        return self.value


class PoolBrokenError(PoolError):
    """A rank of the pool was lost; its other ranks were stopped. `%horovod restart`."""


@dataclass
class RankInfo:
    """One rank of a pool, as `Pool.status()` shows it."""

    rank: int
    host: str
    pid: int | None
    state: RankState
    rss_bytes: int | None = None
    uptime_s: float | None = None


_active: "Pool | None" = None
_active_lock = threading.Lock()


def active_pool() -> "Pool | None":
    """The pool of this process that is not stopped (a broken one too), or None."""
    return _active


class Pool:
    """N ranks that keep their Python state and their ring between cells.

    The front-ends build it (`%horovod start`, `ddl_magic.start`); `launcher` is a
    `LocalLauncher` or a `SparkLauncher`, `display` makes each cell's display.
    """

    def __init__(self, np: int, launcher: Launcher, *, env: dict[str, str] | None = None,
                 timeline_path: str | None = None, use_gpu: bool = False,
                 display: DisplayFactory = text_display, min_np: int | None = None,
                 memory_per_rank: str | None = None):
        self._bounds = check_options(np, min_np=min_np)
        self.np = np
        self.min_np = min_np  # elastic: lost ranks are replaced while min_np are left
        self.replaced: list[str] = []  # what each replacement of lost ranks said
        self.last_pull_bytes = 0  # pickled, as the last pull brought them
        self.launcher = launcher
        self.where = launcher.where  # in words, for messages (an elastic pool's: at its start)
        self.env = dict(env or {})
        self.timeline_path = timeline_path  # where this start's cells record theirs
        self._timeline_asked = timeline_path  # "": in the pool's folder, wherever that is
        self.use_gpu = use_gpu
        self.memory_per_rank = memory_per_rank
        self.display = display
        self.state = PoolState.STOPPED
        self.broken_reason = ""
        self.rank_names: set[str] = set()  # names cells assigned on the ranks: theirs
        self.cells = 0
        self.log_dir = ""
        self._setup: RunSetup | None = None
        self._epochs = itertools.count(1)
        self._ring_ok = True
        self._ranks = self._new_ranks()
        self._server: PoolServer | None = None
        self._running_ranks: set[int] = set()
        self._launcher_stopped = False
        # Held by whoever reads the events or changes the state: a cell, a pull, a status,
        # start and stop, and the watch between cells while it takes in what came.
        self._lock = threading.RLock()
        self._stop_watching = threading.Event()

    @property
    def hosts(self) -> list[str]:
        return self._ranks.hosts

    @property
    def pids(self) -> list[int | None]:
        return self._ranks.pids

    def _new_ranks(self) -> PoolRanks:
        return PoolRanks(self.np, queue.Queue(), self._log, self._note_cell_ended)

    # ---- life ------------------------------------------------------------------------------

    def start(self) -> "Pool":
        """Start the ranks and form their ring; returns once every rank checked in."""
        global _active
        with _active_lock:
            if _active is not None:
                raise PoolError(_active.already_running())
            _active = self
        try:
            with self._lock:
                self._start()
        except BaseException:
            self._release()
            raise
        atexit.register(self.stop)
        self._watch_between_cells()
        return self

    def _start(self) -> None:
        if self._launcher_stopped:  # a restart: a fresh launcher, on today's session
            self.launcher = self.launcher.renewed()
            self._launcher_stopped = False
        self._setup = setup = prepare_run(self.np, self.launcher, env=self.env,
                                          use_gpu=self.use_gpu,
                                          timeline_path=self._timeline_asked,
                                          bounds=self._bounds,
                                          memory_per_rank=self.memory_per_rank, pool=True)
        self.where = self.launcher.elastic_where if self.min_np else self.launcher.where
        self.pool_id, self.log_dir, self.timeline_path = (setup.run_id, setup.log_dir,
                                                          setup.timeline_path)
        settings = RunSettings(setup.run_id, setup.env, timeline=setup.timeline_path is not None,
                               return_all=False, pool=True)
        self._ranks = self._new_ranks()
        self._ring_ok = True
        self.state = PoolState.STARTING
        self._server = PoolServer(setup.secret, self.np, b"", settings, self._ranks.events,
                                  self.launcher.bind_host, self.launcher.advertised_host)
        # Elastic: on Spark, each rank a job of its own, so that a lost one takes no other.
        self.launcher.start(self.np, self._server.address, setup.secret, self._ranks.events,
                            elastic=self.min_np is not None)
        self._ranks.await_ring(0, REGISTER_TIMEOUT_S + FORM_RING_TIMEOUT_S, True, self.where,
                               self.log_dir)
        self._ring_ok = True
        self.state = PoolState.READY

    def stop(self) -> None:
        """Stop every rank (their state is gone) and release what the pool holds."""
        atexit.unregister(self.stop)
        self._stop_watching.set()
        with self._lock:
            if self._server is not None:
                self._server.stop_ranks("the pool was stopped")
            self._release()
            self.state = PoolState.STOPPED

    def restart(self) -> "Pool":
        """Fresh ranks with the same options; the old ranks' state is gone."""
        with self._lock:
            self.stop()
            self.rank_names = set()
            self.broken_reason = ""
            self.cells = 0
            return self.start()

    def _watch_between_cells(self) -> None:
        """Take in the events of an idle pool every report interval, from a thread (see the
        module's docstring). It never waits on the queue itself, only on its stop: a cell
        takes the lock at once. It ends with the pool's ranks (stopped, broken, restarted)."""
        stop = self._stop_watching = threading.Event()
        interval = report_interval_s(self._ranks.liveness.peer_timeout_s)

        def watch_idle() -> None:
            while not stop.wait(interval):
                with self._lock:
                    if stop.is_set() or self.state is not PoolState.READY:
                        return
                    self._absorb_between_cells()

        threading.Thread(target=watch_idle, name="ddl-pool-between-cells", daemon=True).start()

    def _release(self, still_active: bool = False) -> None:
        """Stop the processes and the server. `still_active`: the pool stays this process's
        (broken), so that the next cell says what happened."""
        global _active
        try:
            if not self._launcher_stopped:  # once: the pids it knows may be reused after that
                self._launcher_stopped = True
                self.launcher.stop()
        finally:
            if self._server is not None:
                self._server.close()
                self._server = None
            if self._setup is not None:
                self._setup.release()
            with _active_lock:
                if _active is self and not still_active:
                    _active = None

    def __enter__(self) -> "Pool":
        if self.state is PoolState.STOPPED:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---- cells -----------------------------------------------------------------------------

    def run(self, function, *args, **kwargs) -> Any:
        """Run `function(*args, **kwargs)` on every rank; returns rank 0's value.

        Example::

            with ddl_magic.start(np=2) as pool:
                pool.run(train, epochs=1)
        """
        from .capture import capture_function

        return self.run_cell(capture_function(function, kwargs, args)).result

    def run_cell(self, task: bytes, *, ranks: list[int] | None = None, return_all: bool = False,
                 timeout_s: float | None = None, title: str = "", quiet: bool = False) -> RunResult:
        """Run a captured cell (or function) on the pool's ranks (`ranks`: some of them)."""
        with self._lock:
            return self._run_cell(task, ranks, return_all, timeout_s, title, quiet)

    def _run_cell(self, task: bytes, ranks: list[int] | None, return_all: bool,
                  timeout_s: float | None, title: str, quiet: bool) -> RunResult:
        self.check_usable()
        selected = sorted(set(range(self.np) if ranks is None else ranks))
        if not selected or not all(0 <= rank < self.np for rank in selected):
            raise PoolError(f"--ranks {ranks}: this pool has ranks 0 to {self.np - 1}")
        self._absorb_between_cells()
        self.check_usable()
        if not self._ring_ok:  # the fresh ring after a stopped cell was itself interrupted
            self._form_ring(FORM_RING_TIMEOUT_S)
        epoch = next(self._epochs)
        self.cells += 1
        cell_dir = os.path.join(self.log_dir, f"cell-{self.cells}")
        os.makedirs(cell_dir, exist_ok=True)
        timeline = f"{self.timeline_path}-cell-{self.cells}.json" if self.timeline_path else None
        record = RunResult(f"{self.pool_id}-cell-{self.cells}", self.np,
                           f"{self.where} (pool)", log_dir=cell_dir, timeline_path=timeline)
        record.ranks = new_records(self.np, cell_dir)
        remember_run(record)  # `last_run()` is the last cell
        display = self.display(record.ranks, quiet=quiet, log_dir=cell_dir,
                               title=title or f"pool cell {self.cells}", timeline_path=timeline)
        events = CellEvents(self._ranks, epoch, selected)
        # The liveness judged between cells goes on (a host silent since before the cell is
        # judged in it); the cause of ranks that only lost a peer is awaited (a Spark host
        # cut off: its ranks' peers time out about when its tasks are judged silent).
        watcher = RunWatcher(record, display, timeline, events, self._server,
                             liveness=self._ranks.liveness)
        policy = FailFast(watcher, describe_lost=self.launcher.describe_lost, await_cause=True)
        for rank in range(self.np):
            if rank in selected:
                watcher.handle(RankStarted(rank, self.hosts[rank], self.pids[rank]))
            else:
                record.ranks[rank].end(RankStatus.DONE, "not in --ranks")
                watcher.leave_out(rank)
        self._server.begin_cell(epoch, selected)
        self.state = PoolState.RUNNING
        self._running_ranks = set(selected)
        only = tuple(selected) if ranks is not None and len(selected) < self.np else None

        def stop(outcome: RunStatus) -> None:
            if outcome is not RunStatus.DONE:
                self._server.abort("the cell was interrupted" if outcome is RunStatus.INTERRUPTED
                                   else "the cell timed out" if record.status is RunStatus.TIMED_OUT
                                   else "the cell failed")
            self._server.end_cell()
            self._finish_cell(events, watcher, selected)
            record.control = self._server.counters.summary()  # the pool's, since it started

        try:
            with ended_as(watcher, stop):
                display.display()
                for rank in selected:
                    self._server.send(rank, RunCell(epoch, task, return_all, only))
                try:
                    watcher.watch(policy, timeout_s)
                except RunTimeoutError:
                    raise RunTimeoutError(
                        f"the cell ran past its timeout of {timeout_s:g} s and was stopped on "
                        f"every rank; the ranks stay up, with their state. Logs: {cell_dir}") from None
        finally:
            self._running_ranks = set()
            self._after_cell()
        if selected != list(range(self.np)):
            record.results = [record.results[rank] for rank in selected]
            record.result = record.results[0]
        return record

    def _finish_cell(self, events: CellEvents, watcher: RunWatcher, selected: list[int]) -> None:
        """Wait until every rank of the cell ended it (or was lost), at most `STOP_GRACE_S`."""
        for record in watcher.record.ranks:  # judged lost in the cell (its host fell silent)
            if record.failure is not None and record.failure.kind in LOST:
                self._ranks.note_lost(record.rank, record.reason or record.failure.reason)
        watcher.drain()
        deadline = time.monotonic() + STOP_GRACE_S
        gone = self._ranks.gone

        def decide(now: float) -> Decision:
            stuck = [rank for rank in selected if rank not in events.ended and rank not in gone]
            if not stuck:
                return Finished()
            if now > deadline:
                return Failed(PoolBrokenError(
                    f"ranks {stuck} did not stop their cell within {STOP_GRACE_S:g} s of being "
                    "asked (stuck where no interrupt reaches, e.g. in native code); the pool "
                    "was stopped"))
            return KEEP_WATCHING

        try:
            watch(_CellEnds(events, watcher.handle, decide))
        except PoolBrokenError as stuck:
            self._break(str(stuck))
            return
        # A rank's end comes with its last words (a stopped rank's "stopped: ..." line), which
        # may still be queued when the last end is counted: they belong in the cell's logs.
        watcher.drain()
        for rank in selected:
            ended = events.ended.get(rank)
            if ended is None or not ended.ring_ok:
                self._ring_ok = False

    def _after_cell(self) -> None:
        if self._ranks.gone:
            self._replace_or_break(f"in cell {self.cells}")
            return
        if self.state is PoolState.BROKEN:
            return
        self.state = PoolState.READY
        if not self._ring_ok:
            try:
                self._form_ring(FORM_RING_TIMEOUT_S)
            except (PoolError, RankFailedError) as exc:
                self._break(f"the ranks could not form a fresh ring after cell {self.cells}: {exc}")

    def _form_ring(self, timeout_s: float, peers: list | None = None, joining=()) -> None:
        """Every rank forms a fresh ring (`peers`: with a new peer table, which the
        replacements `joining` start on)."""
        epoch = next(self._epochs)
        for rank in range(self.np):
            if rank in joining:
                self._server.start_joined(rank, peers, rank, epoch)
            else:
                self._server.send(rank, FormRing(epoch, peers))
        self._ranks.await_ring(epoch, timeout_s, False, self.where, self.log_dir)
        self._ring_ok = True

    def _absorb_between_cells(self) -> None:
        """Take in what happened since the last cell: a rank lost while idle breaks the pool."""
        self._ranks.absorb()
        if self._ranks.gone:
            self._replace_or_break("while the pool was idle")

    def _replace_or_break(self, when: str) -> None:
        """Ranks were lost: an elastic pool with `min_np` left replaces them; else it breaks."""
        gone = self._ranks.gone
        what = describe_lost(gone, self.hosts, when)
        if (why_not := why_not_replaced(self.np, len(gone), self.min_np)) is not None:
            self._break(f"{what}: {why_not}" if why_not else what)
            return
        try:
            self._replace_lost(what)
        except (PoolError, RankFailedError) as exc:
            self._break(f"{what}, and the pool could not replace them: {exc}")

    def _replace_lost(self, what: str) -> None:
        """Start a fresh rank in each lost one's place, then have every rank form a fresh ring
        with the new peer table; the survivors keep their namespaces."""
        lost = sorted(self._ranks.gone)
        for rank in lost:
            self._server.expect_again(rank)
            self._ranks.liveness.forget(rank)
            self._ranks.replacing.add(rank)
            self.launcher.replace(rank)
        self._ranks.await_registered(lost, lambda rank: bool(self._server.registration(rank)),
                                     REPLACEMENT_START_S, self.where)
        self._ranks.gone.clear()
        peers = [(rank, *self._server.registration(rank)) for rank in range(self.np)]
        self._form_ring(FORM_RING_TIMEOUT_S, peers, joining=lost)
        said = replaced_message(what, lost, self.rank_names)
        self.replaced.append(said)
        print(f"ddl_magic pool: {said}", file=sys.stderr, flush=True)

    def _break(self, reason: str) -> None:
        """A rank was lost: stop the others now, and say so at the next cell."""
        self.broken_reason = reason
        if self._server is not None:
            self._server.stop_ranks(f"the pool broke: {reason}")
        self._release(still_active=True)
        self.state = PoolState.BROKEN

    def check_usable(self) -> None:
        if self.state is PoolState.BROKEN:
            raise PoolBrokenError(
                f"the pool is broken: {self.broken_reason}. Its other ranks were stopped and "
                "every rank's state is gone. `%horovod restart` (pool.restart()) starts "
                f"{self.np} fresh ranks with the same options; `%horovod stop` goes back to "
                "one-shot cells")
        if self.state is PoolState.STOPPED:
            raise PoolError("the pool is stopped: `%horovod start -np N` starts a new one")

    def already_running(self) -> str:
        if self.state is PoolState.BROKEN:
            return (f"a pool of {self.np} ranks is there, broken ({self.broken_reason}): "
                    "`%horovod restart` for fresh ranks with its options, or `%horovod stop` "
                    "it before starting another")
        return (f"a pool of {self.np} ranks is already {self.state.value} "
                f"({self.where}): run cells on it, `%horovod restart` for fresh "
                "ranks, or `%horovod stop` it before starting another")

    def _log(self, rank: int, text: str) -> None:
        with open(os.path.join(self.log_dir, f"rank-{rank}.log"), "a", encoding="utf-8") as log:
            log.write(text + "\n")

    def _note_cell_ended(self, rank: int, message: CellEnded) -> None:
        self.rank_names.update(message.names)
        if not message.ring_ok:
            self._ring_ok = False

    # ---- values and state ------------------------------------------------------------------

    def pull(self, name: str, rank: int = 0, all_ranks: bool = False) -> Any:
        """The value of `name` on `rank` (or the list of every rank's, `all_ranks`)."""
        with self._lock:
            return self._pull(name, rank, all_ranks)

    def _pull(self, name: str, rank: int, all_ranks: bool) -> Any:
        self.check_usable()
        self._absorb_between_cells()
        self.check_usable()
        ranks = list(range(self.np)) if all_ranks else [rank]
        if not all(0 <= r < self.np for r in ranks):
            raise PoolError(f"--rank {rank}: this pool has ranks 0 to {self.np - 1}")
        values = self._server.pull(ranks, name, PULL_TIMEOUT_S)
        self.last_pull_bytes = self._server.pulled_bytes
        return values if all_ranks else values[0]

    def status(self) -> list[RankInfo]:
        """Every rank's state (idle, running, gone), host, pid, memory and uptime."""
        if self.state is PoolState.READY:  # (while a cell runs, its watcher reads the events)
            with self._lock:
                if self.state is PoolState.READY:
                    self._absorb_between_cells()
        gone = self._ranks.gone
        live = [r for r in range(self.np) if r not in gone]
        replies: dict[int, ProbeReply] = {}
        server = self._server  # (None once the watch between cells broke the pool)
        if server is not None and live:
            replies = server.ask(live, Probe, PROBE_TIMEOUT_S)
        infos = []
        for rank in range(self.np):
            state = (RankState.GONE if rank in gone or self.state in (PoolState.BROKEN,
                                                                        PoolState.STOPPED)
                     else RankState.RUNNING if rank in self._running_ranks else RankState.IDLE)
            reply = replies.get(rank)
            infos.append(RankInfo(rank, self.hosts[rank], self.pids[rank], state,
                                  reply.rss_bytes if reply else None,
                                  reply.uptime_s if reply else None))
        return infos

    def session_timeline(self) -> str:
        """One trace of every cell so far, for a pool started with a timeline: its path, for
        `ddl_magic.show_timeline(path)`. (Each cell's own trace is its run's: `last_run()`.)
        The cells' events are on one clock, the driver's, so they line up as they ran."""
        if not self.timeline_path:
            raise PoolError("this pool records no timeline: start it with "
                            "%horovod start -np N --timeline (or ddl_magic.start(timeline=''))")
        cells = [f"{self.timeline_path}-cell-{cell}.json" for cell in range(1, self.cells + 1)]
        return join_traces([path for path in cells if os.path.exists(path)],  # some recorded nothing
                           f"{self.timeline_path}-session.json")

    def __repr__(self) -> str:
        return f"<ddl_magic pool: {self.np} ranks, {self.state.value}, {self.cells} cells>"


@dataclass
class _CellEnds:
    """A stopped cell's last ends, as the watch loop sees them (`Pool._finish_cell`)."""

    events: CellEvents
    take: Callable[[object], None]
    decide: Callable[[float], Decision]
