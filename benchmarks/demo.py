"""How long `python -m ddl_magic demo` takes, from launch to its accuracy line, as a user sees it.

    python benchmarks/demo.py               # 1 cold + 4 warm runs
    python benchmarks/demo.py --quick       # 1 cold + 2 warm runs
    python benchmarks/demo.py --repeats 10

Each run starts ``python -m ddl_magic demo`` (2 local ranks, the Iris MLP, 150 epochs, the
timeline on) as a subprocess, exactly as the README tells a user to, and timestamps every
line it prints, measured from just before the process is started (wall clock). Reported:

- **to accuracy**: launch to the line with ``accuracy:``, the figure the target is about
  (at most 4 s, on 2 local ranks);
- the milestones before it: the demo's first line (Python started and imported ddl_magic),
  the first line of a rank (``[0] ...``: the rank factory started, the ranks forked, connected
  and initialised), and the process's exit (after the accuracy it writes the timeline path);
- **demo's own s**: the seconds the demo prints itself on its accuracy line, which it
  measures from just before ``HorovodRunner.run`` to the result (launching the ranks and
  training, without starting Python and importing ddl_magic).

The first run is reported apart as **cold**, the others as **warm**. Every run is a fresh
process that starts its own rank factory (which imports torch) and its own ranks: nothing is
reused between runs, so "warm" means only that the operating system's file cache already
holds Python, torch and ddl_magic from the run before. The cold run is cold only as far as
this benchmark is concerned: whatever ran before it may have warmed the file cache already.
The subprocess gets ``PYTHONUNBUFFERED=1`` so each line arrives when printed, as on a terminal.

Prints a table and writes ``benchmarks/results/demo.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import print_table, warn_if_busy, write_results

COMMAND = (sys.executable, "-m", "ddl_magic", "demo")
TARGET_S = 4.0
RUN_TIMEOUT_S = 300.0
ACCURACY_LINE = re.compile(r"accuracy: (?P<accuracy>[\d.]+) .*, (?P<seconds>[\d.]+) s\)")
RANK_LINE = re.compile(r"^\[\d+\] ")
REPOSITORY = Path(__file__).resolve().parent.parent


def run_demo_once() -> dict:
    """Start the demo, timestamp its lines; the milestones in seconds since launch.

    A demo that fails (exit code not 0) is still timed up to its accuracy line if it printed
    one; its exit code and last lines are kept, and the table marks the run as failed.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    load = os.getloadavg()[0]
    started = time.perf_counter()
    process = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=REPOSITORY, env=env)
    lines: list[tuple[float, str]] = []
    try:
        for line in process.stdout:
            lines.append((time.perf_counter() - started, line.rstrip("\n")))
            if lines[-1][0] > RUN_TIMEOUT_S:
                raise TimeoutError(f"the demo ran longer than {RUN_TIMEOUT_S:.0f} s")
        exit_code = process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    run = {"exit_code": exit_code, "to_exit_s": time.perf_counter() - started,
           "load_average_at_start": load}
    if exit_code != 0:
        run["last_lines"] = [text for _, text in lines[-4:]]
        print(f"note: run failed, {' '.join(COMMAND[1:])} exited with {exit_code}: "
              + " / ".join(run["last_lines"][-2:]))
    found = [(at, ACCURACY_LINE.search(text)) for at, text in lines if ACCURACY_LINE.search(text)]
    if not found:
        return run
    (at_accuracy, match), rank_lines = found[0], [at for at, text in lines if RANK_LINE.match(text)]
    return {**run, "to_first_line_s": lines[0][0],
            "to_first_rank_line_s": rank_lines[0] if rank_lines else None,
            "to_accuracy_s": at_accuracy, "demo_reported_s": float(match["seconds"]),
            "accuracy": float(match["accuracy"])}


def verdict(meets: bool) -> str:
    return "meets" if meets else "MISSES"


