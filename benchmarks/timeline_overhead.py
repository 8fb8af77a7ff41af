"""What the timeline costs: a training step with it on and off, with the live view on and off,
and the viewer on big traces.

    python benchmarks/timeline_overhead.py            # 4 runs of 16 blocks of 50 steps; 10k..1M events
    python benchmarks/timeline_overhead.py --quick    # 2 runs of 8 blocks of 25 steps; 10k and 100k events

The step is ``train_step.py``'s (MLP 784-512-512-10, batch 64 per rank, SGD through
``hvd.DistributedOptimizer``) on 2 ranks. On a shared 2-core machine separate runs differ by
more than the few per cent looked for, so the two sides alternate inside each run: blocks of
steps with the timeline off and on, in the order off, on, on, off (which also cancels a
steady drift), the timeline switched with ``hvd.start_timeline(path)`` /
``hvd.stop_timeline()`` between blocks. "On" is then what ``--timeline`` does for a whole
run: the runtime records its events, a thread ships them to the driver every 250 ms, and the
driver writes the merged trace while the ranks train. Every step is timed on its own; each
side reports the slowest rank's median, and the overhead is ``on / off - 1``, for each run
and for the steps of all runs together, which is the verdict; the target is at most 3 %.

The live view (the run view's lanes and running summary, what a notebook shows during a
``--timeline`` run) is measured the same way, with recording on throughout: the driver's
display hands the timeline batches to a real ``RunView`` in phases of a few seconds (off, on,
on, off, ...) and drops them in between; each step is counted on the side its phase had
when it began (ranks and driver read the same monotonic clock). Target: at most 1 %. The
table also gives the share of one core the driver spent in the live view while it was on.

The viewer part reuses ``timeline_viewer.py``: synthetic traces of 10k, 100k and 1M events
are loaded and drawn (``load_trace`` + ``build_figure``), median of three.

Prints tables and writes ``benchmarks/results/timeline_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from common import (print_table, run_ours, slowest_rank, spread, summarize, time_iterations, warn_if_busy,
                    write_results)
from timeline_viewer import measure_in_process as measure_viewer
from train_step import BATCH_PER_RANK, LAYERS, in_sync, mlp, sgd, training_step

NP = 2
TARGET_OVERHEAD = 0.03
TARGET_LIVE_VIEW_OVERHEAD = 0.01
LIVE_VIEW_PHASE_S = 5.0
VIEWER_SIZES = (10_000, 100_000, 1_000_000)
QUICK_VIEWER_SIZES = (10_000, 100_000)
BLOCK_ORDER = ("off", "on", "on", "off")
SPREAD_WARNING = 0.25


def warmed_up_training(warmup: int):
    """On a rank: ``train_step.py``'s model, its optimizer through ddl_magic, warmed up."""
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model, hvd.size()), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train_step = training_step(model, optimizer, hvd.rank())
    time_iterations(train_step, hvd.barrier, 0, warmup)
    return model, train_step


def alternating_training(blocks: int, steps_per_block: int, warmup: int, timeline_path: str) -> dict:
    """Train in blocks of steps with the timeline off and on by turns; each side's step times."""
    import ddl_magic.torch as hvd

    model, train_step = warmed_up_training(warmup)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for block in range(blocks):
        side = BLOCK_ORDER[block % len(BLOCK_ORDER)]
        if side == "on":
            hvd.start_timeline(timeline_path)
        times[side] += time_iterations(train_step, hvd.barrier, steps_per_block, 0)
        if side == "on":
            hvd.stop_timeline()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {**times, "weights_checksum": checksum}


def trace_size(path: Path) -> dict:
    """How many complete events a run's trace holds, and its size."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    return {"events": len(events), "file_mb": path.stat().st_size / 1e6}


def measure_training(runs: int, blocks: int, steps_per_block: int, warmup: int, folder: Path) -> dict:
    """Each run's sides and overhead, and the overhead over the steps of every run together."""
    results, all_ranks = [], []
    for run in range(runs):
        path = folder / f"train_step_{run}.timeline.json"
        ranks = run_ours(alternating_training, NP, blocks=blocks, steps_per_block=steps_per_block,
                         warmup=warmup, timeline_path=str(path))
        all_ranks.append(ranks)
        sides = sides_of(ranks)
        trace = trace_size(path)
        per_step = trace["events"] / sides["on"]["iterations"] / NP
        results.append({**sides, "overhead": overhead(sides), "ranks_in_sync": in_sync(ranks),
                        "trace": {**trace, "events_per_step_and_rank": per_step}})
    # Every run's steps pooled per rank: the median then rests on runs x blocks/2 x steps per side.
    pooled = sides_of([{side: [t for ranks in all_ranks for t in ranks[rank][side]] for side in ("off", "on")}
                       for rank in range(NP)])
    return {"runs": results, "pooled": pooled, "overhead": overhead(pooled),
            "meets_target": overhead(pooled) <= TARGET_OVERHEAD}


