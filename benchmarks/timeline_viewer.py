"""How long the timeline viewer takes to load a trace and build its figure.

Writes synthetic traces of 10k, 100k and 1M events with ``TraceWriter`` (4 ranks running
allreduce steps through every lane), then times ``load_trace`` and ``build_figure`` and
measures the figure's JSON, what the browser would receive. Times are the median of
three runs. The target is a 1M-event trace
loaded and built in at most 5 s.

    python benchmarks/timeline_viewer.py            # all sizes
    python benchmarks/timeline_viewer.py 10000      # chosen sizes

Prints a table and writes ``benchmarks/results/timeline_viewer.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddl_magic.trace_writer import TraceWriter
from ddl_magic.ui.timeline_viewer import build_figure, load_trace

SIZES = (10_000, 100_000, 1_000_000)
TARGET_SECONDS_FOR_1M = 5.0
RANKS = 4
STEP_LANES = ("negotiate", "queue", "pack", "scatter_reduce", "allgather", "unpack", "wait")
REPEATS = 3
RESULTS = Path(__file__).parent / "results" / "timeline_viewer.json"


def write_synthetic_trace(path: Path, event_count: int, seed: int = 0) -> None:
    """A trace of about ``event_count`` events: ranks run fused allreduces back to back."""
    rng = np.random.default_rng(seed)
    operations = event_count // (RANKS * len(STEP_LANES))
    tensor_names = [f"layer{i}.weight" for i in range(48)]
    with TraceWriter(path) as trace:
        for rank in range(RANKS):
            trace.add_rank(rank, f"node-{rank // 2}")
        for rank in range(RANKS):
            durations_us = rng.gamma(2.0, 40.0, size=(operations, len(STEP_LANES)))
            gaps_us = rng.exponential(30.0, size=operations)
            clock_us = 1_000_000.0
            batch = []
            for operation in range(operations):
                tensors = tensor_names[operation % 48: operation % 48 + 3]
                nbytes = 4 << 20
                for lane, duration_us in zip(STEP_LANES, durations_us[operation]):
                    args = {"bytes": nbytes, "tensors": tensors, "size": RANKS} \
                        if lane in ("scatter_reduce", "allgather") else {"tensors": tensors}
                    batch.append((lane, f"allreduce #{operation}", clock_us, float(duration_us), args))
                    clock_us += float(duration_us)
                clock_us += float(gaps_us[operation])
                if len(batch) >= 10_000:
                    trace.write(rank, batch)
                    batch = []
            trace.write(rank, batch)


def measure(event_count: int, directory: Path, repeats: int = REPEATS) -> dict[str, float]:
    """Median load, build and total seconds over ``repeats`` runs on one synthetic trace."""
    path = directory / f"synthetic_{event_count}.timeline.json"
    write_synthetic_trace(path, event_count)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        trace = load_trace(path)
        loaded = time.perf_counter()
        figure = build_figure(trace)
        built = time.perf_counter()
        runs.append((loaded - started, built - loaded, built - started))
    load_s, build_s, total_s = (statistics.median(column) for column in zip(*runs))
    return {
        "events": len(trace.events),
        "file_mb": path.stat().st_size / 1e6,
        "load_s": load_s,
        "build_s": build_s,
        "total_s": total_s,
        "total_s_best": min(run[2] for run in runs),
        "repeats": repeats,
        "figure_json_mb": len(figure.to_json()) / 1e6,
        "figure_traces": len(figure.data),
    }


def main(sizes: tuple[int, ...]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = [measure(size, Path(directory)) for size in sizes]
    print(f"{'events':>10} {'file MB':>8} {'load s':>7} {'build s':>8} {'total s':>8} "
          f"{'best s':>7} {'figure MB':>10} {'traces':>7}")
    for r in results:
        print(f"{r['events']:>10,} {r['file_mb']:>8.1f} {r['load_s']:>7.2f} {r['build_s']:>8.2f} "
              f"{r['total_s']:>8.2f} {r['total_s_best']:>7.2f} {r['figure_json_mb']:>10.2f} "
              f"{r['figure_traces']:>7}")
    million = [r for r in results if r["events"] >= 900_000]
    if million:
        verdict = "meets" if million[0]["total_s"] <= TARGET_SECONDS_FOR_1M else "MISSES"
        print(f"1M events: median {million[0]['total_s']:.2f} s, {verdict} the "
              f"{TARGET_SECONDS_FOR_1M:.0f} s target")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "timeline_viewer",
        "target_seconds_for_1M": TARGET_SECONDS_FOR_1M,
        "machine": {"python": platform.python_version(), "processor": platform.processor(),
                    "system": platform.platform(), "cpus": os.cpu_count()},
        "results": results,
    }, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main(tuple(int(arg) for arg in sys.argv[1:]) or SIZES)
