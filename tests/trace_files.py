"""Reading a run's two trace files back as the same kind of events, to compare them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddl_magic.timeline.columns import columnar_path, read_columnar_trace

Event = tuple[int, str, str, float, float, str]
"""(rank, lane, name, start_us, duration_us, args as sorted JSON)."""


def chrome_events(path: Path) -> list[Event]:
    """The complete events of a Chrome trace written by ``TraceWriter``."""
    document = json.loads(Path(path).read_text())
    return sorted(
        (e["pid"], e["cat"], e["name"], e["ts"], e["dur"], _canonical(e["args"]))
        for e in document["traceEvents"] if e["ph"] == "X"
    )


def columnar_events(path: Path) -> list[Event]:
    """The events of the columnar copy beside the Chrome trace at ``path``, args rebuilt."""
    table, _, _ = read_columnar_trace(columnar_path(path))
    events = []
    for row in table.to_pylist():
        args: dict[str, Any] = json.loads(row["other_args"]) if row["other_args"] else {}
        if row["bytes"] is not None:
            args["bytes"] = row["bytes"]
        if row["world_size"] is not None:
            args["size"] = row["world_size"]
        if row["op"] is not None:
            args["op"] = row["op"]
        if row["tensors"] and row["tensors"] != [args.get("tensor")]:  # not one named as "tensor"
            args["tensors"] = row["tensors"]
        events.append((row["rank"], row["lane"], row["name"], row["start_us"], row["duration_us"],
                       _canonical(args)))
    return sorted(events)


def rank_names_of_chrome_trace(path: Path) -> dict[int, str]:
    document = json.loads(Path(path).read_text())
    return {e["pid"]: e["args"]["name"] for e in document["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def _canonical(args: dict[str, Any]) -> str:
    """Args compared by value: 4096 and 4096.0 alike, as JSON readers take them."""
    return json.dumps({k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                       for k, v in args.items()}, sort_keys=True)
