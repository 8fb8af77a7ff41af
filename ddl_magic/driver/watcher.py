"""Watches one run from the driver's main thread: applies each event to the run's record,
writes the ranks' logs and the trace, drives the display, and fails the ranks that are gone.

What happens about failures is its policy's (`failure_policies.py`: fail-fast, restarts;
`elastic.py`: elastic), carried out by the driver's one loop (`watch_loop.py`). What it
applies is decided by pure functions tested without processes: which failure caused the
others (`attribution.py`), whether a rank is alive (`wire/liveness.py`). `Job.run`
(`job.py`) and a pool's cell (`pool.py`) start the ranks and hand the watcher the run's
event queue and control server::

    watcher.watch(policy, timeout_s)   # until the policy decides the run finished or failed
    watcher.drain()                    # after the ranks were stopped: last lines, exits
    watcher.close(outcome)             # the run's end; logs closed, ranks left stopped
"""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from collections.abc import Iterable, Iterator
from typing import Callable, NamedTuple, Protocol

import cloudpickle

from .attribution import RankFacts, describe_exit
from .control import ControlServer
from .display import RunDisplay
from .events import (FailureKind, GroupRestarted, HostUnanswered, ProcessExited, RankFailed,
                     RankFinished, RankOutput, RankProcessState, RanksPlaced, RankStarted,
                     TimelineBatch, TimelineStarted)
from .host_probe import HostProbes
from .records import RankRecord, RankStatus
from .run_result import RunResult, RunTimeoutError
from .run_status import RunStatus, shown_end
from .watch_loop import (KEEP_WATCHING, REFRESH_INTERVAL_S, Decision, EventSource, Failed,
                         Restart, watch)
from ..wire.channel import ABORTED_EXIT_CODE, peer_timeout_s
from ..wire.liveness import LivenessWatch, ProcessState, Verdict

# Every rank must have connected and registered by then (a Spark stage may wait for slots).
REGISTER_TIMEOUT_S = 120.0
# The timeline's row for a restart of the whole group, written by the driver (a lane the
# ranks never record, as elastic.py's RESET_LANE).
RESTART_LANE = "restart"


class FailurePolicy(Protocol):
    """What a run does when its ranks end: fail fast, restart, go on elastic. It decides;
    the watch loop carries out what it decides."""

    def take(self, event: object) -> bool:
        """See `event` before the run's record does; True: it was the policy's alone."""

    def decide(self, now: float) -> Decision:
        """After the events so far: keep watching, or the run finished, failed, restarts."""


class DriverSpan(NamedTuple):
    """An event the driver writes into rows of a run's trace, in a lane the ranks never
    record (a restart of the group, an elastic reset): the trace's event shape."""

    lane: str
    name: str
    start_us: float  # the driver's monotonic clock, as every event of the trace
    duration_us: float
    args: dict | None = None


class RanksNotConnectedError(RuntimeError):
    """Ranks of the run did not connect to the driver within `REGISTER_TIMEOUT_S`."""


@contextlib.contextmanager
def ended_as(watcher: RunWatcher, stop: Callable[[RunStatus], None]) -> Iterator[None]:
    """A run's (or a pool's cell's) one way out. However it ends (every rank returned, a
    failure, a timeout, the stop button), `stop(outcome)` stops what is left of it and takes
    in its last words; then the watcher closes its record, logs, trace and display.

    Example::

        with ended_as(watcher, stop):
            launcher.start(...)
            watcher.watch(policy, timeout_s)
    """
    outcome = RunStatus.FAILED
    try:
        yield
        outcome = RunStatus.DONE
    except KeyboardInterrupt:
        outcome = RunStatus.INTERRUPTED
        raise
    finally:
        try:
            stop(outcome)
        finally:
            watcher.close(outcome)


def _open_trace(path: str):
    """The trace files of a ``--timeline`` run; pyarrow is imported only by runs that record one."""
    from ..timeline.columns import TraceFiles

    return TraceFiles(path)


