"""Watches one run from the driver's main thread: applies each event to the run's record,
writes the ranks' logs and the trace, drives the display, and fails the ranks that are gone.

What it applies is decided elsewhere, by pure functions tested without processes: which
failure caused the others, and when the failures of a moment are all in (`attribution.py`);
whether a rank is alive (`wire/liveness.py`). `Job.run` (`job.py`) starts the ranks and
hands the watcher the run's event queue::

    watcher.watch(events, server, timeout_s)   # until every rank finished, or the first failure
    watcher.drain(events)                      # after the ranks were stopped: last lines, exits
    watcher.close(outcome)                     # the run's end; logs closed, ranks left stopped
"""

from __future__ import annotations

import queue
import signal
import time
from typing import TYPE_CHECKING, Callable

import cloudpickle

from .attribution import RankFacts, attribute, describe_exit, failures_settled
from .display import RunDisplay
from .events import (FailureKind, GroupRestarted, HostUnanswered, ProcessExited, RankFailed, RankFinished,
                     RankOutput, RankProcessState, RanksPlaced, RankStarted, TimelineBatch,
                     TimelineStarted)
from .host_probe import HostProbes
from .records import RankRecord, RankStatus
from .run_result import RankFailedError, RunResult, RunTimeoutError, restarts_made
from .run_status import RunStatus, shown_end
from ..wire.channel import ABORTED_EXIT_CODE, peer_timeout_s
from ..wire.liveness import LivenessWatch, ProcessState, Verdict

if TYPE_CHECKING:
    from .control import ControlServer

# The timeline's row for a restart of the whole group, written by the driver (a lane the
# ranks never record, as elastic.py's RESET_LANE).
RESTART_LANE = "restart"
REFRESH_INTERVAL_S = 0.1  # the display's, at most; and the longest wait for an event
# Every rank must have connected and registered by then (a Spark stage may wait for slots).
REGISTER_TIMEOUT_S = 120.0


def _open_trace(path: str):
    """The trace files of a ``--timeline`` run; pyarrow is imported only by runs that record one."""
    from ..timeline.columns import TraceFiles

    return TraceFiles(path)