def sides_of(ranks: list[dict]) -> dict:
    """The slowest rank's step-time summary for each side."""
    return {side: slowest_rank([summarize(rank[side]) for rank in ranks]) for side in ("off", "on")}


def overhead(sides: dict) -> float:
    return sides["on"]["median_s"] / sides["off"]["median_s"] - 1


def print_training(training: dict, blocks: int, steps_per_block: int) -> None:
    rows = [[str(number), f"{run['off']['median_s'] * 1e3:.3f}", f"{run['on']['median_s'] * 1e3:.3f}",
             f"{run['overhead']:+.1%}", f"{spread(run['off']):.0%} / {spread(run['on']):.0%}",
             f"{run['trace']['events_per_step_and_rank']:.1f}", f"{run['trace']['file_mb']:.2f}"]
            for number, run in enumerate(training["runs"], 1)]
    print_table(f"train step, timeline off and on in alternating blocks ({blocks} blocks of {steps_per_block} "
                f"steps per run): MLP {'-'.join(map(str, LAYERS))}, batch {BATCH_PER_RANK} per rank, np={NP}; "
                "slowest rank's median step",
                ["run", "off ms", "on ms", "overhead", "IQR/median off/on", "events/step/rank", "trace MB"],
                rows)
    pooled = training["pooled"]
    verdict = "meets" if training["meets_target"] else "MISSES"
    print(f"all runs' steps together ({pooled['off']['iterations']} per side and rank): off "
          f"{pooled['off']['median_s'] * 1e3:.3f} ms, on {pooled['on']['median_s'] * 1e3:.3f} ms, "
          f"overhead {training['overhead']:+.1%}; target <= {TARGET_OVERHEAD:.0%}: {verdict}")
    for number, run in enumerate(training["runs"], 1):
        if not run["ranks_in_sync"]:
            print(f"WARNING: run {number}: ranks ended with different weights")
        if max(spread(run["off"]), spread(run["on"])) > SPREAD_WARNING:
            print(f"note: run {number} varied: the middle half of its steps spans more than "
                  f"{SPREAD_WARNING:.0%} of the median (a busy machine)")


def steady_training(steps: int, warmup: int) -> dict:
    """Train with the timeline recording throughout; each step's start (monotonic) and time."""
    _, train_step = warmed_up_training(warmup)
    starts, times = [], []
    for _ in range(steps):
        starts.append(time.monotonic())
        started = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - started)
    return {"starts": starts, "times": times}


class AlternatingLiveView:
    """The run's display: a real RunView, given the timeline batches only in "on" phases."""

    def __init__(self, records: list, phase_s: float) -> None:
        from ddl_magic.ui.run_view import RunView

        self.view = RunView(records, "timeline_overhead", None)
        self.phase_s = phase_s
        self.started = time.monotonic()
        self.busy_s = 0.0  # time the driver spent in the live view (taking batches, drawing)

    def side(self, moment: float) -> str:
        return BLOCK_ORDER[int((moment - self.started) / self.phase_s) % len(BLOCK_ORDER)]

    def handle(self, event) -> None:
        from ddl_magic.driver.events import TimelineBatch

        if isinstance(event, TimelineBatch) and self.side(time.monotonic()) == "off":
            return
        started = time.perf_counter()
        self.view.handle(event)
        self.busy_s += time.perf_counter() - started

    def display(self) -> None:
        pass

    def refresh(self) -> None:
        started = time.perf_counter()
        self.view.refresh()
        self.busy_s += time.perf_counter() - started

    def finish(self, status: str) -> None:
        self.view.finish(status)


def measure_live_view(runs: int, steps: int, warmup: int, folder: Path) -> dict:
    """The step with the live view off and on, in alternating phases of each run."""

    from common import run_ours_with

    all_ranks, driver_shares = [], []
    for run in range(runs):
        displays: list[AlternatingLiveView] = []

        def make_display(records, **_options):
            displays.append(AlternatingLiveView(records, LIVE_VIEW_PHASE_S))
            return displays[-1]

        ranks = run_ours_with(steady_training, NP, {"steps": steps, "warmup": warmup},
                              timeline_path=str(folder / f"live_{run}.timeline.json"),
                              display=make_display)
        live = displays[0]
        on_s = (time.monotonic() - live.started) / 2  # half of the phases are "on"
        driver_shares.append(live.busy_s / on_s)
        all_ranks.append([{side: [t for start, t in zip(rank["starts"], rank["times"]) if live.side(start) == side]
                           for side in ("off", "on")} for rank in ranks])
        drawn = live.view.state()["timeline"]
        if drawn is None:
            raise RuntimeError("the live view never drew the lanes: nothing was measured")
    pooled = sides_of([{side: [t for ranks in all_ranks for t in ranks[rank][side]] for side in ("off", "on")}
                       for rank in range(NP)])
    per_run = [{**sides_of(ranks), "overhead": overhead(sides_of(ranks)), "driver_share": share}
               for ranks, share in zip(all_ranks, driver_shares)]
    return {"runs": per_run, "pooled": pooled, "overhead": overhead(pooled),
            "meets_target": overhead(pooled) <= TARGET_LIVE_VIEW_OVERHEAD}