class RunWatcher:
    """Applies events to the run record, the display, the log files and the timeline.

    What its failure policy reads and does through it: `results` (each rank's pickled
    return value, by slot), `failures` (as they came), `abort`, `facts`, `log`,
    `mark_span`; `server` and `events` are the current group's (a restart brings new ones).
    """

    def __init__(self, record: RunResult, display: RunDisplay, timeline_path: str | None,
                 events: EventSource, server: ControlServer, host_probes: HostProbes | None = None,
                 liveness: LivenessWatch | None = None):
        """`liveness`: the judgement to go on with, a pool's: its ranks live on after a cell,
        so it keeps judging them between cells (a host silent since before this cell is
        judged in it) and a rank's end of this cell does not end it."""
        self.record = record
        self.display = display
        self.events = events
        self.server = server
        self.results: dict[int, bytes | None] = {}
        self.failures: list[RankFailed] = []
        self.aborted_at_ns: int | None = None  # what ends after this, the driver ended
        self._host_probes = host_probes
        self._tasks_started: set[int] = set()  # ranks whose task said it is starting them
        self._placement: list[str] = []  # the executor of each rank, where Spark said
        self._output_before_start: dict[int, list[str]] = {}  # a rank's failure, if it never starts
        self._logs = {r.rank: open(r.log_path, "a", encoding="utf-8", buffering=1)
                      for r in record.ranks}
        self._trace = _open_trace(timeline_path) if timeline_path else None
        self._liveness = liveness or LivenessWatch(peer_timeout_s())  # from the owners' reports
        self._ranks_live_on = liveness is not None
        self._stopping = False
        self._last_refresh = 0.0
        self._policy: FailurePolicy | None = None
        self._timeout_s: float | None = None
        self._all_registered = False
        # A restarted run's timeout covers its earlier groups: the time they were watched.
        self._watched_before_s = 0.0
        self._watch_started = 0.0

    def leave_out(self, rank: int) -> None:
        """The run does not wait for `rank`, which does not take part (a pool's cell run on
        some ranks only)."""
        self.results[rank] = None

    # ---- the watch -------------------------------------------------------------------------

    def watch(self, policy: FailurePolicy, timeout_s: float | None,
              start_again: Callable[[Restart], None] | None = None) -> None:
        """Apply events until `policy` decides the run finished (the results are in the
        record) or failed (its error is raised); `start_again` carries out a restart."""
        self._policy, self._timeout_s = policy, timeout_s
        self._watch_started = time.monotonic()
        finished = watch(self, start_again)
        values = [None if value is None else cloudpickle.loads(value)
                  for value in finished.results]
        self.record.results, self.record.result = values, values[0]
        self.record.status = RunStatus.DONE

    def take(self, event: object) -> None:
        if not self._policy.take(event):
            self.handle(event)

    def decide(self, now: float) -> Decision:
        self._judge_liveness()
        decision = self._policy.decide(now)
        self._refresh()
        if decision is not KEEP_WATCHING:
            return decision
        if (self._timeout_s is not None
                and now - self._watch_started + self._watched_before_s > self._timeout_s):
            self.record.status = RunStatus.TIMED_OUT
            return Failed(RunTimeoutError(
                f"the run exceeded its timeout of {self._timeout_s:g} s; all ranks were "
                f"stopped. Logs: {self.record.log_dir}"))
        if not self._all_registered:
            self._all_registered = len(self.server.registered) == self.record.np
            if not self._all_registered and now - self._watch_started > REGISTER_TIMEOUT_S:
                missing = sorted(set(range(self.record.np)) - self.server.registered)
                self.record.status = RunStatus.FAILED
                return Failed(RanksNotConnectedError(
                    f"ranks {missing} did not connect within {REGISTER_TIMEOUT_S:.0f} s "
                    f"({self.record.where}{self._placed_on(missing)}); see their logs in "
                    f"{self.record.log_dir}"))
        return KEEP_WATCHING

    def abort(self, reason: str) -> None:
        """Stop every rank now, saying why; what ends after this, the driver ended."""
        self.aborted_at_ns = time.monotonic_ns()
        self.server.abort(reason)

    def _judge_liveness(self) -> None:
        """Fail the ranks whose owners saw them stopped, or fell silent, for the peer timeout."""
        timeout = self._liveness.peer_timeout_s
        hosts = [rank.host for rank in self.record.ranks]
        for rank, verdict in self._liveness.verdicts(time.monotonic(), hosts=hosts):
            record = self.record.ranks[rank]
            if record.ended:
                continue
            if verdict is Verdict.STOPPED:
                self.handle(RankFailed(
                    rank, record.host, FailureKind.STOPPED, "",
                    f"stopped: its process has been stopped for {timeout:g} s (by SIGSTOP, "
                    "Ctrl-Z, or a debugger)", at_ns=time.monotonic_ns()))
            else:
                self.handle(RankFailed(
                    rank, record.host, FailureKind.UNREACHABLE, "",
                    f"{record.host or 'its host'} stopped answering: no word from the task "
                    f"that runs it for {timeout:g} s", at_ns=time.monotonic_ns()))

    # ---- events ----------------------------------------------------------------------------

    def handle(self, event) -> None:
        record = self.record
        if isinstance(event, ProcessExited):
            self._liveness.forget(event.rank)
            rank = record.ranks[event.rank]
            rank.record_exit(event.returncode)
            rank.out_of_memory = event.out_of_memory
            if event.output:
                self._logs[event.rank].write(event.output)
            # A running rank's end is reported by its control connection, in order after its
            # last words; only a rank that never connected is reported here.
            printed = event.output or "\n".join(self._output_before_start.pop(event.rank, []))
            if rank.status is RankStatus.STARTING and event.returncode is None:  # it could not start
                self.handle(RankFailed(event.rank, event.host, FailureKind.FAILED_TO_START, "",
                                       printed, at_ns=time.monotonic_ns()))
            elif rank.status is RankStatus.STARTING:
                self.handle(RankFailed(event.rank, rank.host or event.host,
                                       FailureKind.FAILED_TO_START, printed,
                                       describe_exit(event.returncode), event.returncode,
                                       time.monotonic_ns()))
            return
        if isinstance(event, RankProcessState):
            if self._ranks_live_on or not record.ranks[event.rank].ended:
                self._liveness.reported(event.rank, ProcessState(event.state), time.monotonic(),
                                        event.periodic)
            return
        if isinstance(event, TimelineBatch):
            if self._trace is not None:
                self._trace.write(event.rank, event.events)
            self.display.handle(event)  # the live lanes and the running summary
            return
        if isinstance(event, TimelineStarted):
            self._start_trace(event.path)
            return
        if isinstance(event, RanksPlaced):
            self._tasks_started.add(event.reporter)
            self._placement = self._placement or event.executors
            if self._host_probes is not None:
                self._host_probes.start(event.executors)
            return
        if isinstance(event, HostUnanswered):
            self._fail_if_nothing_came(event)
            return
        rank = record.ranks[event.rank]
        if isinstance(event, RankStarted):
            rank.apply(event)
            self._output_before_start.pop(event.rank, None)
            if self._trace is not None:
                self._trace.add_rank(event.rank, event.host)
        elif isinstance(event, RankOutput):
            self._logs[event.rank].write(event.text + "\n")
            if rank.status is RankStatus.STARTING:
                self._output_before_start.setdefault(event.rank, []).append(event.text)
        elif isinstance(event, RankFinished):
            if not self._ranks_live_on:
                self._liveness.forget(event.rank)
            rank.apply(event)
            self.results[event.rank] = event.result
        elif isinstance(event, RankFailed):
            self._record_failure(rank, event)
            return  # shown by the policy, once the failures of this moment are all in
        self.display.handle(event)

    def _placed_on(self, ranks: list[int]) -> str:
        """', placed on executors at 10.0.0.3:4242', where known."""
        if not self._placement:
            return ""
        return ", placed on executors at " + ", ".join(sorted({self._placement[r] for r in ranks}))

    def _fail_if_nothing_came(self, unanswered: HostUnanswered) -> None:
        """A host that ranks were placed on does not answer: unless something came from one
        of its ranks or their tasks, they cannot start, and the run fails naming the host."""
        ranks = self.record.ranks
        if any(rank in self._tasks_started or ranks[rank].status is not RankStatus.STARTING
               for rank in unanswered.ranks):
            return  # it was there: its ranks are slow to start, or behind a firewall
        for rank in unanswered.ranks:
            self.handle(RankFailed(rank, unanswered.host, FailureKind.UNREACHABLE, "",
                                   f"{unanswered.host} does not answer", at_ns=unanswered.at_ns))

    def _start_trace(self, path: str) -> None:
        """The first rank to call hvd.start_timeline(path) decides where the run's trace goes."""
        if self._trace is not None:
            return
        self._trace = _open_trace(path)
        self.record.timeline_path = path
        for rank in self.record.ranks:
            if rank.started_at is not None:
                self._trace.add_rank(rank.rank, rank.host)

    def _record_failure(self, rank: RankRecord, failure: RankFailed) -> None:
        if rank.ended:
            return  # the process exit and the lost connection report the same end
        if self._stopping or failure.exit_code == ABORTED_EXIT_CODE:
            rank.end(RankStatus.STOPPED)  # because another rank failed, or the run was interrupted
            if failure.exit_code != ABORTED_EXIT_CODE and failure.traceback:
                # Its own end, come after the run was stopped (a peer's failure reached it
                # before the stop did): not shown, but its log keeps it.
                self._logs[failure.rank].write(failure.traceback)
            return
        # A lost connection may yet be a rank that we stopped, or one that died on its own:
        # the policy decides, by when it happened and by its exit status.
        rank.apply(failure)
        if failure.traceback:
            self._logs[failure.rank].write(failure.traceback)
        self.failures.append(failure)

    # ---- what policies read and write ------------------------------------------------------

    def facts(self) -> list[RankFacts]:
        """What attribution reads of each rank."""
        return [RankFacts(r.host, r.exit_code, r.status is RankStatus.DONE, r.out_of_memory)
                for r in self.record.ranks]

    def log(self, slot: int, line: str) -> None:
        """A line of the driver's own in one rank's log."""
        self._logs[slot].write(line + "\n")

    def mark_span(self, lane: str, name: str, since_us: float, slots: Iterable[int]) -> None:
        """A `DriverSpan` from `since_us` (the driver's monotonic clock) until now on each
        of `slots`' rows of the trace, where the run records one."""
        if self._trace is None:
            return
        span = DriverSpan(lane, name, since_us, time.monotonic_ns() / 1e3 - since_us)
        for slot in slots:
            self._trace.write(slot, [span])

    # ---- the end, and a new start ----------------------------------------------------------

    def drain(self) -> None:
        """Handle what arrived while stopping (last lines, exits)."""
        self._stopping = True
        while True:
            try:
                self.handle(self.events.get(timeout=0))
            except queue.Empty:
                return

    def start_over(self, restart: GroupRestarted, events: EventSource, server: ControlServer,
                   host_probes: HostProbes) -> None:
        """The whole group starts again (`max_restarts`), after `drain`, reporting on
        `events` to `server`: what was known of the last group is forgotten, each rank's
        record starts afresh, its log and the trace go on, and the display shows `restart`."""
        self.record.restarts.append(restart)
        if self.aborted_at_ns is not None:  # from the failure that stopped it to the new start
            self.mark_span(RESTART_LANE, restart.describe(), self.aborted_at_ns / 1e3,
                           range(self.record.np))
        self._watched_before_s += time.monotonic() - self._watch_started
        self._watch_started = time.monotonic()
        self.events, self.server, self._host_probes = events, server, host_probes
        self.record.status, self.record.error = RunStatus.RUNNING, None
        self.results.clear()
        self.failures.clear()
        self.aborted_at_ns = None
        self._liveness = LivenessWatch(peer_timeout_s())
        self._all_registered = False
        self._stopping = False
        self._tasks_started.clear()
        self._placement = []
        self._output_before_start.clear()
        for rank in self.record.ranks:
            rank.start_over()
            self.log(rank.rank, f"---- ddl_magic: {restart.describe()}; the whole group starts "
                                "again ----")
        self.display.handle(restart)

    def close(self, outcome: RunStatus) -> None:
        """End the run: its record, logs, trace and display. Its status is the end `watch`
        gave it, where it gave one; else `outcome`, how the run ended (interrupted, or
        failed: the ranks did not start, a result did not unpickle)."""
        record = self.record
        if record.status is RunStatus.RUNNING:
            record.status = outcome
        record.ended_at = time.time()
        for rank in record.ranks:
            if not rank.ended:
                rank.end(RankStatus.STOPPED)
            elif rank.status is RankStatus.DONE and rank.exit_code == -signal.SIGKILL:
                # It had reported its result: the run stands, and the log says why it was killed.
                self.log(rank.rank, "ddl_magic: this rank had finished, but its process did not "
                                    "exit when the run ended (a destructor or a thread of its "
                                    "own held it); it was killed")
        for log in self._logs.values():
            log.close()
        if self._trace is not None:
            self._trace.close()
        self.display.finish(shown_end(record.status))

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._last_refresh >= REFRESH_INTERVAL_S:
            self._last_refresh = now
            self.display.refresh()

