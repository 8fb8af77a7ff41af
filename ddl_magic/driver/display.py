"""What the driver needs from a run's display, whichever it is.

The driver drains the run's event queue on the notebook's main thread and hands each event
to one display, through the same four calls::

    display.display()
    display.handle(event)           # for each event; cheap, changes only Python-side state
    display.refresh()               # at most every ~100 ms, and once at the end
    display.finish(RunStatus.DONE)  # or FAILED, INTERRUPTED: `run_status.shown_end`

The front-end picks the display (`frontends/options.make_display`: the widget run view in a
notebook, rank-prefixed text elsewhere) and gives `Job` a factory for it; a Job given none
prints text (`text_display.TextDisplay`).
"""

from __future__ import annotations

from typing import Protocol

from .events import Event
from .records import RankRecord
from .run_status import RunStatus


class RunDisplay(Protocol):
    def display(self) -> None: ...

    def handle(self, event: Event) -> None: ...

    def refresh(self) -> None: ...

    def finish(self, status: RunStatus) -> None: ...


class DisplayFactory(Protocol):
    def __call__(self, ranks: list[RankRecord], *, quiet: bool, log_dir: str | None, title: str,
                 timeline_path: str | None) -> RunDisplay: ...


def text_display(ranks: list[RankRecord], *, quiet: bool, log_dir: str | None, title: str,
                 timeline_path: str | None) -> RunDisplay:
    """The display of a Job given no other: what ranks print, prefixed with their rank."""
    from .text_display import TextDisplay

    return TextDisplay(ranks, log_dir=log_dir, quiet=quiet)