def print_live_view(live: dict, steps: int) -> None:
    rows = [[str(number), f"{run['off']['median_s'] * 1e3:.3f}", f"{run['on']['median_s'] * 1e3:.3f}",
             f"{run['overhead']:+.1%}", f"{run['driver_share']:.1%}"]
            for number, run in enumerate(live["runs"], 1)]
    print_table(f"train step with the timeline recording, live view off and on in alternating "
                f"{LIVE_VIEW_PHASE_S:g} s phases ({steps} steps per run); slowest rank's median step",
                ["run", "off ms", "on ms", "overhead", "driver busy in the view"], rows)
    pooled = live["pooled"]
    verdict = "meets" if live["meets_target"] else "MISSES"
    print(f"all runs' steps together: off {pooled['off']['median_s'] * 1e3:.3f} ms "
          f"({pooled['off']['iterations']} steps), on {pooled['on']['median_s'] * 1e3:.3f} ms "
          f"({pooled['on']['iterations']} steps), overhead {live['overhead']:+.1%}; "
          f"target <= {TARGET_LIVE_VIEW_OVERHEAD:.0%}: {verdict}")


def measure_viewer_sizes(sizes: tuple[int, ...], folder: Path) -> list[dict]:
    results = [measure_viewer(size, folder) for size in sizes]
    rows = [[f"{r['events']:,}", f"{r['columns_mb']:.1f}", f"{r['columns_load_s']:.2f}",
             f"{r['columns_build_s']:.2f}", f"{r['columns_total_s']:.2f}", f"{r['json_total_s']:.2f}",
             f"{r['figure_mb']:.2f}"] for r in results]
    print_table("timeline viewer: load_trace + build_figure on synthetic runs (4 ranks), median of 3",
                ["events", "columns MB", "load s", "build s", "total s", "from JSON s", "figure MB"], rows)
    return results


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()
    with tempfile.TemporaryDirectory() as directory:
        training = measure_training(args.runs, args.blocks, args.steps_per_block, args.warmup, Path(directory))
        print_training(training, args.blocks, args.steps_per_block)
        live_view = measure_live_view(args.runs, args.live_steps, args.warmup, Path(directory))
        print_live_view(live_view, args.live_steps)
        viewer = measure_viewer_sizes(args.sizes, Path(directory))
    path = write_results("timeline_overhead", {
        "settings": {"layers": LAYERS, "batch_per_rank": BATCH_PER_RANK, "np": NP, "runs": args.runs,
                     "blocks": args.blocks, "steps_per_block": args.steps_per_block, "block_order": BLOCK_ORDER,
                     "warmup": args.warmup, "viewer_sizes": args.sizes, "torch_threads_per_rank": 1},
        "training": training, "target_overhead": TARGET_OVERHEAD, "viewer": viewer,
        "live_view": live_view, "target_live_view_overhead": TARGET_LIVE_VIEW_OVERHEAD,
        "live_view_phase_s": LIVE_VIEW_PHASE_S,
        "load_average_before": load_before, "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python benchmarks/timeline_overhead.py --runs 6 --sizes 100000")
    parser.add_argument("--runs", type=int, help="runs, each alternating off and on (default 4, --quick 2)")
    parser.add_argument("--blocks", type=int, help="blocks of steps per run (default 16, --quick 8)")
    parser.add_argument("--steps-per-block", type=int, help="timed steps per block (default 50, --quick 25)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--live-steps", type=int,
                        help="steps per run of the live-view comparison (default 2000, --quick 800)")
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="viewer trace sizes in events (default 10000 100000 1000000; --quick 10000 100000)")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer runs, steps and sizes")
    args = parser.parse_args()
    args.runs = args.runs or (2 if args.quick else 4)
    args.blocks = args.blocks or (8 if args.quick else 16)
    args.steps_per_block = args.steps_per_block or (25 if args.quick else 50)
    args.live_steps = args.live_steps or (800 if args.quick else 2000)
    args.sizes = tuple(args.sizes or (QUICK_VIEWER_SIZES if args.quick else VIEWER_SIZES))
    return args


if __name__ == "__main__":
    main()
