"""What the driver hears from the ranks during a run.

Every rank's control connection turns its messages into these events and puts them on one
queue; the notebook's main thread drains that queue and hands each event to the display
(the run view widget, or the text printer outside a notebook). Keeping the events plain
dataclasses lets the display be tested without any processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..wire.messages import FailureKind


@dataclass(frozen=True)
class RankStarted:
    """A rank connected, proved the run's secret and registered."""

    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class RankOutput:
    """Text a rank wrote to stdout or stderr.

    ``text`` is one line without its line ending. ``replace`` is true when the line ended
    with a carriage return (a tqdm bar redrawing itself): it replaces the rank's previous
    ``replace`` line instead of adding a new one.
    """

    rank: int
    stream: str  # "stdout" or "stderr"
    text: str
    replace: bool = False


@dataclass(frozen=True)
class RankFinished:
    """A rank's function returned; ``result`` is its cloudpickled return value (or None)."""

    rank: int
    result: bytes | None = None


# Which failure caused the others: the lowest of these first, then the earliest. A process
# that died is never the consequence of another's failure (the driver stops the others itself,
# and their exit status says so), while an exception often is: torch's gloo raises
# "connection reset" in every rank whose peer was killed, and that report can arrive first.
ROOT_CAUSE_ORDER = {FailureKind.DIED: 0, FailureKind.FAILED_TO_START: 0,
                    FailureKind.TASK_FAILED: 0, FailureKind.VANISHED: 1,
                    FailureKind.UNREACHABLE: 1, FailureKind.STOPPED: 1, FailureKind.RAISED: 2,
                    FailureKind.LOST_PEER: 3}


@dataclass(frozen=True)
class RankFailed:
    """A rank raised, exited or vanished. ``reason`` and ``traceback`` are for the user."""

    rank: int
    host: str
    kind: FailureKind
    traceback: str
    reason: str  # "exception", "exit code N", "killed by SIGKILL", "connection lost", ...
    exit_code: int | None = None  # the exit status the rank reported, when it could report
    at_ns: int | None = None  # when it happened, on the driver's monotonic clock, where known
    lost_rank: int | None = None  # LOST_PEER: the rank it lost, where it knows


@dataclass(frozen=True)
class ProcessExited:
    """A rank's process ended, as whatever started it saw (the run loop reads the exit code).

    ``output`` is what the rank printed outside the worker's forwarding (an error before it
    could connect to the driver, typically). ``returncode`` is None when the process could
    not be started at all; ``output`` then says why.
    """

    rank: int
    returncode: int | None
    output: str = ""
    host: str = ""
    out_of_memory: str = ""  # why, with its peak memory, where the OOM killer killed it


@dataclass(frozen=True)
class RankProcessState:
    """What the owner of a rank's process (the rank factory, a Spark task) saw of it:
    ``state`` is a `liveness.ProcessState` value; ``periodic`` says the owner reports at every
    `liveness.report_interval_s`, so that its silence is a lost host."""

    rank: int
    state: str
    periodic: bool = False


@dataclass(frozen=True)
class TimelineBatch:
    """Timeline events recorded on a rank, already on the driver's clock.

    Each event is ``(lane, name, start_us, duration_us, args)`` with ``args`` a dict or None.
    """

    rank: int
    events: list = field(default_factory=list)


@dataclass(frozen=True)
class TimelineStarted:
    """A rank called `hvd.start_timeline(path)`: the driver writes the run's trace to `path`."""

    rank: int
    path: str


@dataclass(frozen=True)
class RanksPlaced:
    """Where the ranks run, as a task that started its rank (`reporter`) learned it from Spark:
    the address, ``host:port``, of the executor that runs each rank."""

    reporter: int
    executors: list[str]


@dataclass(frozen=True)
class HostUnanswered:
    """Ranks were placed on `host`, and it answered no connection within the peer timeout."""

    host: str
    ranks: list[int]
    at_ns: int  # when it was given up on, on the driver's monotonic clock


@dataclass(frozen=True)
class ResetAsked:
    """A rank of an elastic run left its world (`generation`, where it was `rank`) and waits
    for the next one; `slot` is the run's row for it (`elastic.py` says what a slot is)."""

    slot: int
    generation: int
    rank: int
    reason: str
    error: str
    commits: int


@dataclass(frozen=True)
class WorldReset:
    """An elastic run re-formed its world: what the displays show and `RunResult.resets` keeps.

    Ranks are numbered as in the world they belong to: `left` in the world that ended,
    `joined` in the new one (the replacements, always its last ranks).
    """

    generation: int  # the new world's number: 1 after the first reset
    left: tuple[int, ...]
    reasons: tuple[str, ...]  # why each of `left` was lost
    joined: tuple[int, ...]
    size: int  # the new world's ranks
    resumed_from_commit: int  # the commits of the new rank 0's state, which every rank syncs
    slots: tuple[int, ...]  # the run's row of each rank of the new world
    at: float  # seconds since the epoch, when the new world was sent to its ranks

    def describe(self) -> str:
        """One line: 'reset 1: rank 2 left (killed by SIGKILL); rank 3 joined; now 4 ranks,
        resumed from commit 12'."""
        left = "; ".join(f"rank {rank} left ({reason})" for rank, reason in
                         zip(self.left, self.reasons)) or "no rank left"
        joined = (f"{describe_ranks(list(self.joined))} joined (replacement"
                  f"{'s' if len(self.joined) > 1 else ''})" if self.joined else "nobody joined")
        return (f"reset {self.generation}: {left}; {joined}; now {self.size} "
                f"rank{'s' if self.size != 1 else ''}, resumed from commit "
                f"{self.resumed_from_commit}")


@dataclass(frozen=True)
class GroupRestarted:
    """A run with `max_restarts` lost a rank and starts its whole group again, as torchrun
    does: what the displays show and `RunResult.restarts` keeps, one per restart."""

    restart: int  # 1 for the first restart: the new group's TORCHELASTIC_RESTART_COUNT
    max_restarts: int
    rank: int  # the rank whose failure ended the attempt
    host: str
    reason: str  # "killed by SIGKILL", "exception", ...
    exit_code: int | None
    at: float  # seconds since the epoch, when the new group was started

    def describe(self) -> str:
        """One line: 'restart 1 of 3: rank 1 failed (killed by SIGKILL)'."""
        return (f"restart {self.restart} of {self.max_restarts}: rank {self.rank} failed "
                f"({self.reason})")


Event = (RankStarted | RankOutput | RankFinished | RankFailed | ProcessExited
         | RankProcessState | TimelineBatch | TimelineStarted | RanksPlaced | HostUnanswered
         | ResetAsked | WorldReset | GroupRestarted)


def describe_ranks(ranks: list[int]) -> str:
    """'rank 1', 'ranks 1 and 3', 'ranks 0, 1 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
