"""Timeline switches of Horovod's API, and user spans.

    with hvd.timeline_span("forward"):
        output = model(batch)

    hvd.start_timeline("/tmp/trace.json")   # as in Horovod: record from here on
    ...
    hvd.stop_timeline()

In a launched run every rank records into its own buffer and the driver writes the one merged
trace. A script run with plain `python` (a world of one) writes the trace itself on stop.
"""

from __future__ import annotations

import socket
from typing import ContextManager

from ..runtime import context
from ..runtime.timeline import recorder

_standalone_path: str | None = None


def timeline_span(name: str, **args) -> ContextManager:
    """Record the time the `with` body takes as one event in the "user" lane, named `name`
    (a number becomes its text: `timeline_span(3)` names the event "3")."""
    return recorder.span("user", str(name), **args)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording the timeline to `file_path` (Chrome trace format)."""
    global _standalone_path
    if (driver := _driver()) is not None:  # a launched rank: the driver writes the trace
        driver.start_timeline(str(file_path))
    else:
        _standalone_path = str(file_path)
        recorder.enabled = True


def stop_timeline() -> None:
    """Stop recording; everything recorded so far is written (in a plain script: the Chrome
    trace at the path given to `start_timeline` and its columnar copy beside it)."""
    global _standalone_path
    if (driver := _driver()) is not None:
        driver.stop_timeline()
        return
    recorder.enabled = False
    if _standalone_path is not None:
        from ..timeline.columns import TraceFiles

        with TraceFiles(_standalone_path) as trace:
            trace.add_rank(0, socket.gethostname())
            trace.write(0, recorder.drain())
        _standalone_path = None


def _driver() -> "context.DriverLink | None":
    return context.bootstrap.driver if context.bootstrap is not None else None
