"""The driver's one watch loop, and the decisions it carries out.

Every wait of the driver on its ranks is this loop: a run (`watcher.RunWatcher`, whatever
its failure policy: fail-fast, restarts, elastic), a pool's cell, a pool's ring forming and
its replacements registering (`pool.py`). What differs is the `Watched`: where its events
come from, how it takes each, and what it decides after each. The loop itself only carries
the decisions out, as the torch elastic agent's `_invoke_run` does with its worker group's
states and Ray Train's controller with its policies' decisions::

    decide ──► KEEP_WATCHING ──► take the next event (or none within `wait_s`) ──► decide ...
           ├─► Finished         return it
           ├─► Failed           raise its error
           └─► Restart          the whole group starts again (`start_again`), then decide ...

It runs on the notebook's main thread: KeyboardInterrupt (the stop button) is raised in it,
and the caller's cleanup stops the ranks. Every wait in it is bounded by `wait_s`, and
deadlines are the `Watched`'s to decide.
"""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .events import GroupRestarted

# The longest wait for an event before deciding again (a display refreshes about as often).
REFRESH_INTERVAL_S = 0.1


class KeepWatching(enum.Enum):
    KEEP_WATCHING = "keep watching"


KEEP_WATCHING = KeepWatching.KEEP_WATCHING
"""Nothing to carry out: take the next event."""


@dataclass(frozen=True)
class Finished:
    """What was watched is over as it should be; `results`: a run's, in rank order."""

    results: list[bytes | None] | None = None


@dataclass(frozen=True)
class Failed:
    """What was watched cannot go on: `error` says why, to the user."""

    error: BaseException


@dataclass(frozen=True)
class Restart:
    """The whole group of ranks starts again (`max_restarts`)."""

    restart: GroupRestarted


Decision = KeepWatching | Finished | Failed | Restart


class EventSource(Protocol):
    def get(self, timeout: float | None = None) -> Any:
        """The next event; `queue.Empty` if none came within `timeout`."""


class Watched(Protocol):
    """What the loop watches."""

    events: EventSource  # read afresh at every turn: a restarted group has a new queue

    def take(self, event: Any) -> None:
        """Take in one event."""

    def decide(self, now: float) -> Decision:
        """What to do next, at `now` (the monotonic clock)."""


def watch(watched: Watched, start_again: Callable[[Restart], None] | None = None,
          wait_s: float = REFRESH_INTERVAL_S) -> Finished:
    """Carry out `watched`'s decisions until it finished (returned) or failed (raised)."""
    while True:
        match watched.decide(time.monotonic()):
            case Finished() as finished:
                return finished
            case Failed(error):
                raise error
            case Restart() as restart if start_again is not None:
                start_again(restart)
            case KeepWatching.KEEP_WATCHING:
                try:
                    event = watched.events.get(timeout=wait_s)
                except queue.Empty:
                    continue
                watched.take(event)
            case other:
                raise ValueError(f"{type(watched).__name__} decided {other!r}, which this loop "
                                 "cannot carry out")