def print_runs(runs: list[dict]) -> None:
    def seconds(run: dict, key: str, digits: int = 2) -> str:
        return "-" if run.get(key) is None else f"{run[key]:.{digits}f}"

    rows = []
    for index, run in enumerate(runs):
        timed = "to_accuracy_s" in run
        outcome = verdict(run["to_accuracy_s"] <= TARGET_S) if timed else "no accuracy line"
        if run["exit_code"] != 0:
            outcome += f", FAILED (exit {run['exit_code']})"
        rows.append([str(index + 1), "cold" if index == 0 else "warm",
                     seconds(run, "to_first_line_s"), seconds(run, "to_first_rank_line_s"),
                     seconds(run, "to_accuracy_s"), seconds(run, "demo_reported_s", 1),
                     seconds(run, "to_exit_s"), seconds(run, "accuracy", 3),
                     f"{run['load_average_at_start']:.1f}", outcome])
    print_table(f"{' '.join(['python', *COMMAND[1:]])}: seconds since launch, wall clock "
                f"(target: accuracy line <= {TARGET_S:g} s)",
                ["run", "kind", "first line", "first rank line", "to accuracy", "demo's own s",
                 "exit", "accuracy", "load", "verdict"], rows)


def summarize_runs(runs: list[dict]) -> dict:
    """Cold: the first run; warm: the median of the others that reached their accuracy line."""
    cold, warm = runs[0], [run for run in runs[1:] if "to_accuracy_s" in run]
    summary = {"target_s": TARGET_S, "failed_runs": sum(run["exit_code"] != 0 for run in runs),
               "cold_to_accuracy_s": cold.get("to_accuracy_s"), "warm_runs_timed": len(warm)}
    if cold.get("to_accuracy_s") is not None:
        summary["cold_meets_target"] = cold["to_accuracy_s"] <= TARGET_S
    if warm:
        for key in ("to_first_line_s", "to_first_rank_line_s", "to_accuracy_s", "demo_reported_s",
                    "to_exit_s"):
            values = [run[key] for run in warm if run.get(key) is not None]
            summary[f"warm_median_{key}"] = statistics.median(values) if values else None
        summary["meets_target"] = summary["warm_median_to_accuracy_s"] <= TARGET_S
    return summary


def print_summary(summary: dict) -> None:
    if "cold_meets_target" in summary:
        print(f"\ncold (first run): {summary['cold_to_accuracy_s']:.2f} s to accuracy "
              f"({verdict(summary['cold_meets_target'])} <= {TARGET_S:g} s)")
    if summary["warm_runs_timed"]:
        print(f"warm (median of {summary['warm_runs_timed']}): "
              f"{summary['warm_median_to_accuracy_s']:.2f} s to accuracy "
              f"({verdict(summary['meets_target'])} <= {TARGET_S:g} s); demo's own "
              f"{summary['warm_median_demo_reported_s']:.1f} s; first rank line at "
              f"{summary['warm_median_to_first_rank_line_s']:.2f} s; exit at "
              f"{summary['warm_median_to_exit_s']:.2f} s")
    if summary["failed_runs"]:
        print(f"note: {summary['failed_runs']} run(s) of the demo failed (see the table's verdicts)")
    print("every run is a fresh process with its own rank factory: warm means only that the "
          "file cache holds Python, torch and ddl_magic")


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()
    runs = [run_demo_once() for _ in range(1 + args.repeats)]
    print_runs(runs)
    summary = summarize_runs(runs)
    print_summary(summary)
    path = write_results("demo", {
        "settings": {"command": " ".join(["python", *COMMAND[1:]]), "warm_runs": args.repeats,
                     "quick": args.quick, "np": 2, "clock": "wall, from just before Popen",
                     "cold_means": "the first run of this benchmark; every run is a fresh process "
                                   "with its own rank factory"},
        "runs": runs, "summary": summary, "load_average_before": load_before,
        "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, help="warm runs after the cold one (default 4)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 warm runs")
    args = parser.parse_args()
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 4)
    return args


if __name__ == "__main__":
    main()