class RunWatcher:
    """Applies events to the run record, the display, the log files and the timeline."""

    def __init__(self, record: RunResult, display: RunDisplay, timeline_path: str | None,
                 host_probes: HostProbes | None = None, exits_follow_output: bool = False,
                 describe_lost: Callable[[str, list[int]], str] | None = None,
                 liveness: LivenessWatch | None = None, await_cause: bool = False):
        """`liveness`: the judgement to go on with, a pool's: its ranks live on after a cell,
        so it keeps judging them between cells (a host silent since before this cell is
        judged in it) and a rank's end of this cell does not end it. `await_cause`: see
        `attribution.failures_settled`."""
        self.record = record
        self._host_probes = host_probes
        self._tasks_started: set[int] = set()  # ranks whose task said it is starting them
        self._placement: list[str] = []  # the executor of each rank, where Spark said
        # (host, ranks) -> the reason to show when those ranks of one host vanished together
        self._describe_lost = describe_lost or (lambda host, ranks: "connection lost")
        self._exits_follow_output = exits_follow_output
        self._output_before_start: dict[int, list[str]] = {}  # a rank's failure, if it never starts
        self.display = display
        self._logs = {r.rank: open(r.log_path, "a", encoding="utf-8", buffering=1)
                      for r in record.ranks}
        self._trace = _open_trace(timeline_path) if timeline_path else None
        self._results: dict[int, bytes | None] = {}
        self._failures: list[RankFailed] = []
        self._aborted_at_ns: int | None = None
        self._liveness = liveness or LivenessWatch(peer_timeout_s())  # from the owners' reports
        self._ranks_live_on = liveness is not None
        self._await_cause = await_cause
        self._stopping = False
        self._last_refresh = 0.0
        # A restarted run's timeout covers its earlier groups: the time they were watched.
        self._watched_before_s = 0.0
        self._watch_started = 0.0

    def leave_out(self, rank: int) -> None:
        """The run does not wait for `rank`, which does not take part (a pool's cell run on
        some ranks only)."""
        self._results[rank] = None

    def watch(self, events: queue.Queue, server: ControlServer, timeout_s: float | None) -> None:
        """Handle events until every rank finished; raise RankFailedError on the first failure."""
        started = self._watch_started = time.monotonic()
        first_failure_at = None
        cause_in = False
        while len(self._results) < self.record.np:
            now = time.monotonic()
            if first_failure_at is not None and failures_settled(
                    self._failures, self._facts(), now - first_failure_at,
                    self._exits_follow_output, self._await_cause):
                break
            if timeout_s is not None and now - started + self._watched_before_s > timeout_s:
                self.record.status = RunStatus.TIMED_OUT
                raise RunTimeoutError(
                    f"the run exceeded its timeout of {timeout_s:g} s; all ranks were stopped. "
                    f"Logs: {self.record.log_dir}")
            if now - started > REGISTER_TIMEOUT_S and len(server.registered) < self.record.np:
                missing = sorted(set(range(self.record.np)) - server.registered)
                self.record.status = RunStatus.FAILED
                raise RuntimeError(
                    f"ranks {missing} did not connect within {REGISTER_TIMEOUT_S:.0f} s "
                    f"({self.record.where}{self._placed_on(missing)}); see their logs in "
                    f"{self.record.log_dir}")
            try:
                self.handle(events.get(timeout=REFRESH_INTERVAL_S))
            except queue.Empty:
                pass
            self._judge_liveness()
            if self._failures and first_failure_at is None:
                first_failure_at = time.monotonic()
                self._aborted_at_ns = time.monotonic_ns()  # what ends after this, we ended
                server.abort(f"rank {self._failures[0].rank} failed")
            if self._await_cause and not cause_in and any(
                    f.kind is not FailureKind.LOST_PEER for f in self._failures):
                # The moment settles from the cause, not from the lost peers that came before
                # it: ranks lost with it (a host's, let go together) are in by then.
                cause_in, first_failure_at = True, time.monotonic()
            self._refresh()
        if self._failures:
            self._raise_failure()
        self._collect_results()
        self.record.status = RunStatus.DONE

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
            self._results[event.rank] = event.result
        elif isinstance(event, RankFailed):
            self._record_failure(rank, event)
            return  # shown by _raise_failure, once the failures of this moment are all in
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
            return
        # A lost connection may yet be a rank that we stopped, or one that died on its own:
        # `_raise_failure` decides, by when it happened and by its exit status.
        rank.apply(failure)
        if failure.traceback:
            self._logs[failure.rank].write(failure.traceback)
        self._failures.append(failure)

    def drain(self, events: queue.Queue) -> None:
        """Handle what arrived while stopping (last lines, exit codes)."""
        self._stopping = True
        while True:
            try:
                self.handle(events.get_nowait())
            except queue.Empty:
                return

    def start_over(self, restart: GroupRestarted, host_probes: HostProbes) -> None:
        """The whole group starts again (`Job` with max_restarts), after `drain`: what was
        known of the last group is forgotten, each rank's record starts afresh, its log and
        the trace go on, and the display shows `restart`. `host_probes` report on the new
        group's queue."""
        self.record.restarts.append(restart)
        if self._trace is not None and self._aborted_at_ns is not None:
            # the restart, from the failure that stopped the group to the new group's start
            start_us = self._aborted_at_ns / 1e3  # the driver's monotonic clock, as the trace's
            event = (RESTART_LANE, restart.describe(), start_us,
                     time.monotonic_ns() / 1e3 - start_us, None)
            for rank in self.record.ranks:
                self._trace.write(rank.rank, [event])
        self._watched_before_s += time.monotonic() - self._watch_started
        self._host_probes = host_probes
        self.record.status, self.record.error = RunStatus.RUNNING, None
        self._results.clear()
        self._failures.clear()
        self._aborted_at_ns = None
        self._liveness = LivenessWatch(peer_timeout_s())
        self._stopping = False
        self._tasks_started.clear()
        self._placement = []
        self._output_before_start.clear()
        for rank in self.record.ranks:
            rank.start_over()
            self._logs[rank.rank].write(f"---- ddl_magic: {restart.describe()}; the whole "
                                        "group starts again ----\n")
        self.display.handle(restart)

    def close(self, outcome: RunStatus) -> None:
        """End the run: its record, logs, trace and display. Its status is the end `watch`
        gave it, where it gave one; else `outcome`, how `Job.run` ended (interrupted, or
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
                self._logs[rank.rank].write(
                    "ddl_magic: this rank had finished, but its process did not exit when the "
                    "run ended (a destructor or a thread of its own held it); it was killed\n")
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

    def _raise_failure(self) -> None:
        """Show and raise the failure that caused the others (`attribution.py` decides), then
        the ranks it took down."""
        records = self.record.ranks
        verdict = attribute(self._failures, self._facts(), self._aborted_at_ns,
                            self._describe_lost, peer_timeout_s())
        for rank in verdict.stopped:
            records[rank].end(RankStatus.STOPPED)  # the driver stopped it
            records[rank].failure = None
        for rank, reason in verdict.failed.items():
            records[rank].end(RankStatus.FAILED, reason)
        for failure in verdict.failures:
            self.display.handle(failure)
        cause = verdict.cause
        self.record.status = RunStatus.FAILED
        restarts = len(self.record.restarts)
        self.record.error = f"rank {cause.rank} failed: {cause.reason}{restarts_made(restarts)}"
        raise RankFailedError(cause.rank, cause.host, cause.reason, cause.traceback,
                              cause.exit_code, self.record, restarts)

    def _facts(self) -> list[RankFacts]:
        """What attribution reads of each rank."""
        return [RankFacts(r.host, r.exit_code, r.status is RankStatus.DONE, r.out_of_memory)
                for r in self.record.ranks]

    def _collect_results(self) -> None:
        values = [cloudpickle.loads(b) if b is not None else None
                  for _, b in sorted(self._results.items())]
        self.record.result = values[0]
        self.record.results = values
