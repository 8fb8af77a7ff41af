"""How a run shows itself: the run view widget in a notebook, rank-prefixed text elsewhere.

The driver drains the run's event queue on the notebook's main thread and hands each event
to one display, through the same four calls whichever display it is::

    display = make_display(ranks, log_dir=log_dir, title="%%horovod -np 4")
    display.display()
    display.handle(event)      # for each event; cheap, changes only Python-side state
    display.refresh()          # at most every ~100 ms, and once at the end
    display.finish("done")     # or "failed" / "interrupted"
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from ..events import Event
from ..rank_record import RankRecord
from .run_view import RunView
from .text_display import TextDisplay

__all__ = ["RunDisplay", "RunView", "TextDisplay", "make_display", "show_timeline", "shows_run_view"]

DISPLAY_ENV = "DDL_MAGIC_DISPLAY"


class RunDisplay(Protocol):
    """What the driver needs from a display."""

    def display(self) -> None: ...

    def handle(self, event: Event) -> None: ...

    def refresh(self) -> None: ...

    def finish(self, status: str) -> None: ...


def make_display(ranks: "int | list[RankRecord]", *, quiet: bool = False, log_dir: str | None = None,
                 title: str = "", timeline_path: str | None = None) -> RunDisplay:
    """The display for a run: ``RunView`` in a Jupyter kernel, else ``TextDisplay``.

    ``ranks`` is the run's list of `RankRecord`, which the driver keeps and the display
    renders, or a number of ranks for a display that keeps its own from the events.

    Set ``DDL_MAGIC_DISPLAY=text`` to get the text display in a kernel too (frontends that do
    not render widgets). ``quiet`` prints only failures and the closing line, in any setting.
    ``timeline_path``, for a run that records one, is where the run view reads the finished
    run's timeline from, to draw it in its own figure.

    Example::

        display = make_display(4, log_dir="/tmp/ddl_magic/run-1", title="%%horovod -np 4")
    """
    if quiet:
        return TextDisplay(ranks, log_dir=log_dir, quiet=True)
    if shows_run_view():
        return RunView(ranks, title, log_dir, timeline_path=timeline_path)
    return TextDisplay(ranks, log_dir=log_dir)


def shows_run_view() -> bool:
    """Whether a (not quiet) run shows as the widget run view here, which draws the run's
    timeline itself: in a Jupyter kernel, unless ``DDL_MAGIC_DISPLAY=text``."""
    choice = os.environ.get(DISPLAY_ENV, "")
    if choice not in ("", "text"):
        raise ValueError(f"{DISPLAY_ENV}={choice!r} is not understood: set it to 'text' or unset it")
    return choice != "text" and _in_jupyter_kernel()


def _in_jupyter_kernel() -> bool:
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def __getattr__(name: str) -> Any:
    # The timeline viewer imports plotly, which is slow to import; load it only when asked for.
    if name == "show_timeline":
        from .show_timeline import show_timeline

        return show_timeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
