"""What the driver hears from the ranks during a run.

Every rank's control connection turns its messages into these events and puts them on one
queue; the notebook's main thread drains that queue and hands each event to the display
(the run view widget, or the text printer outside a notebook). Keeping the events plain
dataclasses lets the display be tested without any processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class RankFailed:
    """A rank raised, exited or vanished. ``traceback`` is the text to show the user."""

    rank: int
    host: str
    traceback: str
    reason: str  # "exception", "exit code N", "killed by SIGKILL", "connection lost", ...
    exit_code: int | None = None  # the exit status the rank reported, when it could report
    at_ns: int | None = None  # when it raised, on the driver's monotonic clock, when it could report


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


Event = (RankStarted | RankOutput | RankFinished | RankFailed | ProcessExited | TimelineBatch
         | TimelineStarted)
