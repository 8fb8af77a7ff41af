"""ddl_magic's ring allreduce against torch.distributed's gloo, measured in the same run.

    python benchmarks/allreduce.py               # np 2 and 4, 4 KiB .. 64 MiB (about 3 minutes)
    python benchmarks/allreduce.py --quick       # smoke run: np 2, three sizes, few iterations
    python benchmarks/allreduce.py --np 2 --sizes 1MiB 64MiB --iterations 50

Three measurements:

1. allreduce (sum, float32, in place) of one tensor per size, on np ranks of each backend:
   the slowest rank's median time per call, algbw = bytes / time and busbw = algbw * 2(n-1)/n
   (the nccl-tests definitions: busbw is what each link carries, comparable across n);
2. 1000 tensors of 1 KiB per round at np=2: ours submits them all with
   ``hvd.allreduce_async_`` and then synchronizes (the op queue fuses them); gloo makes 1000
   ``dist.all_reduce`` calls;
3. the ceiling: one process streaming to another over TCP loopback with large
   ``sendall`` / ``recv_into`` calls, in GB/s.

Every rank runs one torch thread and times itself; each side runs twice, interleaved with
the other, and its less disturbed run is reported. Prints tables and writes
``benchmarks/results/allreduce.json``.
"""

from __future__ import annotations

import argparse
import functools
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import (best_of, format_size, interleaved, parse_size, print_table, run_gloo, run_ours,
                    slowest_rank, spread, summarize, time_iterations, warn_if_busy, write_results)

SIZES = ("4KiB", "64KiB", "1MiB", "16MiB", "64MiB")
QUICK_SIZES = ("4KiB", "1MiB", "16MiB")
WORLD_SIZES = (2, 4)
SMALL_TENSORS, SMALL_TENSOR_BYTES, SMALL_TENSOR_NP = 1000, 1024, 2
SMALL_TENSORS_TARGET_S = 0.010
TCP_MESSAGE_BYTES, TCP_MESSAGES = 64 << 20, 40
SPREAD_WARNING = 0.25  # flag a measurement whose middle half spans more than 25 % of its median


def target_speedup(nbytes: int, np: int) -> float | None:
    """How many times faster than gloo ours should be (None: no target at this size)."""
    if nbytes <= 1 << 20:
        return 3.0  # time <= 1/3 of gloo's
    if nbytes >= 64 << 20:
        return 1.3 if np == 2 else 1.0  # busbw >= 1.3x gloo at np=2, >= 1x at np=4
    return None


def default_iterations(nbytes: int) -> int:
    """Enough timed calls for a stable median, few enough to keep the full run under 3 minutes."""
    if nbytes <= 64 << 10:
        return 300
    if nbytes <= 1 << 20:
        return 150
    if nbytes <= 16 << 20:
        return 30
    return 15


# ---- what each rank runs -------------------------------------------------------------------

