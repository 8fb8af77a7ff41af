"""Launch overhead: the wall time of a trivial cell on 2 ranks, ours against TorchDistributor.

    python benchmarks/launch.py                # 5 runs of each side, interleaved (~2 minutes)
    python benchmarks/launch.py --repeats 2    # smoke run (~1 minute)

The cell is plain torch.distributed code that does nothing but start: ``init_process_group("gloo")``
from torchrun's environment, sum four ones over the ranks, return them. What it costs is what a
notebook user waits for before their own code runs. Five ways to run it on 2 ranks, all in
this process:

1. ours, local: ``ddl_magic.TorchDistributor(num_processes=2, local_mode=True).run(cell)``.
   Its first run is reported apart ("cold"): it starts the rank factory, which imports torch,
   and runs before Spark starts so that nothing else competes with it; the later runs fork
   ranks from the warm factory;
2. ours, on Spark: the same with ``local_mode=False``: two barrier tasks on the active
   local[4] SparkSession, each having its rank forked by the rank factory its Python worker
   keeps. Its first run is reported apart ("cold"): it starts those factories;
3. pyspark's ``TorchDistributor(num_processes=2, local_mode=True)``: torchrun on the driver;
4. ``TorchDistributor(num_processes=2, local_mode=False)``: one barrier task per rank, each
   starting torchrun;
5. a bare barrier job of 2 tasks that return at once: the floor for anything on Spark.

The SparkSession is warmed by one barrier job before anything on Spark is timed. Each side
then runs ``--repeats`` times, interleaved with the others, and the table shows its median.
Targets: ours local (warm) <= 1/3 of TorchDistributor local_mode=True; ours on Spark <= 1/5
of TorchDistributor local_mode=False. Prints a table and writes
``benchmarks/results/launch.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from common import interleaved, print_table, warn_if_busy, write_results

NP = 2
SPARK_MASTER = "local[4]"
TARGET_LOCAL_FRACTION = 1 / 3  # ours local (warm) / TorchDistributor local_mode=True
TARGET_SPARK_FRACTION = 1 / 5  # ours on Spark / TorchDistributor local_mode=False
CELL_EXPECTED = [float(NP)] * 4  # a sum of ones over NP ranks: proves every rank took part


# ---- the cell (module level: TorchDistributor pickles the function) -----------------------

def gloo_cell() -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # torchrun's environment says where and who
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    dist.destroy_process_group()
    return tensor.tolist()


# ---- the sides ---------------------------------------------------------------------------

def timed(run: Callable[[], Any], expected: Any | None) -> dict:
    """{"wall_s": seconds} for one call of `run`, or {"error": ...}; its output is swallowed.

    A side that fails is recorded, not raised: the others still get measured.
    """
    output = io.StringIO()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(output):
            result = run()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}".strip()[:2000],
                "traceback": traceback.format_exc()[-4000:], "output": output.getvalue()[-4000:]}
    wall_s = time.perf_counter() - started
    if expected is not None and result != expected:
        return {"error": f"returned {result!r}, expected {expected!r}"}
    return {"wall_s": wall_s}


def ours(local_mode: bool) -> Callable[[], list[float]]:
    """ddl_magic's drop-in TorchDistributor: the same call, one import changed."""
    def run() -> list[float]:
        from ddl_magic import TorchDistributor

        return TorchDistributor(num_processes=NP, local_mode=local_mode, use_gpu=False).run(gloo_cell)

    return run


def torch_distributor(local_mode: bool) -> Callable[[], list[float]]:
    def run() -> list[float]:
        from pyspark.ml.torch.distributor import TorchDistributor

        return TorchDistributor(num_processes=NP, local_mode=local_mode, use_gpu=False).run(gloo_cell)

    return run


def bare_barrier_job(spark) -> Callable[[], list[int]]:
    def run() -> list[int]:
        return spark.sparkContext.parallelize(range(NP), NP).barrier().mapPartitions(
            lambda partition: [1]).collect()

    return run


