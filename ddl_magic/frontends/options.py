"""Choices every front-end makes the same way: which display a run gets."""

from __future__ import annotations

import os

from ..driver.display import RunDisplay
from ..driver.records import RankRecord
from ..driver.text_display import TextDisplay

DISPLAY_ENV = "DDL_MAGIC_DISPLAY"


def make_display(ranks: list[RankRecord], *, quiet: bool = False, log_dir: str | None = None,
                 title: str = "", timeline_path: str | None = None) -> RunDisplay:
    """The display for a run: the widget run view in a Jupyter kernel, else text.

    ``ranks`` is the run's list of `RankRecord`, which the driver keeps and the display
    renders.

    Set ``DDL_MAGIC_DISPLAY=text`` to get the text display in a kernel too (frontends that do
    not render widgets). ``quiet`` prints only failures and the closing line, in any setting.
    ``timeline_path``, for a run that records one, is where the run view reads the finished
    run's timeline from, to draw it in its own figure.

    Example::

        display = make_display(new_records(4), log_dir="/tmp/ddl_magic/run-1", title="%%horovod -np 4")
    """
    if quiet:
        return TextDisplay(ranks, log_dir=log_dir, quiet=True)
    if shows_run_view():
        from ..ui.run_view import RunView  # ipywidgets load only where a widget is shown

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
