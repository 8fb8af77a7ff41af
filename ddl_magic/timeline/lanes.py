"""The one table of the timeline's lanes: every lane the runtime records, its row, the kind of
time it records and its colour.

A lane is a short string naming one activity of a rank; each (rank, lane) is one row of the
trace. Everything that treats our lanes differently from any other string reads this table:
the Chrome trace's row order (``chrome.py``) and the columnar file's lane codes
(``columns.py``), the summaries' kinds of time (``analysis.py``, ``live.py``) and the
figure's colours (``ui/timeline_figure.py``). ``tests/test_timeline_lanes.py`` runs real
ranks and checks that what they record is exactly this table: no lane missing, none that
nothing records.

A lane not listed here (a user's, a Horovod timeline's ``NEGOTIATE_ALLREDUCE``) is welcome
too: its row comes after these, its kind of time is told from its name
(``analysis.lane_category``) and its colour is chosen by its name.

Example:
    >>> LANE_BY_NAME["scatter_reduce"].kind
    'communicate'
    >>> LANE_ORDER.index("negotiate") < LANE_ORDER.index("pack")
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["wait", "communicate", "compute", "other"]
"""What a lane's time is spent on; an "other" lane's time is not counted in any of the three."""

KINDS: tuple[Kind, ...] = ("wait", "communicate", "compute")
"""The kinds of time the summaries count, in the order they show them."""


@dataclass(frozen=True)
class Lane:
    """One lane: its ``name`` in the trace, the ``kind`` of time it records and its ``color``
    in every figure of every run (waiting orange, communicating blues and greens, computing
    brown and pink)."""

    name: str
    kind: Kind
    color: str


# Top to bottom, the order an allreduce goes through them (a broadcast beside the ring's
# phases): this fixes their rows. Above each, what records it and when: the conditions are
# why a given run records fewer of them.
LANES: tuple[Lane, ...] = (
    # `hvd.timeline_span(name)` (torch/timeline.py): whatever the user marks, often a whole
    # step; not counted, since the lanes below count the same time again.
    Lane("user", "other", "#78909c"),
    # Every collective, from its submission until every rank has submitted it: waiting for
    # the slowest rank (runtime/op_queue.py).
    Lane("negotiate", "wait", "#fb8c00"),
    # Each negotiation cycle over TCP, "cached" or "coordinated", with the messages, bytes
    # and rounds it cost this rank in its args (runtime/op_queue_tcp.py). Not counted: the
    # negotiate lane counts that time already.
    Lane("negotiation_cycle", "other", "#ffb74d"),
    # An allreduce whose tensors are copied into one buffer (several fused, or one on a GPU):
    # copying them in (runtime/collectives.py).
    Lane("pack", "compute", "#6d4c41"),
    # Ranks that share a host: each collective through shared memory, its kind in args["op"]
    # ("hierarchical allreduce": its ring between hosts is inside it) (runtime/planes/).
    Lane("shared_memory", "communicate", "#3949ab"),
    # The TCP ring's two phases of an allreduce (a reduce-scatter runs the first only); an
    # allgather over the TCP ring is one "allgather" event (runtime/planes/).
    Lane("scatter_reduce", "communicate", "#1e88e5"),
    Lane("allgather", "communicate", "#43a047"),
    # Each step of a ring phase: which chunk went to whom. Not counted: its phase counts
    # that time already.
    Lane("ring_step", "other", "#222a2a"),
    # An allreduce small enough for recursive doubling over the TCP ring's hypercube links
    # instead of the ring's two phases (runtime/planes/ring_plane.py).
    Lane("recursive_doubling", "communicate", "#8e24aa"),
    # A broadcast over the TCP ring (runtime/planes/).
    Lane("broadcast", "communicate", "#00acc1"),
    # The fusion buffer copied back into the tensors a "pack" packed (runtime/collectives.py).
    Lane("unpack", "compute", "#d81b60"),
)

LANE_ORDER: tuple[str, ...] = tuple(lane.name for lane in LANES)
"""The lanes' names in row order."""

LANE_BY_NAME: dict[str, Lane] = {lane.name: lane for lane in LANES}
