"""A run's timeline: the lanes the runtime records, the files it is written to, and what they say.

    lanes.py        the one table of lanes: their rows, kinds of time and colours
    chrome.py       the merged Chrome trace the driver writes, valid JSON at every moment
    columns.py      the same events in columns (an Arrow IPC stream), and reading them back
    json_reader.py  reading a JSON trace (ours, Horovod's) a chunk at a time
    trace.py        a timeline once read: ``TraceData``, a table of events
    load.py         ``load_trace``: any of those files into a ``TraceData``
    analysis.py     ``summarize``: per rank, where the time went and the bus bandwidth
    live.py         ``LiveTimeline``: a running summary of a run's batches while it trains

The recorder that sits on the collectives' hot path is `runtime/timeline.py`; the figure and
the widgets that draw a timeline are `ui/`'s. A rank imports only what writes the files
(`columns.py` and what it imports, when a plain script stops its timeline): none of those
import pandas or plotly, and this file imports nothing, so that stays true.

Example:
    >>> from ddl_magic.timeline.analysis import summarize
    >>> from ddl_magic.timeline.load import load_trace
    >>> summarize(load_trace("run.timeline.json"))      # doctest: +SKIP
"""