def sweep(allreduce, barrier, rank: int, np: int, sizes: list[int],
          iterations: dict[int, int]) -> dict[int, dict]:
    """Per size: check that `allreduce` sums correctly, then time it in place on zeros.

    Zeros keep the values constant however many times they are summed (ones would double
    until they overflow).
    """
    results = {}
    for nbytes in sizes:
        check_sum(allreduce, rank, np, nbytes)
        step = functools.partial(allreduce, torch.zeros(nbytes // 4), nbytes)
        times = time_iterations(step, barrier, iterations[nbytes],
                                warmup=max(3, iterations[nbytes] // 10))
        results[nbytes] = summarize(times)
    return results


def check_sum(allreduce, rank: int, np: int, nbytes: int) -> None:
    tensor = torch.full((nbytes // 4,), float(rank + 1))
    allreduce(tensor, nbytes)
    expected = np * (np + 1) / 2
    if not bool((tensor == expected).all()):
        raise AssertionError(f"rank {rank}: allreduce of {format_size(nbytes)} gave "
                             f"{tensor.unique()[:5].tolist()}, expected {expected}")


def ours_sweep(sizes: list[int], iterations: dict[int, int]) -> dict[int, dict]:
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()

    def allreduce(tensor, nbytes):
        # A fixed name per size, as a training loop's gradients have: the request cache hits.
        hvd.allreduce_(tensor, op=hvd.Sum, name=f"bench.{nbytes}")

    return sweep(allreduce, hvd.barrier, hvd.rank(), hvd.size(), sizes, iterations)


def gloo_sweep(sizes: list[int], iterations: dict[int, int]) -> dict[int, dict]:
    return sweep(lambda tensor, nbytes: dist.all_reduce(tensor), dist.barrier, dist.get_rank(),
                 dist.get_world_size(), sizes, iterations)


def ours_small_tensors(count: int, nbytes: int, rounds: int) -> dict:
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    tensors = [torch.zeros(nbytes // 4) for _ in range(count)]
    names = [f"small.{i}" for i in range(count)]

    def one_round():
        handles = [hvd.allreduce_async_(tensor, op=hvd.Sum, name=name)
                   for tensor, name in zip(tensors, names)]
        for handle in handles:
            hvd.synchronize(handle)

    return summarize(time_iterations(one_round, hvd.barrier, rounds, warmup=3))


def gloo_small_tensors(count: int, nbytes: int, rounds: int) -> dict:
    tensors = [torch.zeros(nbytes // 4) for _ in range(count)]

    def one_round():
        for tensor in tensors:
            dist.all_reduce(tensor)

    return summarize(time_iterations(one_round, dist.barrier, rounds, warmup=3))


# ---- TCP loopback ceiling -----------------------------------------------------------------

def tcp_loopback(message_bytes: int, messages: int) -> dict:
    """One spawned process streams `messages` buffers to this one; GB/s per received buffer."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(60)  # the sender failed to start if it has not connected by then
        sender = mp.get_context("spawn").Process(
            target=stream_to, args=(listener.getsockname(), message_bytes, messages), daemon=True)
        sender.start()
        connection, _ = listener.accept()
    buffer = memoryview(bytearray(message_bytes))
    times = []
    with connection:
        for _ in range(messages):
            started = time.perf_counter()
            receive_exactly(connection, buffer)
            times.append(time.perf_counter() - started)
    sender.join()
    rates = [message_bytes / seconds / 1e9 for seconds in times[messages // 10:]]  # skip warm-up
    return {"message_bytes": message_bytes, "messages": messages,
            "median_gbps": statistics.median(rates), "min_gbps": min(rates), "max_gbps": max(rates)}


def stream_to(address: tuple[str, int], message_bytes: int, messages: int) -> None:
    buffer = memoryview(bytearray(message_bytes))
    with socket.create_connection(address) as connection:
        for _ in range(messages):
            connection.sendall(buffer)


def receive_exactly(connection: socket.socket, buffer: memoryview) -> None:
    received = 0
    while received < len(buffer):
        count = connection.recv_into(buffer[received:])
        if count == 0:
            raise ConnectionError("the sender closed the stream early")
        received += count


# ---- the driver ---------------------------------------------------------------------------

def compare_allreduce(np: int, sizes: list[int], iterations: dict[int, int],
                      repeats: int) -> list[dict]:
    kwargs = dict(sizes=sizes, iterations=iterations)
    gloo_runs, ours_runs = interleaved(
        repeats,
        lambda: slowest_per_size(run_gloo(gloo_sweep, np, **kwargs)),
        lambda: slowest_per_size(run_ours(ours_sweep, np, **kwargs)))
    return [row_for(np, nbytes, best_of([run[nbytes] for run in gloo_runs]),
                    best_of([run[nbytes] for run in ours_runs])) for nbytes in sizes]


def slowest_per_size(per_rank: list[dict[int, dict]]) -> dict[int, dict]:
    return {nbytes: slowest_rank([results[nbytes] for results in per_rank]) for nbytes in per_rank[0]}


def compare_small_tensors(rounds: int, repeats: int) -> dict:
    kwargs = dict(count=SMALL_TENSORS, nbytes=SMALL_TENSOR_BYTES, rounds=rounds)
    gloo_runs, ours_runs = interleaved(
        repeats,
        lambda: slowest_rank(run_gloo(gloo_small_tensors, SMALL_TENSOR_NP, **kwargs)),
        lambda: slowest_rank(run_ours(ours_small_tensors, SMALL_TENSOR_NP, **kwargs)))
    gloo, ours = best_of(gloo_runs), best_of(ours_runs)
    return {"np": SMALL_TENSOR_NP, "count": SMALL_TENSORS, "bytes": SMALL_TENSOR_BYTES,
            "gloo": gloo, "ours": ours, "target_s": SMALL_TENSORS_TARGET_S,
            "meets_target": ours["median_s"] < SMALL_TENSORS_TARGET_S}


def row_for(np: int, nbytes: int, gloo: dict, ours: dict) -> dict:
    def bandwidth(summary: dict) -> dict:
        algbw = nbytes / summary["median_s"] / 1e9
        return dict(summary, algbw_gbps=algbw, busbw_gbps=algbw * 2 * (np - 1) / np)

    speedup = gloo["median_s"] / ours["median_s"]
    target = target_speedup(nbytes, np)
    return {"np": np, "bytes": nbytes, "gloo": bandwidth(gloo), "ours": bandwidth(ours),
            "speedup": speedup, "target_speedup": target,
            "meets_target": None if target is None else speedup >= target}


def print_allreduce(np: int, rows: list[dict], ceiling_gbps: float) -> None:
    header = ["size", "gloo ms", "ours ms", "gloo busbw", "ours busbw", "ours/gloo time",
              "speed-up", "target", "verdict"]
    table = []
    for row in rows:
        gloo, ours, target = row["gloo"], row["ours"], row["target_speedup"]
        table.append([
            format_size(row["bytes"]), f"{gloo['median_s'] * 1e3:.3f}", f"{ours['median_s'] * 1e3:.3f}",
            f"{gloo['busbw_gbps']:.3f}", f"{ours['busbw_gbps']:.3f}", f"{1 / row['speedup']:.2f}",
            f"{row['speedup']:.2f}x", "-" if target is None else f">={target:.1f}x",
            "-" if target is None else ("meets" if row["meets_target"] else "MISSES"),
        ])
    print_table(f"allreduce sum float32, np={np}: median of the slowest rank; busbw GB/s "
                f"(TCP loopback ceiling {ceiling_gbps:.2f} GB/s)", header, table)


def print_small_tensors(result: dict) -> None:
    gloo, ours = result["gloo"], result["ours"]
    print_table(
        f"{result['count']} x {format_size(result['bytes'])} allreduces per round, np={result['np']}: "
        f"median ms per round of the slowest rank (target: ours < {SMALL_TENSORS_TARGET_S * 1e3:.0f} ms)",
        ["gloo ms", "ours ms", "ours/gloo time", "verdict"],
        [[f"{gloo['median_s'] * 1e3:.2f}", f"{ours['median_s'] * 1e3:.2f}",
          f"{ours['median_s'] / gloo['median_s']:.2f}", "meets" if result["meets_target"] else "MISSES"]])


def warn_about_spread(rows: list[dict], small: dict) -> None:
    measured = [(f"np={r['np']} {format_size(r['bytes'])} {side}", r[side])
                for r in rows for side in ("gloo", "ours")]
    measured += [(f"small tensors {side}", small[side]) for side in ("gloo", "ours")]
    for label, summary in measured:
        if spread(summary) > SPREAD_WARNING:
            print(f"note: {label} varied: middle half of iterations spans {spread(summary):.0%} "
                  f"of the median (rank {summary['rank']})")


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()
    ceiling = tcp_loopback(TCP_MESSAGE_BYTES, args.tcp_messages)
    print(f"TCP loopback, one stream of {format_size(TCP_MESSAGE_BYTES)} sendall/recv_into: "
          f"median {ceiling['median_gbps']:.2f} GB/s (min {ceiling['min_gbps']:.2f}, "
          f"max {ceiling['max_gbps']:.2f})")
    rows = []
    for np in args.np:
        rows_for_np = compare_allreduce(np, args.sizes, args.iterations, args.repeats)
        print_allreduce(np, rows_for_np, ceiling["median_gbps"])
        rows += rows_for_np
    small = compare_small_tensors(args.small_rounds, args.repeats)
    print_small_tensors(small)
    warn_about_spread(rows, small)
    path = write_results("allreduce", {
        "settings": {"sizes": args.sizes, "np": args.np, "iterations": args.iterations,
                     "repeats": args.repeats, "quick": args.quick, "torch_threads_per_rank": 1,
                     "dtype": "float32", "op": "sum", "bandwidth_unit": "GB/s = 1e9 bytes/s"},
        "tcp_loopback": ceiling, "allreduce": rows, "small_tensors": small,
        "load_average_before": load_before, "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    """The command line, with --quick and the defaults resolved into concrete settings."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/allreduce.py --np 2 --sizes 1MiB 64MiB")
    parser.add_argument("--np", type=int, nargs="+", help=f"world sizes (default: {' '.join(map(str, WORLD_SIZES))})")
    parser.add_argument("--sizes", nargs="+", help=f"buffer sizes (default: {' '.join(SIZES)})")
    parser.add_argument("--iterations", type=int, help="timed calls per size (default: 300 at "
                        "<= 64 KiB down to 15 at 64 MiB)")
    parser.add_argument("--small-rounds", type=int,
                        help=f"timed rounds of {SMALL_TENSORS} x 1 KiB (default 25)")
    parser.add_argument("--repeats", type=int,
                        help="runs of each side, interleaved; the least disturbed is reported "
                             "(default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: np 2, sizes 4KiB 1MiB 16MiB, one repeat, a fifth of the "
                             "iterations")
    args = parser.parse_args()
    shrink = 5 if args.quick else 1
    args.np = args.np or ([2] if args.quick else list(WORLD_SIZES))
    args.sizes = [parse_size(size) for size in args.sizes or (QUICK_SIZES if args.quick else SIZES)]
    args.iterations = {nbytes: args.iterations or default_iterations(nbytes) // shrink
                       for nbytes in args.sizes}
    args.small_rounds = args.small_rounds or 25 // shrink
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.tcp_messages = TCP_MESSAGES // shrink
    return args


if __name__ == "__main__":
    main()
