"""The notebook's widgets: the run view (a tab per rank, live), the live timeline lanes, and
the interactive timeline viewer (`show_timeline`).

Which display a run gets is the front-end's choice (`frontends/options.make_display`); the
plain-text display, which needs no notebook, is the driver's (`driver/text_display.py`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunView", "show_timeline"]


def __getattr__(name: str) -> Any:
    # ipywidgets and plotly are slow to import; load them only when asked for.
    if name == "show_timeline":
        from .show_timeline import show_timeline

        return show_timeline
    if name == "RunView":
        from .run_view import RunView

        return RunView
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