def start_spark():
    """A local[4] SparkSession whose Python workers run this Python, quiet on the console."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(SPARK_MASTER).appName("ddl_magic launch benchmark")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# ---- the driver ---------------------------------------------------------------------------

SIDES = (  # key, label in the table
    ("ours_local_cold", "ours local, cold (1st run)"),
    ("ours_local", "ours local, warm"),
    ("torch_distributor_local", "TorchDistributor local_mode=True"),
    ("ours_spark_cold", "ours on Spark, cold (1st run)"),
    ("ours_spark", "ours on Spark, warm"),
    ("torch_distributor_spark", "TorchDistributor local_mode=False"),
    ("bare_barrier", "bare barrier job (floor)"),
)


def summarize_runs(runs: list[dict]) -> dict:
    times = [run["wall_s"] for run in runs if "wall_s" in run]
    errors = [run for run in runs if "error" in run]
    summary: dict[str, Any] = {"runs_s": times, "failures": len(errors)}
    if times:
        summary.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times))
    if errors:
        summary["first_error"] = errors[0]
    return summary


def ratio(results: dict, ours: str, theirs: str, target: float) -> dict:
    mine, other = results[ours].get("median_s"), results[theirs].get("median_s")
    if mine is None or other is None:
        return {"ours": ours, "theirs": theirs, "fraction": None, "target_fraction": target,
                "meets_target": None}
    return {"ours": ours, "theirs": theirs, "fraction": mine / other, "target_fraction": target,
            "meets_target": mine / other <= target}


def print_results(results: dict, ratios: list[dict], repeats: int) -> None:
    target_of = {entry["ours"]: entry for entry in ratios}
    rows = []
    for key, label in SIDES:
        summary = results[key]
        if "median_s" not in summary:
            rows.append([label, "FAILED", "-", "-", "-", "-", "-", "-"])
            continue
        entry = target_of.get(key)
        if entry is None or entry["fraction"] is None:
            vs, target, verdict = "-", "-", "-"
        else:
            vs = f"{entry['fraction']:.3f}"
            target = f"<={entry['target_fraction']:.3f}"
            verdict = "meets" if entry["meets_target"] else "MISSES"
        rows.append([label, str(len(summary["runs_s"])), f"{summary['median_s']:.3f}",
                     f"{summary['min_s']:.3f}", f"{summary['max_s']:.3f}", vs, target, verdict])
    print_table(f"trivial DDP cell on np={NP} (init_process_group, all_reduce of 4 ones, return): wall s per run, "
                f"median of {repeats} interleaved runs; vs = ours / TorchDistributor (same mode)",
                ["side", "runs", "median s", "min s", "max s", "vs TD", "target", "verdict"], rows)
    for key, label in SIDES:
        error = results[key].get("first_error")
        if error:
            print(f"note: {label} failed {results[key]['failures']} time(s): {error['error']}")


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()

    # Cold first, with nothing else started yet: the rank factory imports torch during it.
    cold = timed(ours(local_mode=True), CELL_EXPECTED)
    loads = {"before": load_before, "after_cold_run": os.getloadavg()[0]}

    spark = start_spark()
    floor = bare_barrier_job(spark)
    warmup = timed(floor, [1] * NP)
    loads["after_spark_start"] = os.getloadavg()[0]
    spark_cold = timed(ours(local_mode=False), CELL_EXPECTED)  # the workers' factories start

    measured = interleaved(
        args.repeats,
        lambda: timed(ours(local_mode=True), CELL_EXPECTED),
        lambda: timed(torch_distributor(local_mode=True), CELL_EXPECTED),
        lambda: timed(ours(local_mode=False), CELL_EXPECTED),
        lambda: timed(torch_distributor(local_mode=False), CELL_EXPECTED),
        lambda: timed(floor, [1] * NP),
    )
    loads["after_measurements"] = os.getloadavg()[0]
    results = {"ours_local_cold": summarize_runs([cold]),
               "ours_spark_cold": summarize_runs([spark_cold])}
    warm_sides = [key for key, _ in SIDES if key not in results]
    results.update({key: summarize_runs(runs) for key, runs in zip(warm_sides, measured)})
    ratios = [ratio(results, "ours_local", "torch_distributor_local", TARGET_LOCAL_FRACTION),
              ratio(results, "ours_spark", "torch_distributor_spark", TARGET_SPARK_FRACTION)]
    print_results(results, ratios, args.repeats)
    print(f"load average (1 min) on {os.cpu_count()} CPUs: "
          + ", ".join(f"{moment.replace('_', ' ')} {load:.2f}" for moment, load in loads.items()))

    path = write_results("launch", {
        "settings": {"np": NP, "repeats": args.repeats, "spark_master": SPARK_MASTER,
                     "driver_log_verbosity": "log_callback_only",
                     "targets": {"ours_local / torch_distributor_local": TARGET_LOCAL_FRACTION,
                                 "ours_spark / torch_distributor_spark": TARGET_SPARK_FRACTION}},
        "spark_warmup_job": warmup, "results": results, "ratios": ratios,
        "load_average": loads, "wall_s": time.perf_counter() - started,
    })
    spark.stop()
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/launch.py --repeats 3")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of each side after the cold one, interleaved (default 5)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
