"""What a timeline says, in numbers: per rank, where the time went and how fast the bytes moved.

The viewer summarises before it draws: ``summarize`` says per rank how much time went to
computing, communicating and waiting, and what bus bandwidth the collectives achieved
(numbers, for programs), ``format_summary`` turns that into the table a person reads, and
``summary_report`` into what is shown under the figure. ``lane_category`` says which kind
of time a lane records, ours and Horovod's; ``merge_intervals`` and ``union_length`` are
the interval arithmetic underneath (concurrent events count once), which the live timeline
and the figure use too.

Example:
    >>> from ddl_magic.timeline.analysis import format_summary, summarize
    >>> from ddl_magic.timeline.load import load_trace
    >>> trace = load_trace("run.timeline.json")                # doctest: +SKIP
    >>> summarize(trace)[["communicate_ms", "busy_fraction"]]  # doctest: +SKIP
    >>> format_summary(summarize(trace))                       # doctest: +SKIP
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .lanes import KINDS, LANE_BY_NAME, Kind
from .trace import TraceData

__all__ = ["NOT_MEASURED", "format_percent", "format_summary", "lane_category", "merge_intervals",
           "summarize", "summary_report", "union_length"]

# Bus bandwidth follows NCCL's convention, whatever carried the bytes: each ring phase
# (scatter-reduce, allgather) puts (n-1)/n of the buffer on every link, so a whole allreduce
# moves 2(n-1)/n of it, and a broadcast moves the whole buffer. Ranks that share memory
# record one "shared_memory" event per collective, its kind in ``op``; a hierarchical
# allreduce's span also holds the ring phases it ran between hosts, counted in it already.
_RING_PHASES = ("scatter_reduce", "allgather")
_RING_PHASES_OF_SHARED_MEMORY_OP = {"allreduce": 2, "hierarchical allreduce": 2, "allgather": 1}

# The kinds of time a lane records, as ``lane_category`` names them: the counted ones, then "other".
_KINDS: tuple[Kind, ...] = (*KINDS, "other")

# What the shown summary says for a number the trace did not record.
NOT_MEASURED = "\N{EN DASH}"

# Horovod's top-level operation spans every activity of its tensor, so it is not counted.
_HOROVOD_OPERATIONS = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER",
                       "JOIN", "BARRIER"}
_COLLECTIVE_WORDS = ("ALLREDUCE", "ALLGATHER", "BCAST", "BROADCAST", "REDUCESCATTER",
                     "ALLTOALL")


def lane_category(lane: str) -> Kind:
    """Which kind of time a lane records: "compute", "communicate", "wait" or "other": ours
    as the lane table (``lanes.py``) says, any other (Horovod's) by its name.

    Example:
        >>> lane_category("scatter_reduce"), lane_category("NCCL_ALLREDUCE")
        ('communicate', 'communicate')
        >>> lane_category("NEGOTIATE_ALLREDUCE"), lane_category("MEMCPY_IN_FUSION_BUFFER")
        ('wait', 'compute')
        >>> lane_category("ALLREDUCE")  # Horovod's span around a whole operation
        'other'
    """
    if lane in LANE_BY_NAME:
        return LANE_BY_NAME[lane].kind
    upper = lane.upper()
    if upper == "QUEUE" or upper.startswith(("WAIT_FOR", "NEGOTIATE")):
        return "wait"
    if upper.startswith("MEMCPY") or "FUSION_BUFFER" in upper or upper == "SCHEDULE":
        return "compute"
    if upper not in _HOROVOD_OPERATIONS and any(word in upper for word in _COLLECTIVE_WORDS):
        return "communicate"
    return "other"


def summarize(trace: TraceData, top: int = 3) -> pd.DataFrame:
    """Per rank: where the time went, the achieved bus bandwidth and the slowest tensors.

    The numbers, for programs; ``format_summary`` makes the table shown under the figure.
    Each category's time is the union of its lanes' events (concurrent events count once):
    ``compute_ms`` (packing, unpacking, fusion-buffer copies),
    ``communicate_ms`` (the ring's phases, broadcasts, shared-memory collectives) and
    ``wait_ms`` (negotiating until every rank is ready; in Horovod's timelines also queued
    tensors and waits for data). ``busy_fraction`` is the union of computing and communicating over ``wall_ms``,
    the rank's first event start to last event end. ``bus_bytes`` is what the collectives
    that carry ``bytes`` put on each link (NCCL's convention: (n-1)/n of the buffer per
    scatter-reduce or allgather phase, 2(n-1)/n per allreduce through shared memory, all of
    it per broadcast) and ``bus_gbps`` that over the time they took, in GB/s.
    ``top_tensors`` names the ``top`` tensors whose events in those three kinds of lanes
    took longest in total.

    What a rank did not record is NaN, not 0: a category without a single event of the
    rank's, ``busy_fraction`` without compute or communicate events, ``bus_bytes`` and
    ``bus_gbps`` without an event that says its bytes (Horovod's timelines never do).

    Example:
        >>> summary = summarize(load_trace("run.timeline.json"))   # doctest: +SKIP
        >>> summary.loc[0, ["communicate_ms", "wait_ms", "bus_gbps"]]  # doctest: +SKIP
        communicate_ms    812.4
        wait_ms           120.9
        bus_gbps            9.7
    """
    columns = ["name", "events", "wall_ms", "compute_ms", "communicate_ms", "wait_ms",
               "busy_fraction", "bus_bytes", "bus_gbps", "top_tensors"]
    events = trace.events
    if events.empty:
        return pd.DataFrame(columns=columns).rename_axis("rank")
    category = _per_category(events["lane"], lambda lane: _KINDS.index(lane_category(lane)),
                             _KINDS.index("other"), np.int8)
    start = events["start_us"].to_numpy()
    end = start + events["duration_us"].to_numpy()
    world_size = len(trace.rank_names) or 1
    top_tensors = _top_tensors(events, category != _KINDS.index("other"), top)
    rows = []
    for rank, at in events.groupby("rank", sort=True).indices.items():
        in_category = {kind: at[category[at] == _KINDS.index(kind)] for kind in KINDS}
        busy = np.concatenate([in_category["compute"], in_category["communicate"]])
        wall_us = end[at].max() - start[at].min()
        bus_bytes, bus_us = _bus_traffic(events, at, world_size)
        rows.append({
            "rank": rank,
            "name": trace.rank_names.get(rank, f"rank {rank}"),
            "events": len(at),
            "wall_ms": wall_us / 1000.0,
            **{f"{kind}_ms": union_length(start[i], end[i]) / 1000.0 if len(i) else math.nan
               for kind, i in in_category.items()},
            "busy_fraction": (union_length(start[busy], end[busy]) / wall_us
                              if len(busy) and wall_us > 0 else math.nan),
            "bus_bytes": bus_bytes,
            "bus_gbps": bus_bytes / bus_us / 1000.0 if bus_us > 0 else math.nan,
            "top_tensors": top_tensors.get(rank, ""),
        })
    return pd.DataFrame(rows, columns=["rank", *columns]).set_index("rank")


def format_summary(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as a report to read: what ``show_timeline`` shows under the figure.

    One row per rank, labelled by its name as the figure's rows are ("rank 0 (node-a)"),
    units in the headers, three significant digits (whole numbers from 100 on), and "–"
    for what the trace did not record. Waiting comes right after the rank's wall time, in
    milliseconds and as a share of it: which rank waited most is usually the first
    question. "compute ms" is left out when no rank recorded any. Every cell is text;
    ``summarize`` keeps the numbers.

    Example:
        >>> print(format_summary(summarize(load_trace("run.timeline.json"))).to_string())  # doctest: +SKIP
        rank        wall ms wait ms wait % busy % compute ms communicate ms bus GB/s bus MB ...
        rank 0 (vm)     465     356     76    8.9          –           41.5    0.281   11.7 ...
        rank 1 (vm)     486    45.5    9.3     15          –           73.5    0.159   11.7 ...
    """
    wall = summary["wall_ms"].astype(float)
    table = pd.DataFrame({
        "wall ms": wall.map(_format_number),
        "wait ms": summary["wait_ms"].map(_format_number),
        "wait %": (100.0 * summary["wait_ms"] / wall.where(wall > 0)).map(format_percent),
        "busy %": (100.0 * summary["busy_fraction"]).map(format_percent),
        "compute ms": summary["compute_ms"].map(_format_number),
        "communicate ms": summary["communicate_ms"].map(_format_number),
        "bus GB/s": summary["bus_gbps"].map(_format_number),
        "bus MB": (summary["bus_bytes"] / 1e6).map(_format_number),
        "events": summary["events"].map("{:,}".format),
        "slowest tensors": summary["top_tensors"].replace("", NOT_MEASURED),
    })
    if summary["compute_ms"].isna().all():
        # Ranks that share memory pack inside their collective, so no rank recorded compute
        # time apart from it: a column of dashes would only look like something went wrong.
        table = table.drop(columns="compute ms")
    table.index = pd.Index([_rank_label(rank, name) for rank, name in summary["name"].items()])
    table.columns.name = "rank"
    return table


def summary_report(trace: TraceData) -> tuple[str, str]:
    """What is shown under a trace's figure, as text and as HTML: the line naming who waited
    longest and shortest, then ``format_summary``'s table."""
    summary = summarize(trace)
    headline, table = _waiting_headline(summary), format_summary(summary)
    text, table_html = headline, ""
    if not table.empty:
        # Two spaces between columns at least: pandas' one space runs "wall ms wait ms" together.
        text += "\n" + table.to_string(col_space={column: len(column) + 1 for column in table})
        with pd.option_context("display.max_colwidth", None):  # the whole list of slowest tensors
            table_html = table.to_html(notebook=True)
    return text, f"<p>{html.escape(headline)}</p>{table_html}"


def merge_intervals(
    start: np.ndarray, end: np.ndarray, gap: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge intervals whose gap is at most ``gap``.

    Returns the merged starts and ends, and for each merged interval the position, in
    start-sorted order, of its first input interval (what ``np.add.reduceat`` needs).
    """
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    first = np.flatnonzero(np.concatenate(([True], start[1:] > reach[:-1] + gap)))
    last = np.concatenate((first[1:] - 1, [len(start) - 1]))
    return start[first], reach[last], first


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total time covered by at least one interval."""
    if len(start) == 0:
        return 0.0
    merged_start, merged_end, _ = merge_intervals(start, end, 0.0)
    return float((merged_end - merged_start).sum())


def _bus_traffic(events: pd.DataFrame, at: np.ndarray, default_world_size: int) -> tuple[float, float]:
    """Bytes on the bus and the time they took (µs) for one rank's byte-carrying events.

    The bytes are NaN when none of the events says how many it moved.
    """
    lane_code = events["lane"].cat.codes.to_numpy()[at]
    lane_names = events["lane"].cat.categories

    def lane_is(*names: str) -> np.ndarray:
        return np.isin(lane_code, [lane_names.get_loc(name) for name in names if name in lane_names])

    nbytes = events["bytes"].to_numpy()[at]
    world = events["world_size"].to_numpy()[at]
    world = np.where(np.isnan(world), default_world_size, world)
    one_phase = (world - 1) / world
    is_phase, is_shared_memory = lane_is(*_RING_PHASES), lane_is("shared_memory")
    share = np.where(is_phase, one_phase, np.where(lane_is("broadcast"), 1.0, math.nan))
    op = events["op"].iloc[at]
    phases = _per_category(op, lambda name: _RING_PHASES_OF_SHARED_MEMORY_OP.get(name, math.nan),
                           math.nan, np.float64)
    shared_memory_share = np.where((op == "broadcast").to_numpy(), 1.0, phases * one_phase)
    share = np.where(is_shared_memory, shared_memory_share, share)
    carrying = ~np.isnan(nbytes) & ~np.isnan(share)
    start = events["start_us"].to_numpy()[at]
    end = start + events["duration_us"].to_numpy()[at]
    carrying &= ~_within(start, end, is_phase, carrying & is_shared_memory)
    if not carrying.any():
        return math.nan, 0.0
    return float((nbytes[carrying] * share[carrying]).sum()), union_length(start[carrying], end[carrying])


def _within(start: np.ndarray, end: np.ndarray, inner: np.ndarray, outer: np.ndarray) -> np.ndarray:
    """Which of the ``inner`` intervals lie inside one of the ``outer`` intervals."""
    inside = np.zeros(len(start), dtype=bool)
    if not inner.any() or not outer.any():
        return inside
    outer_start, outer_end, _ = merge_intervals(start[outer], end[outer], 0.0)
    enclosing = np.maximum(np.searchsorted(outer_start, start[inner], side="right") - 1, 0)
    inside[inner] = (outer_start[enclosing] <= start[inner]) & (end[inner] <= outer_end[enclosing])
    return inside


def _rank_label(rank: int, name: str) -> str:
    """The rank's name when it says which rank it is ("rank 0 (node-a)"), else both."""
    return name if re.match(rf"rank {rank}\b", name) else f"rank {rank} · {name}"


def _format_number(value: float) -> str:
    """Three significant digits, whole from 100 on, never in scientific notation."""
    if math.isnan(value):
        return NOT_MEASURED
    if value == 0 or abs(value) >= 99.95:
        return f"{value:,.0f}"
    decimals = 2 - math.floor(math.log10(abs(value)))
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".")


def format_percent(value: float) -> str:
    """Whole percents from 10 on, one decimal below; a share too small to show is "<0.1", not 0."""
    if math.isnan(value):
        return NOT_MEASURED
    if value == 0 or value >= 9.95:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 0.05 else "<0.1"


def _waiting_headline(summary: pd.DataFrame) -> str:
    """One sentence on who waited most and least, the first thing to look for in a summary."""
    if summary.empty:
        return "The timeline holds no events."
    waited = summary["wait_ms"].dropna()
    if waited.empty:
        return "No rank recorded any waiting."

    def label(rank: int) -> str:
        return _rank_label(rank, summary.loc[rank, "name"])

    def waiting(rank: int) -> str:
        wall = summary.loc[rank, "wall_ms"]
        share = (f" ({format_percent(100.0 * waited[rank] / wall)}% of its {_format_number(wall)} ms)"
                 if wall > 0 else "")
        return f"{_format_number(waited[rank])} ms{share}"

    most, least = waited.idxmax(), waited.idxmin()
    if len(waited) == 1:
        return f"{label(most)} waited {waiting(most)}."
    if waited[most] == waited[least]:
        return f"Every rank waited {_format_number(waited[most])} ms."
    return f"Waited longest: {label(most)}, {waiting(most)}; shortest: {label(least)}, {waiting(least)}."


def _top_tensors(events: pd.DataFrame, counted: np.ndarray, top: int) -> dict[int, str]:
    """Per rank, "name 12.3 ms, ..." for the tensors whose ``counted`` events took longest.

    Works through the Arrow list column a chunk at a time, adding each event's duration to
    each of its tensors with one ``bincount`` per chunk, so ten million events need no
    Python object per event.
    """
    if events.empty:
        return {}
    tensors = pa.chunked_array(pa.array(events["tensors"].array))
    ranks, rank_index = np.unique(events["rank"].to_numpy(), return_inverse=True)
    weights = np.where(counted, events["duration_us"].to_numpy(), 0.0)
    dictionary, chunk_codes = _tensor_codes(tensors)
    totals = np.zeros(len(ranks) * max(len(dictionary), 1))
    first_event = 0
    for chunk, codes in zip(tensors.chunks, chunk_codes):
        offsets = chunk.offsets.to_numpy()
        events_of_chunk = slice(first_event, first_event + len(chunk))
        parents = np.repeat(np.arange(len(chunk)), np.diff(offsets))
        keys = rank_index[events_of_chunk][parents] * len(dictionary) + codes[offsets[0]:offsets[-1]]
        totals += np.bincount(keys, weights[events_of_chunk][parents], minlength=len(totals))
        first_event += len(chunk)
    names = dictionary.to_pylist()
    described = {}
    for position, rank in enumerate(ranks):
        per_tensor = totals[position * len(names):(position + 1) * len(names)]
        ranked = [i for i in np.argsort(-per_tensor, kind="stable")[:top] if per_tensor[i] > 0]
        described[int(rank)] = ", ".join(f"{_in_words(names[i])} {_format_number(per_tensor[i] / 1000.0)} ms"
                                         for i in ranked)
    return described


def _in_words(tensor: str) -> str:
    """A fused bucket's name as a reader takes it: the optimizers name a bucket after its
    first tensor and how many others share it ('allreduce.fc.bias+5').

    >>> _in_words("allreduce.fc.bias+5")
    'allreduce.fc.bias (and 5 more tensors fused with it)'
    """
    first, plus, others = tensor.rpartition("+")
    if not (plus and first and others.isdigit()):
        return tensor
    return f"{first} (and {others} more tensor{'s' if others != '1' else ''} fused with it)"


def _tensor_codes(tensors: pa.ChunkedArray) -> tuple[pa.Array, list[np.ndarray]]:
    """One dictionary of tensor names and, per chunk, each listed tensor's code in it.

    The columnar file's chunks hold codes already (each chunk's dictionary extends the last
    one); names read from JSON are encoded here.
    """
    values = [chunk.values for chunk in tensors.chunks]
    if pa.types.is_dictionary(tensors.type.value_type):
        dictionary = max((v.dictionary for v in values), key=len, default=pa.array([], pa.string()))
        return dictionary, [v.indices.to_numpy(zero_copy_only=False) for v in values]
    encoded = pa.chunked_array(values, tensors.type.value_type).dictionary_encode()
    dictionary = encoded.chunks[0].dictionary if encoded.num_chunks else pa.array([], pa.string())
    return dictionary, [c.indices.to_numpy(zero_copy_only=False) for c in encoded.chunks]


def _per_category(values: pd.Series, function: Any, default: Any, dtype: Any) -> np.ndarray:
    """``function`` of each value of a categorical column, computed once per category
    (``default`` where the value is missing), as one array."""
    categorical = values.array
    table = np.array([function(c) for c in categorical.categories] + [default], dtype=dtype)
    return table[categorical.codes]  # the code of a missing value, -1, picks the default
