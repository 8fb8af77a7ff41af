"""What is known about one rank of a run: the one record that the driver keeps, that
`last_run().ranks` returns, and that both displays (the run view widget and the text
display) render.

The driver updates the records: `RankRecord.apply` takes the facts an event states (a rank
started, finished, or reported a failure), and the driver's attribution (`attribution.py`)
decides the rest, such as whether a rank that went silent failed or was stopped. A display given no
records keeps its own from the events it is shown, through the same `apply`.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass

from .events import Event, RankFailed, RankFinished, RankStarted
from ..wire.channel import ABORTED_EXIT_CODE


class RankStatus(str, enum.Enum):
    """Where a rank is. A str, so it prints, compares, serialises and shows as its value."""

    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # the run ended (another rank failed, or it was interrupted) first

    @property
    def ended(self) -> bool:
        return self in (RankStatus.DONE, RankStatus.FAILED, RankStatus.STOPPED)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # in a list of records, reads as it always has: 'done'
        return repr(self.value)


@dataclass
class RankRecord:
    rank: int
    host: str = ""
    pid: int | None = None
    status: RankStatus = RankStatus.STARTING
    reason: str = ""  # why it failed, for the user
    failure: RankFailed | None = None  # its failure as reported, where it reported one
    # Seconds since the epoch, the run's own clock (`RunResult.started_at`), so the two compare.
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    out_of_memory: str = ""  # why, where the OOM killer killed it (the launcher's word)
    log_path: str = ""

    @property
    def ended(self) -> bool:
        return self.status.ended

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or time.time()) - self.started_at

    def end(self, status: RankStatus, reason: str = "") -> None:
        """Mark the rank ended (the first end counts for its clock)."""
        self.status, self.reason = status, reason
        if self.ended_at is None:
            self.ended_at = time.time()

    def record_exit(self, returncode: int | None) -> None:
        """Keep how the rank's process ended. A rank that had finished its work and was then
        ended by the run's cleanup (SIGTERM, as every launcher stops what is left) finished
        normally: its exit is 0, not the signal."""
        if self.status is RankStatus.DONE and returncode in (-signal.SIGTERM, ABORTED_EXIT_CODE):
            returncode = 0
        self.exit_code = returncode

    def start_over(self) -> None:
        """The run's whole group starts again (max_restarts): this rank starts afresh; its
        log goes on."""
        self.host, self.pid, self.status, self.reason = "", None, RankStatus.STARTING, ""
        self.failure, self.started_at, self.ended_at, self.exit_code = None, None, None, None
        self.out_of_memory = ""

    def apply(self, event: Event) -> None:
        """Take in what `event` says about this rank."""
        if isinstance(event, RankStarted):
            self.host, self.pid, self.started_at = event.host, event.pid, time.time()
            if self.status is RankStatus.STARTING:
                self.status = RankStatus.RUNNING
        elif isinstance(event, RankFinished) and not self.ended:
            self.end(RankStatus.DONE)
        elif isinstance(event, RankFailed):
            self.host = event.host or self.host
            if not self.ended:
                self.failure = event
                self.end(RankStatus.FAILED, event.reason)


def new_records(np: int, log_dir: str | None = None) -> list[RankRecord]:
    """A starting record per rank (with its log file's path under `log_dir`)."""
    import os

    return [RankRecord(rank, log_path=os.path.join(log_dir, f"rank-{rank}.log") if log_dir else "")
            for rank in range(np)]
