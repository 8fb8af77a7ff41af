"""What the communication benchmarks share: starting ranks, timing inside them, reporting.

Both sides of a comparison run the same rank function shape, started two ways:

- ``run_ours(fn, np, **kwargs)``: ranks started by ddl_magic's own launcher (``Job`` with a
  ``LocalLauncher``), as ``ddlrun`` would; ``fn`` calls ``hvd.init()`` itself
  (``run_ours_with`` also sets environment variables on the ranks, e.g. the transport, and
  can record a timeline);
- ``run_gloo(fn, np, **kwargs)``: ranks spawned with ``torch.multiprocessing``, each joining a
  ``torch.distributed`` gloo group on 127.0.0.1 before ``fn`` runs.

Every rank uses one torch thread and the memory allocator settings of ddl_magic's ranks
(``rank/allocator.py``; the gloo ranks set them too), and times itself: after a barrier it
times each iteration on its own, and the report takes the slowest rank's median
(``slowest_rank``). Comparisons
are repeated with the sides interleaved (``interleaved``), and the least disturbed repeat of
each side is reported (``best_of``): the machine may be shared with other work.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import queue
import socket
import statistics
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddl_magic.rank import allocator

RESULTS_DIR = Path(__file__).parent / "results"
RANK_TIMEOUT_S = 300.0  # a gloo rank that takes longer than this is taken to be hung

# Both launchers run ranks with one OpenMP thread; set here so gloo's spawned ranks inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "B": 1}


def parse_size(text: str) -> int:
    """'64KiB' -> 65536; plain numbers are bytes.

    >>> parse_size("16MiB"), parse_size("4096")
    (16777216, 4096)
    """
    upper = text.strip().upper()
    for unit, factor in _UNITS.items():
        if upper.endswith(unit):
            return int(float(upper[:-len(unit)]) * factor)
    return int(upper)


def format_size(nbytes: int) -> str:
    """65536 -> '64 KiB'."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


# ---- starting ranks ----------------------------------------------------------------------

def run_ours(fn: Callable[..., Any], np: int, **kwargs) -> list[Any]:
    """Run `fn(**kwargs)` on `np` ranks started by ddl_magic's launcher; every rank's return value."""
    return run_ours_with(fn, np, kwargs)


def run_ours_with(fn: Callable[..., Any], np: int, kwargs: dict[str, Any],
                  env: dict[str, str] | None = None, timeline_path: str | None = None,
                  display: Callable[..., Any] | None = None) -> list[Any]:
    """`run_ours`, with environment variables set on every rank before `fn` runs, and a timeline.

    `env` reaches the ranks before ``hvd.init()`` (``JobOptions.env``), so it can choose the
    transport, e.g. ``{"DDL_MAGIC_TRANSPORT": "tcp"}``; `timeline_path` records every rank's
    timeline into one Chrome trace there; `display` makes the run's display (`JobOptions.display`).

    >>> run_ours_with(fn, 2, {"sizes": [4096]}, env={"DDL_MAGIC_TRANSPORT": "tcp"})  # doctest: +SKIP
    """
    from ddl_magic.driver.job import Job, JobOptions
    from ddl_magic.launch.local import LocalLauncher
    from ddl_magic.wire.tasks import FunctionTask

    job = Job(FunctionTask(fn, kwargs), np, LocalLauncher(),
              JobOptions(timeout_s=RANK_TIMEOUT_S, hide_output=True, return_all=True,
                         env=dict(env or {}), timeline_path=timeline_path,
                         **({"display": display} if display else {})))
    closing_lines = io.StringIO()  # "==== done: ..." after every run would break up the tables
    try:
        with contextlib.redirect_stdout(closing_lines):
            return job.run().results
    except BaseException:
        print(closing_lines.getvalue(), end="")
        raise


def init_rank_using(transport: str) -> None:
    """hvd.init() on one torch thread; refuse to measure if the run moves data another way."""
    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context

    torch.set_num_threads(1)
    hvd.init()
    used = context.current("benchmark").transport
    if used != transport:
        raise RuntimeError(f"rank {hvd.rank()}: this side measures transport {transport!r}, but "
                           f"the run uses {used!r}")


