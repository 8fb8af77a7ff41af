"""`ddl_magic.show_timeline`: a run's timeline in the notebook, as a figure that redraws at
full detail when zoomed (`timeline_widget.py`) over its summary (`timeline/analysis.py`);
outside IPython, the summary alone."""

from __future__ import annotations

from typing import Any

from ..timeline.analysis import summary_report
from ..timeline.load import load_trace
from .timeline_figure import DEFAULT_MAX_SHAPES
from .timeline_widget import ZoomableTimeline


def show_timeline(path_or_run: Any, max_shapes: int = DEFAULT_MAX_SHAPES) -> None:
    """Display a run's timeline and its per-rank summary in the notebook.

    Takes a trace file's path, or anything with a ``timeline_path`` attribute (the record
    ``ddl_magic.last_run()`` returns). The figure is a ``ZoomableTimeline``: zooming into a
    window redraws it at full detail. Under it: one line naming the ranks that waited
    longest and shortest, then ``format_summary``'s table. Outside IPython it prints those
    two only. For a static figure, use ``build_figure(load_trace(path))``.

    Example:
        >>> show_timeline("run.timeline.json")              # doctest: +SKIP
        >>> show_timeline(ddl_magic.last_run())             # doctest: +SKIP
    """
    path = getattr(path_or_run, "timeline_path", path_or_run)
    if path is None:
        raise ValueError(
            "this run has no timeline: run it with %%horovod --timeline, "
            "HorovodRunner(np, timeline=PATH) or ddlrun --timeline PATH to record one"
        )
    trace = load_trace(path)
    from IPython import get_ipython
    from IPython.display import display

    text, summary_html = summary_report(trace)
    if get_ipython() is not None:
        display(ZoomableTimeline(trace, max_shapes).widget)
        display({"text/plain": text, "text/html": summary_html}, raw=True)
    else:
        print(text)
