"""How long the timeline viewer takes from a trace's path to its figure, and in what memory.

Writes synthetic runs (4 ranks running allreduce steps through every lane) the way the driver
writes a real one, then times ``load_trace`` + ``build_figure`` on them:

- 10k, 100k and 1M events: both files of a run (``TraceFiles``). The viewer reads the
  columnar copy; the same trace read from its Chrome JSON alone is timed beside it, so the
  table shows what the columns buy. Medians of three runs.
- 10M events: the columnar copy only (its JSON would be 1.8 GB), read once in a fresh
  process whose peak resident memory (``ru_maxrss``, summary included) is reported.

"total s" is path to figure; "summary s" is the per-rank summary ``show_timeline`` prints
under it, computed after.

Targets (issue 14): 1M events <= 3 s, 10M events <= 20 s with peak RSS <= 2 GB, and a
figure of at most 1 MB at any size.

A **foreign** trace is one another tool wrote (issue 40: 1M events to figure <= 3 s, peak
RSS <= 1 GB): a Chrome trace object of 1M complete events from 4 processes x 4 threads,
with ``cat``, ``args`` of the profiler's kind and metadata events, written by ``json.dump``
twice, on one line and pretty-printed (``indent=1``), each loaded once in a fresh process.

    python benchmarks/timeline_viewer.py                    # all sizes, and the foreign traces
    python benchmarks/timeline_viewer.py 10000 1000000      # chosen sizes
    python benchmarks/timeline_viewer.py --foreign          # the foreign traces only

Prints a table and writes ``benchmarks/results/timeline_viewer.json``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddl_magic.timeline.columns import ColumnarTraceWriter, TraceFiles, columnar_path
from ddl_magic.timeline.analysis import summarize
from ddl_magic.timeline.load import load_trace
from ddl_magic.ui.timeline_figure import build_figure

SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
JSON_UP_TO = 1_000_000  # larger traces are written in columns only
TARGETS = {"1M_s": 3.0, "10M_s": 20.0, "10M_peak_rss_gb": 2.0, "figure_mb": 1.0,
           "foreign_1M_s": 3.0, "foreign_1M_peak_rss_gb": 1.0}
FOREIGN_EVENTS = 1_000_000
FOREIGN_LAYOUTS = {"one line": None, "pretty-printed": 1}  # json.dump's indent
RANKS = 4
# The lanes a fused hierarchical allreduce records (timeline/lanes.py), here one after the other.
STEP_LANES = ("negotiate", "pack", "shared_memory", "scatter_reduce", "ring_step", "allgather", "unpack")
REPEATS = 3
RESULTS = Path(__file__).parent / "results" / "timeline_viewer.json"


def write_synthetic_run(path: Path, event_count: int, *, chrome_json: bool, seed: int = 0) -> Path:
    """A run of about ``event_count`` events, ranks running fused allreduces back to back,
    written in batches of 10k events as the driver writes them. Returns the path to load."""
    rng = np.random.default_rng(seed)
    operations = event_count // (RANKS * len(STEP_LANES))
    tensor_names = [f"layer{i}.weight" for i in range(48)]
    writer = TraceFiles(path) if chrome_json else ColumnarTraceWriter(columnar_path(path))
    with writer as trace:
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
                for lane, duration_us in zip(STEP_LANES, durations_us[operation].tolist()):
                    args = {"bytes": nbytes, "tensors": tensors, "size": RANKS} \
                        if lane in ("scatter_reduce", "allgather") else {"tensors": tensors}
                    batch.append((lane, f"allreduce #{operation}", clock_us, duration_us, args))
                    clock_us += duration_us
                clock_us += float(gaps_us[operation])
                if len(batch) >= 10_000:
                    trace.write(rank, batch)
                    batch = []
            trace.write(rank, batch)
    return path if chrome_json else columnar_path(path)


def write_foreign_trace(path: Path, event_count: int, indent: int | None, seed: int = 0) -> Path:
    """A profiler-like Chrome trace of ``event_count`` complete events, as ``json.dump`` writes it."""
    rng = np.random.default_rng(seed)
    threads = rng.integers(0, 16, size=event_count).tolist()
    durations = rng.gamma(2.0, 10.0, size=event_count).round(3).tolist()
    gaps = rng.exponential(3.0, size=event_count).round(3).tolist()
    clocks = [1000.0] * 16
    categories = ("kernel", "cpu_op", "python_function", "gpu_memcpy")
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"worker {pid}"}}
                          for pid in range(4)]
    for i, (thread, duration, gap) in enumerate(zip(threads, durations, gaps)):
        events.append({"ph": "X", "cat": categories[thread % 4], "name": f"aten::op_{i % 300}",
                       "pid": thread // 4, "tid": thread % 4, "ts": round(clocks[thread], 3),
                       "dur": duration, "args": {"External id": i, "Sequence number": i // 3}})
        clocks[thread] += duration + gap
    with open(path, "w") as file:
        json.dump({"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms"}, file,
                  indent=indent)
    return path


def measure_foreign(directory: Path) -> list[dict]:
    """Each layout of the foreign trace, loaded once in a fresh process (its peak memory)."""
    results = []
    for layout, indent in FOREIGN_LAYOUTS.items():
        path = write_foreign_trace(directory / "foreign.json", FOREIGN_EVENTS, indent)
        child = subprocess.run([sys.executable, __file__, "--measure-one", str(path)],
                               capture_output=True, text=True, check=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        results.append({"layout": layout, "file_mb": path.stat().st_size / 1e6, **result})
        path.unlink()
    return results


def print_foreign(results: list[dict]) -> None:
    print(f"\nforeign Chrome trace, {FOREIGN_EVENTS:,} events, json.dump'd, fresh process:")
    print(f"{'layout':>15} {'file MB':>8} {'load s':>7} {'build s':>8} {'total s':>8} {'peak GB':>8}")
    for r in results:
        print(f"{r['layout']:>15} {r['file_mb']:>8.0f} {r['columns_load_s']:>7.2f} "
              f"{r['columns_build_s']:>8.2f} {r['columns_total_s']:>8.2f} {r['peak_rss_gb']:>8.2f}")
    for r in results:
        _verdict(f"foreign, {r['layout']}, path to figure", r["columns_total_s"],
                 TARGETS["foreign_1M_s"], "s")
        _verdict(f"foreign, {r['layout']}, peak memory", r["peak_rss_gb"],
                 TARGETS["foreign_1M_peak_rss_gb"], "GB")


def time_to_figure(path: Path) -> tuple[float, float, int, int, float]:
    """Seconds to load and to build, the figure's JSON size in bytes, the event count, and
    the seconds ``summarize`` then takes (what ``show_timeline`` prints under the figure)."""
    started = time.perf_counter()
    trace = load_trace(path)
    loaded = time.perf_counter()
    figure = build_figure(trace)
    built = time.perf_counter()
    summarize(trace)
    summarized = time.perf_counter()
    return loaded - started, built - loaded, len(figure.to_json()), len(trace.events), summarized - built


def measure_in_process(event_count: int, directory: Path) -> dict[str, float]:
    """Median load, build and total seconds on one run, from its columns and from its JSON."""
    path = write_synthetic_run(directory / f"synthetic_{event_count}.timeline.json", event_count,
                               chrome_json=True)
    result: dict[str, float] = {"file_mb": path.stat().st_size / 1e6,
                                "columns_mb": columnar_path(path).stat().st_size / 1e6}
    for source, load_from in (("columns", path), ("json", _json_only(path))):
        runs = [time_to_figure(load_from) for _ in range(REPEATS)]
        result[f"{source}_load_s"] = statistics.median(r[0] for r in runs)
        result[f"{source}_build_s"] = statistics.median(r[1] for r in runs)
        result[f"{source}_total_s"] = statistics.median(r[0] + r[1] for r in runs)
        result[f"{source}_summary_s"] = statistics.median(r[4] for r in runs)
        result["figure_mb"] = runs[0][2] / 1e6
        result["events"] = runs[0][3]
    return result


def measure_in_fresh_process(event_count: int, directory: Path) -> dict[str, float]:
    """One load of a columns-only run, in a child process, with its peak memory."""
    path = write_synthetic_run(directory / f"synthetic_{event_count}.timeline.json", event_count,
                               chrome_json=False)
    child = subprocess.run([sys.executable, __file__, "--measure-one", str(path)],
                           capture_output=True, text=True, check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["columns_mb"] = path.stat().st_size / 1e6
    return result


def _measure_one(path: str) -> None:
    """The child's side: load and build once, print the numbers as one JSON line."""
    load_s, build_s, figure_bytes, events, summary_s = time_to_figure(Path(path))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"events": events, "columns_load_s": load_s, "columns_build_s": build_s,
                      "columns_total_s": load_s + build_s, "columns_summary_s": summary_s, "figure_mb": figure_bytes / 1e6,
                      "peak_rss_gb": peak_kib * 1024 / 1e9}))