def run_gloo(fn: Callable[..., Any], np: int, **kwargs) -> list[Any]:
    """Run `fn(**kwargs)` on `np` spawned ranks in one gloo process group; every rank's return value.

    `fn` must be importable by the spawned processes (a module-level function). A rank that
    raises stops the others, and its traceback becomes this function's error.
    """
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_gloo_rank, args=(rank, np, port, fn, kwargs, results),
                                 daemon=True) for rank in range(np)]
    for process in processes:
        process.start()
    try:
        return _collect_rank_results(results, np)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _gloo_rank(rank: int, np: int, port: int, fn, kwargs: dict, results: mp.Queue) -> None:
    try:
        # The memory allocator ddl_magic's ranks run with (`rank/allocator.py`): a comparison
        # is of the runtimes, not of how often glibc hands tensors' pages back to the kernel.
        allocator.keep_freed_memory()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=np)
        value = fn(**kwargs)
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _collect_rank_results(results: mp.Queue, np: int) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while len(values) < np:
        try:
            rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            missing = sorted(set(range(np)) - values.keys())
            raise TimeoutError(
                f"gloo ranks {missing} did not finish within {RANK_TIMEOUT_S:.0f} s") from None
        if not ok:
            raise RuntimeError(f"gloo rank {rank} failed:\n{value}")
        values[rank] = value
    return [values[rank] for rank in range(np)]


# ---- timing inside a rank ----------------------------------------------------------------

def time_iterations(step: Callable[[], Any], barrier: Callable[[], Any], iterations: int,
                    warmup: int) -> list[float]:
    """Seconds taken by each of `iterations` calls of `step`, after `warmup` untimed calls.

    The barriers line the ranks up so that no rank's first timed iteration includes waiting
    for a neighbour that is still warming up.
    """
    barrier()
    for _ in range(warmup):
        step()
    barrier()
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def summarize(times: list[float]) -> dict[str, float]:
    """Median and quartiles of one rank's per-iteration times, in seconds."""
    p25, median, p75 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {"median_s": median, "p25_s": p25, "p75_s": p75, "iterations": len(times)}


def slowest_rank(summaries: list[dict[str, float]]) -> dict[str, float]:
    """The summary of the rank with the largest median: a collective is as fast as its slowest rank."""
    slowest = max(range(len(summaries)), key=lambda rank: summaries[rank]["median_s"])
    return dict(summaries[slowest], rank=slowest)


def interleaved(repeats: int, *measurements: Callable[[], Any]) -> list[list[Any]]:
    """Run the measurements `repeats` times in turn (a, b, a, b, ...); each one's results.

    On a machine shared with other work, a burst of load then hits every side alike.
    """
    results: list[list[Any]] = [[] for _ in measurements]
    for _ in range(repeats):
        for measurement, collected in zip(measurements, results):
            collected.append(measurement())
    return results


def best_of(summaries: list[dict[str, float]]) -> dict[str, float]:
    """The repeat with the smallest median: the one least disturbed by other processes."""
    best = min(summaries, key=lambda summary: summary["median_s"])
    return dict(best, repeat_medians_s=[summary["median_s"] for summary in summaries])


def spread(summary: dict[str, float]) -> float:
    """Interquartile range relative to the median: 0.1 means the middle half lies within 10 %."""
    return (summary["p75_s"] - summary["p25_s"]) / summary["median_s"]


# ---- reporting ---------------------------------------------------------------------------

def warn_if_busy() -> float:
    """Print a note when other processes already load the machine; returns the 1-minute load."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} before starting on {os.cpu_count()} CPUs: other "
              "processes compete with the ranks, expect slower and noisier numbers")
    return load


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A right-aligned text table under `title`."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write `payload` with the machine's description to ``results/<name>.json``."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": name,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "system": platform.platform(),
                    "load_average_at_end": os.getloadavg()[0]},
        **payload,
    }
    path.write_text(json.dumps(document, indent=2))
    return path


def parse_step_timing_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse `parser`'s arguments plus --steps, --warmup, --repeats and --quick, the options
    every benchmark that times training steps takes, with their defaults filled in."""
    parser.add_argument("--steps", type=int, help="timed steps per run (default 300, --quick 50)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--repeats", type=int,
                        help="runs of each side, interleaved; the least disturbed is reported "
                             "(default 2, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 50 timed steps, one repeat")
    args = parser.parse_args()
    args.steps = args.steps or (50 if args.quick else 300)
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args
