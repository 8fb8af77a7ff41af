"""What a run leaves behind: its record (`RunResult`, what `ddl_magic.last_run()` returns),
and the errors a failed or overlong run raises.

Example::

    >>> run = ddl_magic.last_run()              # doctest: +SKIP
    >>> run.status, run.results                 # doctest: +SKIP
    ('done', [0, 1])
    >>> print(run.log(1))                       # doctest: +SKIP
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .events import GroupRestarted, WorldReset
from .records import RankRecord
from .run_report import run_report_html, run_report_text
from .run_status import RunStatus


class RunTimeoutError(TimeoutError):
    """The run took longer than its timeout; every rank was stopped."""


class RankFailedError(RuntimeError):
    """A rank of a ddl_magic run failed; the message holds its traceback, rank and host."""

    def __init__(self, rank: int, host: str, reason: str, traceback: str, exit_code: int | None,
                 run: RunResult, restarts: int = 0):
        where = f"rank {rank} ({host})" if host else f"rank {rank}"
        super().__init__(f"{where} failed: {reason}{restarts_made(restarts)}"
                         + (f"\n\n{traceback}" if traceback else ""))
        self.rank, self.host, self.reason, self.traceback = rank, host, reason, traceback
        self.exit_code = exit_code  # what the rank exited with (negative: killed by that signal)
        self.run = run
        self.restarts = restarts  # how many times the whole group had been restarted before


def restarts_made(restarts: int) -> str:
    """What a run's last failure adds when the run had been restarted (max_restarts)."""
    if not restarts:
        return ""
    return (f", after {restarts} restart{'s' if restarts != 1 else ''} of the whole group "
            f"(max_restarts={restarts}: none left)")


@dataclass(frozen=True)
class TrackedRun:
    """Where a ddl_magic run is tracked: `last_run().mlflow`.

    Example:
        >>> from mlflow import MlflowClient                                  # doctest: +SKIP
        >>> tracked = ddl_magic.last_run().mlflow                            # doctest: +SKIP
        >>> MlflowClient(tracked.tracking_uri).get_run(tracked.run_id).info.status  # doctest: +SKIP
        'FINISHED'
    """

    tracking_uri: str
    experiment_id: str
    run_id: str

    def rank_environment(self) -> dict[str, str]:
        """What every rank needs so that `mlflow.log_*` there logs into this run."""
        return {"MLFLOW_TRACKING_URI": self.tracking_uri, "MLFLOW_RUN_ID": self.run_id,
                "MLFLOW_EXPERIMENT_ID": self.experiment_id}


@dataclass
class RunResult:
    """What a finished run leaves behind for later cells (`ddl_magic.last_run()`)."""

    run_id: str
    np: int
    where: str
    status: RunStatus = RunStatus.RUNNING
    ranks: list[RankRecord] = field(default_factory=list)
    result: Any = None
    results: list[Any] | None = None
    log_dir: str = ""
    timeline_path: str | None = None
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    error: str | None = None
    mlflow: TrackedRun | None = None  # the MLflow run it logged to, if tracked (tracking.py)
    # An elastic run's resets, in order (`events.WorldReset`: who left and joined, from which
    # commit it resumed); None for a run that was not elastic.
    resets: list[WorldReset] | None = None
    # A run with max_restarts: each restart of its whole group, in order, with the failure
    # that caused it (`events.GroupRestarted`); empty when it never restarted.
    restarts: list[GroupRestarted] = field(default_factory=list)
    # What the driver's control server did for this run (`control.ControlCounters.summary`):
    # connections, rendezvous messages (2 per rank), clock probes, liveness reports per
    # second, its one thread. A restarted group's are its last start's; a pool cell's, the
    # pool's since it started.
    control: dict | None = None

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)  # also given as its word: RunResult(..., status="done")

    @property
    def duration_s(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    def log(self, rank: int) -> str:
        """The full output of one rank."""
        with open(self.ranks[rank].log_path, encoding="utf-8") as f:
            return f.read()

    def __repr__(self) -> str:
        return run_report_text(self)

    def _repr_html_(self) -> str:
        return run_report_html(self)
