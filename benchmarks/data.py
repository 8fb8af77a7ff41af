"""A Spark DataFrame to every rank's training loop: ddl_magic's shares against Petastorm and
Mosaic Streaming, side by side in one run.

    python benchmarks/data.py                       # 1,000,000 rows (long on 2 cores)
    python benchmarks/data.py --rows 100000         # a quicker look
    python benchmarks/data.py --memory-rows 10000000   # adds the 10M-row memory row (very long:
                                                       # 31 GB of rows as shares: 29 GB of disk
                                                       # were used at once here, ~5 minutes;
                                                       # Petastorm beside it, not Mosaic: its
                                                       # reader takes 10M rows at ~10k rows/s)
    python benchmarks/data.py --no-peers            # ours only

The same DataFrame on `local[4]` for every side (`data_frame.py`: a 784-float32 vector and
an int label per row, cached before anything is timed), np 2, batch 256:

- **to the first batch**: from handing the DataFrame over to the first batch on every rank
  (ours: `HorovodRunner(np=2).run(main, train=df)`; Petastorm: `make_spark_converter` +
  `make_torch_dataloader`; Mosaic: `dataframe_to_mds` + `StreamingDataset`);
- **steady rows/s per rank**: the rest of the epoch, a loop that only touches each batch;
- **peak RSS per rank** at `--rows` and at `--memory-rows` (flat: within 10 %);
- **bytes through the driver**: what this Python process read and wrote (`/proc/self/io`:
  its control connection, py4j and anything else) while our run moved the data;
- **MNIST MLP epoch**: one epoch of a 784-128-10 MLP fed by the loader against the same
  rows and batch sizes from tensors already in memory, on each rank (≤ 1.1x).

The peers run in their own virtual environment (`.bench-venv`: Petastorm needs pyarrow < 15
and numpy < 2), as subprocesses of this script (`data_peers.py`):

    python3 -m venv .bench-venv && .bench-venv/bin/pip install torch==2.13.0 && \\
        .bench-venv/bin/pip install petastorm==0.13.1 "pyarrow<15" "numpy<2" "pandas<2.3" \\
        "pyspark>=3.5,<4.1" mosaicml-streaming psutil

Prints the table and writes `benchmarks/results/data.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import print_table, warn_if_busy, write_results
from data_frame import WIDTH, local_spark, make_frame

BATCH_SIZE = 256
NUM_PROC = 2
BENCH_VENV = Path(__file__).resolve().parent.parent / ".bench-venv" / "bin" / "python"


def read_share(train) -> dict:
    """On each rank: the time of its first batch, then the rest of the epoch, touching each."""
    import resource
    import time

    import ddl_magic.torch as hvd

    hvd.init()
    loader = train.loader(batch_size=BATCH_SIZE, columns=["features", "label"], seed=0)
    batches = iter(loader)
    first = next(batches)
    first_at = time.time()
    rows, touched = len(first["label"]), float(first["features"][0, 0])
    began = time.perf_counter()
    for batch in batches:
        touched += float(batch["features"][0, 0])
        rows += len(batch["label"])
    return {"first_at": first_at, "rows": rows - len(first["label"]),
            "steady_s": time.perf_counter() - began,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def ours(frame, rows: int) -> dict:
    from ddl_magic import HorovodRunner

    io_before = _driver_io()
    began = time.time()
    results = HorovodRunner(np=NUM_PROC, driver_log_verbosity="log_callback_only").run(
        _every_rank(read_share), train=frame)
    driver_bytes = _driver_io() - io_before
    return {"first_batch_s": max(r["first_at"] for r in results) - began,
            "rows_per_s": min(r["rows"] / r["steady_s"] for r in results),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "driver_bytes": driver_bytes, "data_bytes": rows * (WIDTH * 4 + 4)}


def mlp_epochs(train) -> dict:
    """On each rank: an epoch of the MNIST MLP fed by the loader, then the same from tensors
    already in memory (the same number of batches of the same size, in a random order)."""
    import time

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    loader = train.loader(batch_size=BATCH_SIZE, columns=["features", "label"], seed=0)

    def step(x, y):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y.long()).backward()
        optimizer.step()

    for batch in loader:  # a warm-up epoch: both sides then run warm
        step(batch["features"], batch["label"])
    hvd.barrier()
    began = time.perf_counter()
    for batch in loader:
        step(batch["features"], batch["label"])
    fed = time.perf_counter() - began
    memory = [batch for batch in loader]
    features = torch.cat([b["features"] for b in memory])
    labels = torch.cat([b["label"] for b in memory])
    hvd.barrier()
    began = time.perf_counter()
    order = torch.randperm(len(labels))
    for start in range(0, len(labels), BATCH_SIZE):
        rows = order[start:start + BATCH_SIZE]
        step(features[rows], labels[rows])
    in_memory = time.perf_counter() - began
    return {"loader_s": fed, "memory_s": in_memory}


def mlp_ratio(rows: int) -> dict:
    import numpy as np
    import pandas as pd

    from ddl_magic import HorovodRunner

    images = np.random.default_rng(0).random((rows, WIDTH), dtype=np.float32)
    frame = pd.DataFrame({"features": list(images), "label": np.arange(rows) % 10})
    results = HorovodRunner(np=-NUM_PROC, driver_log_verbosity="log_callback_only").run(
        _every_rank(mlp_epochs), train=frame)
    loader, memory = max(r["loader_s"] for r in results), max(r["memory_s"] for r in results)
    return {"loader_s": loader, "memory_s": memory, "ratio": loader / memory}


def peer(name: str, rows: int) -> dict:
    if not BENCH_VENV.exists():
        return {"error": f"no {BENCH_VENV.parent.parent.name}: see this script's docstring"}
    script = Path(__file__).with_name("data_peers.py")
    done = subprocess.run([str(BENCH_VENV), str(script), name, "--rows", str(rows)],
                          capture_output=True, text=True, cwd=script.parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:  # it died: how, and the last thing it wrote
        how = (f"killed by signal {-done.returncode}" if done.returncode < 0
               else f"exit status {done.returncode}")
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"error": f"{how}; its last words: {last}"}
    return json.loads(lines[-1])


def _every_rank(function):
    """`function`'s value from every rank (HorovodRunner returns rank 0's)."""
    def gathered(train):
        import ddl_magic.torch as hvd

        return hvd.allgather_object(function(train))

    gathered.__name__ = function.__name__
    return gathered


def _driver_io() -> int:
    with open("/proc/self/io") as io:
        counts = dict(line.split(": ") for line in io.read().splitlines())
    return int(counts["rchar"]) + int(counts["wchar"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--memory-rows", type=int, default=None,
                        help="also measure peak RSS per rank at this many rows (e.g. 10000000)")
    parser.add_argument("--mlp-rows", type=int, default=60_000)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--memory-peers", nargs="*", default=["petastorm"],
                        help="the peers also measured at --memory-rows (default: petastorm)")
    args = parser.parse_args()
    load = warn_if_busy()
    spark = local_spark()
    sizes = [args.rows] + ([args.memory_rows] if args.memory_rows else [])
    results: dict = {"rows": args.rows, "load_average_at_start": load, "sides": {}}
    for rows in sizes:
        frame = make_frame(spark, rows)
        results["sides"].setdefault("ddl_magic", {})[rows] = ours(frame, rows)
        frame.unpersist()
    spark.stop()
    for name in ([] if args.no_peers else ["petastorm", "mosaic"]):
        for rows in (sizes if name in args.memory_peers else sizes[:1]):
            results["sides"].setdefault(name, {})[rows] = peer(name, rows)
    results["mlp"] = mlp_ratio(args.mlp_rows)
    _report(results, sizes)
    path = write_results("data", results)
    print(f"\nwritten to {path}")


def _report(results: dict, sizes: list[int]) -> None:
    rows = sizes[0]
    ours_at = results["sides"]["ddl_magic"][rows]
    table = []
    for name, by_rows in results["sides"].items():
        at = by_rows[rows]
        if "error" in at:
            table.append([name, "-", "-", "-", "-", at["error"][:60]])
            continue
        ratio_first = at["first_batch_s"] / ours_at["first_batch_s"]
        ratio_rate = ours_at["rows_per_s"] / at["rows_per_s"]
        memory = [f"{by_rows[n]['peak_rss_bytes'] / 2**20:.0f}" for n in sizes
                  if "peak_rss_bytes" in by_rows.get(n, {})]
        table.append([name, f"{at['first_batch_s']:.1f}", f"{at['rows_per_s']:,.0f}",
                      " / ".join(memory),
                      "" if name == "ddl_magic" else f"{ratio_first:.2f}x",
                      "" if name == "ddl_magic" else f"{ratio_rate:.2f}x"])
    print_table(f"{rows:,} rows x {WIDTH} float32, np {NUM_PROC}, batch {BATCH_SIZE} "
                "(ratios: theirs / ours for the first batch, ours / theirs for rows/s)",
                ["side", "first batch s", "rows/s per rank",
                 "peak RSS MB (" + " / ".join(f"{n:,}" for n in sizes) + " rows)",
                 "first batch ratio", "rows/s ratio"], table)
    share = ours_at["driver_bytes"] / ours_at["data_bytes"]
    print(f"\nbytes through the driver's Python process: {ours_at['driver_bytes']:,} for "
          f"{ours_at['data_bytes']:,} bytes of data ({100 * share:.3f} %)")
    mlp = results["mlp"]
    print(f"MNIST MLP epoch per rank: fed by the loader {mlp['loader_s']:.2f} s, from tensors "
          f"in memory {mlp['memory_s']:.2f} s: {mlp['ratio']:.2f}x")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
