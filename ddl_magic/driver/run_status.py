"""How a run stands (`RunStatus`): the `status` of its record (`run_result.RunResult`), set
by the run's watcher, shown by the displays (`shown_end`), recorded in MLflow."""

from __future__ import annotations

import enum


class RunStatus(str, enum.Enum):
    """How a run stands. A str, so it compares, prints and serialises as its value, as a
    run's status always has: ``run.status == "done"``.

    A run is running until it ends, once, in one of four ways::

        running ──► done          every rank returned
                ├─► failed        a rank failed, or the ranks could not be started
                ├─► timed out     the run outlived its timeout
                └─► interrupted   the notebook's stop button (KeyboardInterrupt)

    In the last three, every rank left running was stopped.
    """

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # in a notebook, `run.status` reads as it always has: 'done'
        return repr(self.value)


# The ends of a run that a display shows: one that timed out shows as failed (the
# RunTimeoutError it raised says that it timed out).
SHOWN_ENDS = (RunStatus.DONE, RunStatus.FAILED, RunStatus.INTERRUPTED)


def shown_end(status: RunStatus) -> RunStatus:
    """How a display shows the end of a run that ended in `status`.

    Example:
        >>> shown_end(RunStatus.TIMED_OUT)
        'failed'
    """
    return status if status in SHOWN_ENDS else RunStatus.FAILED
