"""What a run does when a rank fails, unless it is elastic (`elastic.py`): it fails fast,
and with `max_restarts` its whole group then starts again (torchrun's `--max-restarts`).

`FailFast` is a policy of the run's watcher (`watcher.FailurePolicy`): it decides, the one
watch loop carries it out (`watch_loop.py`). At the first failure every other rank is
stopped at once; once the failures of that moment (and the failed ranks' last words) are in
(`attribution.failures_settled`), the one that caused the others is shown and the run fails
with it (`attribution.attribute` decides which). With restarts left, the run restarts instead:
the same record, display, logs and trace, a new control server and queue (`Job`), each rank
told its restart (TORCHELASTIC_RESTART_COUNT). Only a rank's failure restarts a run: never an
interrupt, a timeout (which covers every attempt) or a refused option.
"""

from __future__ import annotations

import time
from typing import Callable

from .attribution import attribute, failures_settled
from .events import FailureKind, GroupRestarted
from .records import RankStatus
from .run_result import RankFailedError, restarts_made
from .run_status import RunStatus
from .watch_loop import KEEP_WATCHING, Decision, Failed, Finished, Restart
from .watcher import RunWatcher
from ..wire.channel import peer_timeout_s


def connection_lost(host: str, ranks: list[int]) -> str:
    """What is known of ranks that vanished where no launcher can say more."""
    return "connection lost"


class FailFast:
    """The run ends at its first failure, or restarts while `max_restarts` allow.

    `exits_follow_output`: the launcher reports a rank's exit after all it wrote, so a
    failure waits for its last words. `describe_lost`: the launcher's words for the ranks of
    a host that vanished together. `await_cause` (a pool's cell): while every failure is only
    a lost peer, wait a moment for the one that caused them (`attribution.failures_settled`).
    """

    def __init__(self, watcher: RunWatcher, *, exits_follow_output: bool = False,
                 describe_lost: Callable[[str, list[int]], str] = connection_lost,
                 await_cause: bool = False, max_restarts: int = 0):
        self.watcher = watcher
        self._exits_follow_output = exits_follow_output
        self._describe_lost = describe_lost
        self._await_cause = await_cause
        self._max_restarts = max_restarts
        self._first_failure_at: float | None = None
        self._cause_in = False

    def take(self, event: object) -> bool:
        return False  # every event is the record's

    def decide(self, now: float) -> Decision:
        watcher, failures = self.watcher, self.watcher.failures
        if failures and self._first_failure_at is None:
            self._first_failure_at = now
            watcher.abort(f"rank {failures[0].rank} failed")
        if self._await_cause and not self._cause_in and any(
                f.kind is not FailureKind.LOST_PEER for f in failures):
            # The moment settles from the cause, not from the lost peers that came before
            # it: ranks lost with it (a host's, let go together) are in by then.
            self._cause_in, self._first_failure_at = True, now
        every_rank_returned = len(watcher.results) == watcher.record.np
        if every_rank_returned and not failures:
            return Finished([value for _, value in sorted(watcher.results.items())])
        if every_rank_returned or (self._first_failure_at is not None and failures_settled(
                failures, watcher.facts(), now - self._first_failure_at,
                self._exits_follow_output, self._await_cause)):
            failure = self.failure()
            if failure.restarts >= self._max_restarts:
                return Failed(failure)
            self._first_failure_at, self._cause_in = None, False
            return Restart(GroupRestarted(failure.restarts + 1, self._max_restarts,
                                          failure.rank, failure.host, failure.reason,
                                          failure.exit_code, time.time()))
        return KEEP_WATCHING

    def failure(self) -> RankFailedError:
        """Show the failure that caused the others (`attribution.py` decides), then the ranks
        it took down; the error that says so."""
        record = self.watcher.record
        verdict = attribute(self.watcher.failures, self.watcher.facts(),
                            self.watcher.aborted_at_ns, self._describe_lost, peer_timeout_s())
        for rank in verdict.stopped:
            record.ranks[rank].end(RankStatus.STOPPED)  # the driver stopped it
            record.ranks[rank].failure = None
        for rank, reason in verdict.failed.items():
            record.ranks[rank].end(RankStatus.FAILED, reason)
        for failure in verdict.failures:
            self.watcher.display.handle(failure)
        cause = verdict.cause
        record.status = RunStatus.FAILED
        restarts = len(record.restarts)
        record.error = f"rank {cause.rank} failed: {cause.reason}{restarts_made(restarts)}"
        return RankFailedError(cause.rank, cause.host, cause.reason, cause.traceback,
                               cause.exit_code, record, restarts)
