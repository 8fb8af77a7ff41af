"""The torch.distributed plane on CPU (gloo standing in for NCCL) against our shared-memory
plane and plain gloo, np 2: the stand-in's price, for correctness runs, not speed.

    python benchmarks/torch_plane.py            # 4 KiB, 1 MiB, 64 MiB; np 2
    python benchmarks/torch_plane.py --sizes 1MiB --iterations 50

Three sides, interleaved and each run twice (the less disturbed run is reported): torch's
gloo alone (`dist.all_reduce`); ours with ``DDL_MAGIC_TORCH_PLANE=gloo`` (our negotiation and
fusion, the bytes through a gloo group: the path CUDA tensors take through NCCL across
hosts); ours as installed on one host (shared memory). Every rank of ours checks that its
run uses the plane its side is named after. Prints a table and writes
``benchmarks/results/torch_plane.json``.
"""

from __future__ import annotations

import argparse
import functools
import time

from allreduce import default_iterations, gloo_sweep, ours_sweep, slowest_per_size
from common import (best_of, format_size, interleaved, parse_size, print_table, run_gloo, run_ours_with,
                    warn_if_busy, write_results)

SIDES = {"ours_gloo": ({"DDL_MAGIC_TORCH_PLANE": "gloo"}, "gloo"), "ours_shm": ({}, "shm")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["4KiB", "1MiB", "64MiB"])
    parser.add_argument("--iterations", type=int, help="timed calls per size (default: by size)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    started, load = time.perf_counter(), warn_if_busy()
    sizes = [parse_size(size) for size in args.sizes]
    kwargs = {"sizes": sizes, "iterations": {n: args.iterations or default_iterations(n) // 2
                                             for n in sizes}}

    def ours(env: dict, transport: str):
        return slowest_per_size(run_ours_with(ours_sweep, 2, dict(kwargs, transport=transport), env=env))

    runs = dict(zip(["gloo", *SIDES], interleaved(
        args.repeats, lambda: slowest_per_size(run_gloo(gloo_sweep, 2, **kwargs)),
        *[functools.partial(ours, env, transport) for env, transport in SIDES.values()])))
    rows = []
    for nbytes in sizes:
        best = {side: best_of([run[nbytes] for run in side_runs]) for side, side_runs in runs.items()}
        rows.append({"bytes": nbytes, **best,
                     "ours_gloo_over_gloo": best["ours_gloo"]["median_s"] / best["gloo"]["median_s"],
                     "ours_gloo_over_shm": best["ours_gloo"]["median_s"] / best["ours_shm"]["median_s"]})
    print_table("allreduce sum float32, np 2: median ms of the slowest rank",
                ["size", "gloo ms", "ours on gloo ms", "ours shm ms", "ours-gloo/gloo", "ours-gloo/shm"],
                [[format_size(row["bytes"]), *(f"{row[side]['median_s'] * 1e3:.3f}" for side in runs),
                  f"{row['ours_gloo_over_gloo']:.2f}", f"{row['ours_gloo_over_shm']:.2f}"] for row in rows])
    path = write_results("torch_plane", {"np": 2, "rows": rows, "repeats": args.repeats,
                                         "load_average_before": load,
                                         "wall_s": time.perf_counter() - started})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