def _json_only(path: Path) -> Path:
    """The run's Chrome trace under a name with no columnar copy beside it."""
    alone = path.with_name("json_only_" + path.name)
    if not alone.exists():
        os.link(path, alone)
    return alone


def main(sizes: tuple[int, ...], foreign: bool) -> None:
    results, foreign_results = [], []
    with tempfile.TemporaryDirectory() as directory:
        for size in sizes:
            measure = measure_in_process if size <= JSON_UP_TO else measure_in_fresh_process
            results.append(measure(size, Path(directory)))
            print(f"measured {size:,} events", file=sys.stderr)
        if foreign:
            foreign_results = measure_foreign(Path(directory))
    if foreign_results:
        print_foreign(foreign_results)
    if not results:
        _write_results(results, foreign_results)
        return
    print(f"{'events':>11} {'cols MB':>8} {'load s':>7} {'build s':>8} {'total s':>8} "
          f"{'JSON s':>7} {'speed-up':>9} {'summary s':>10} {'peak GB':>8} {'figure MB':>10}")
    for r in results:
        json_s, peak_gb = r.get("json_total_s"), r.get("peak_rss_gb")
        print(f"{r['events']:>11,} {r['columns_mb']:>8.1f} {r['columns_load_s']:>7.2f} "
              f"{r['columns_build_s']:>8.2f} {r['columns_total_s']:>8.2f} "
              f"{_optional(json_s, '.2f'):>7} "
              f"{_optional(json_s and json_s / r['columns_total_s'], '.1f', 'x'):>9} "
              f"{r['columns_summary_s']:>10.2f} {_optional(peak_gb, '.2f'):>8} {r['figure_mb']:>10.2f}")
    for r in results:
        if r["events"] >= 900_000 and r["events"] < 9_000_000:
            _verdict("1M events, path to figure", r["columns_total_s"], TARGETS["1M_s"], "s")
        if r["events"] >= 9_000_000:
            _verdict("10M events, path to figure", r["columns_total_s"], TARGETS["10M_s"], "s")
            _verdict("10M events, peak memory", r["peak_rss_gb"], TARGETS["10M_peak_rss_gb"], "GB")
    _verdict("largest figure", max(r["figure_mb"] for r in results), TARGETS["figure_mb"], "MB")
    _write_results(results, foreign_results)


def _write_results(results: list[dict], foreign_results: list[dict]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "timeline_viewer",
        "targets": TARGETS,
        "machine": {"python": platform.python_version(), "processor": platform.processor(),
                    "system": platform.platform(), "cpus": os.cpu_count(),
                    "load_average": os.getloadavg()[0]},
        "results": results, "foreign": foreign_results,
    }, indent=2))
    print(f"wrote {RESULTS}")


def _optional(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def _verdict(what: str, value: float, target: float, unit: str) -> None:
    print(f"{what}: {value:.2f} {unit}, {'meets' if value <= target else 'MISSES'} the "
          f"{target:g} {unit} target")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure-one"]:
        _measure_one(sys.argv[2])
    else:
        chosen = tuple(int(arg) for arg in sys.argv[1:] if arg != "--foreign")
        only_foreign = sys.argv[1:] == ["--foreign"]
        main(() if only_foreign else chosen or SIZES, foreign=only_foreign or not chosen)
