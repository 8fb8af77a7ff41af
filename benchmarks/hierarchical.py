"""Hierarchical allreduce against the flat ring, on 2 simulated hosts of 2 ranks each.

    python benchmarks/hierarchical.py            # 1 MiB and 64 MiB, 2 runs of each side
    python benchmarks/hierarchical.py --quick    # smoke run: one run of each side, few iterations
    python benchmarks/hierarchical.py --sizes 4MiB --iterations 20

Four ranks on this machine are told they live on hosts "a,b,a,b" (``DDL_MAGIC_TEST_HOSTS``,
set here before the first launch; every rank inherits it), and allreduce one float32 tensor
(sum, in place, a fixed name) per size, two ways, interleaved (hierarchical, flat,
hierarchical, flat):

- **hierarchical**, the default: reduce-scatter in shared memory within each host, a TCP
  ring across hosts per local rank on that rank's 1/local_size part, allgather within the
  host (the ranks report transport "shm+tcp");
- **flat**: ``HOROVOD_HIERARCHICAL_ALLREDUCE=0``, one TCP ring of all four ranks, ordered
  host by host (a, a, b, b: transport "tcp").

Each run records the timeline (``JobOptions(timeline_path=...)``; both sides alike). The time
per allreduce is what the ranks measure themselves, the slowest rank's median. The bytes
that crossed between hosts are **measured**, from the trace: every ``ring_step`` event
says how many bytes its rank (``pid``) sent (``args.sent_bytes``) to which rank
(``args.to``); the bytes whose sender and receiver are on different simulated hosts are
summed, and divided by the allreduces of the run (counted in the trace too, and checked
against what the ranks ran). Next to them, what the algorithms say, with N ranks, H hosts,
L = N / H ranks per host and K bytes per tensor:

- flat ring ordered by host: H links cross between hosts, each carrying 2(N-1)/N * K;
- hierarchical: every rank's cross-host ring carries its K/L part: each of the N ranks sends
  2(H-1)/H * K/L to the other host(s).

Hence "hierarchical sends 1/local_size of the bytes across hosts" is judged two ways: per
host-crossing link (hierarchical / flat = (H-1)N / (H(N-1)L), at most 1/L) and in total
over all links (= (H-1)N / (H(N-1)), L times the per-link ratio: hierarchical uses N crossing
links where the flat ring uses H).

Prints tables and writes ``benchmarks/results/hierarchical.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from common import (best_of, format_size, init_rank_using, interleaved, parse_size, print_table, run_ours_with,
                    slowest_rank, spread, summarize, time_iterations, warn_if_busy, write_results)

HOSTS = ("a", "b", "a", "b")  # the simulated host of each rank
TEST_HOSTS_VARIABLE = "DDL_MAGIC_TEST_HOSTS"
SIDES = ("hierarchical", "flat")
# Both sides cross hosts by the ring, whose steps the trace records with their bytes: left to
# the cost model, a small part's cross-host step is recursive doubling, which records none.
RING = {"DDL_MAGIC_ALLREDUCE_ALGORITHM": "ring"}
SIDE_ENV = {"hierarchical": RING, "flat": {**RING, "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}}
SIDE_TRANSPORT = {"hierarchical": "shm+tcp", "flat": "tcp"}
SIZES = ("1MiB", "64MiB")
SPREAD_WARNING = 0.25


def default_iterations(nbytes: int) -> int:
    return 100 if nbytes <= 1 << 20 else 30 if nbytes <= 16 << 20 else 10


# ---- what each rank runs -------------------------------------------------------------------

def rank_allreduces(nbytes: int, iterations: int, transport: str) -> dict:
    """Check the sum, then time `iterations` in-place allreduces of `nbytes`; how many ran."""
    import ddl_magic.torch as hvd

    init_rank_using(transport)
    name = f"bench.{nbytes}"
    tensor = torch.full((nbytes // 4,), float(hvd.rank() + 1))
    hvd.allreduce_(tensor, op=hvd.Sum, name=name)
    expected = hvd.size() * (hvd.size() + 1) / 2
    if not bool((tensor == expected).all()):
        raise AssertionError(f"rank {hvd.rank()}: allreduce of {format_size(nbytes)} gave "
                             f"{tensor.unique()[:5].tolist()}, expected {expected}")
    tensor.zero_()  # zeros stay zeros however often they are summed
    warmup = max(2, iterations // 10)
    times = time_iterations(lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=name), hvd.barrier,
                            iterations, warmup)
    return {**summarize(times), "allreduces": 1 + warmup + iterations,
            "host": HOSTS[hvd.rank()], "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}


# ---- reading the trace ---------------------------------------------------------------------

def cross_host_traffic(trace_path: Path, tensor_name: str) -> dict:
    """Bytes sent between different simulated hosts, per link and in total, from `ring_step` events.

    Also counts the allreduces the trace holds: rank 0's negotiations of the tensor (the
    hierarchical allreduce runs its cross-host ring once per shared-memory segment, so ring
    phases are more than one per allreduce there).
    """
    events = json.loads(trace_path.read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    per_link: Counter[tuple[int, int]] = Counter()
    all_sent = 0
    for event in events:
        if event["ph"] == "X" and event.get("cat") == "ring_step":
            sender, receiver = event["pid"], event["args"]["to"]
            all_sent += event["args"]["sent_bytes"]
            if HOSTS[sender] != HOSTS[receiver]:
                per_link[(sender, receiver)] += event["args"]["sent_bytes"]
    allreduces = sum(1 for e in events if e["ph"] == "X" and e["pid"] == 0 and e["name"] == tensor_name
                     and lanes.get((e["pid"], e["tid"])) == "negotiate")
    return {"cross_host_bytes": sum(per_link.values()), "ring_bytes_sent": all_sent,
            "per_link_bytes": {f"{s}->{r}": b for (s, r), b in sorted(per_link.items())},
            "allreduces_in_trace": allreduces, "events": len(events)}


def expected_cross_host(side: str, nbytes: int, np: int, hosts: int) -> dict:
    """What the algorithm should send between hosts per allreduce: per crossing link and in total."""
    local = np // hosts
    if side == "flat":
        per_link, links = 2 * (np - 1) / np * nbytes, hosts
        formula = "H links x 2(N-1)/N*K"
    else:
        per_link, links = 2 * (hosts - 1) / hosts * nbytes / local, np
        formula = "N ranks x 2(H-1)/H*K/L"
    return {"per_link_bytes": per_link, "links": links, "total_bytes": per_link * links,
            "formula": formula}


# ---- the driver ---------------------------------------------------------------------------

def measure_side(side: str, nbytes: int, iterations: int, folder: Path) -> dict:
    """One run of one side at one size, with the timeline on: timings and cross-host bytes."""
    trace = folder / f"{side}_{nbytes}.timeline.json"
    ranks = run_ours_with(rank_allreduces, len(HOSTS),
                          dict(nbytes=nbytes, iterations=iterations, transport=SIDE_TRANSPORT[side]),
                          env=SIDE_ENV[side], timeline_path=str(trace))
    allreduces = ranks[0]["allreduces"]
    traffic = cross_host_traffic(trace, f"bench.{nbytes}")
    if traffic["allreduces_in_trace"] != allreduces:
        print(f"note: {side} {format_size(nbytes)}: the trace holds {traffic['allreduces_in_trace']} "
              f"allreduces, the ranks ran {allreduces}")
    per_link = {link: sent / allreduces for link, sent in traffic["per_link_bytes"].items()}
    trace.unlink()  # up to a few MB each; the numbers taken from it go into the JSON
    return {**slowest_rank(ranks), "allreduces": allreduces, "trace": traffic,
            "cross_host_bytes_per_allreduce": traffic["cross_host_bytes"] / allreduces,
            "per_link_bytes_per_allreduce": per_link,
            "local_size": ranks[0]["local_size"], "cross_size": ranks[0]["cross_size"]}


def compare(nbytes: int, iterations: int, repeats: int, folder: Path) -> dict:
    runs = dict(zip(SIDES, interleaved(repeats, *[
        functools.partial(measure_side, side, nbytes, iterations, folder) for side in SIDES])))
    np, hosts = len(HOSTS), len(set(HOSTS))
    result = {"bytes": nbytes, "np": np, "hosts": hosts, "local_size": np // hosts}
    for side in SIDES:
        best = best_of(runs[side])
        result[side] = {**best, "runs": runs[side],
                        "expected": expected_cross_host(side, nbytes, np, hosts)}
    hier, flat = result["hierarchical"], result["flat"]
    result["speedup"] = flat["median_s"] / hier["median_s"]
    result["total_ratio"] = hier["cross_host_bytes_per_allreduce"] / flat["cross_host_bytes_per_allreduce"]
    result["per_link_ratio"] = (max(hier["per_link_bytes_per_allreduce"].values())
                                / max(flat["per_link_bytes_per_allreduce"].values()))
    result["expected_total_ratio"] = hier["expected"]["total_bytes"] / flat["expected"]["total_bytes"]
    result["expected_per_link_ratio"] = (hier["expected"]["per_link_bytes"]
                                         / flat["expected"]["per_link_bytes"])
    bound = 1 / result["local_size"] + 1e-9
    result["one_over_local_size_per_link"] = result["per_link_ratio"] <= bound
    result["one_over_local_size_in_total"] = result["total_ratio"] <= bound
    return result


def mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.3f}"


def print_results(results: list[dict]) -> None:
    np, hosts = results[0]["np"], results[0]["hosts"]
    rows = []
    for result in results:
        for side in SIDES:
            measured, expected = result[side], result[side]["expected"]
            per_link = measured["per_link_bytes_per_allreduce"]
            rows.append([
                format_size(result["bytes"]), side, SIDE_TRANSPORT[side],
                f"{measured['median_s'] * 1e3:.2f}",
                f"{len(per_link)}", mib(measured["cross_host_bytes_per_allreduce"]),
                f"{mib(expected['total_bytes'])} = {expected['formula']}",
                mib(max(per_link.values())), mib(expected["per_link_bytes"]),
            ])
    print_table(f"allreduce sum float32, np={np} on {hosts} simulated hosts ({','.join(HOSTS)}): "
                "median ms of the slowest rank; MiB sent between hosts per allreduce, measured "
                "from the trace's ring_step events vs expected",
                ["size", "side", "transport", "ms", "crossing links", "cross-host MiB",
                 "expected MiB", "max per link", "expected per link"], rows)
    verdicts = []
    for result in results:
        local = result["local_size"]
        verdicts.append([
            format_size(result["bytes"]), f"{result['speedup']:.2f}x",
            f"{result['per_link_ratio']:.3f} (exp. {result['expected_per_link_ratio']:.3f})",
            f"{result['total_ratio']:.3f} (exp. {result['expected_total_ratio']:.3f})",
            f"1/{local} = {1 / local:.3f}",
            "holds" if result["one_over_local_size_per_link"] else "DOES NOT HOLD",
            "holds" if result["one_over_local_size_in_total"] else "does not hold",
        ])
    print_table('"hierarchical sends 1/local_size of the bytes across hosts": hierarchical / flat '
                "bytes between hosts",
                ["size", "hier speed-up", "per crossing link", "in total", "1/local_size",
                 "per link <= 1/L", "in total <= 1/L"], verdicts)
    print("per link: what the busiest host-crossing link carries; in total: every crossing link "
          f"together (hierarchical uses N={np} such links, the flat ring H={hosts}).")


def warn_about_spread(results: list[dict]) -> None:
    for result in results:
        for side in SIDES:
            if spread(result[side]) > SPREAD_WARNING:
                print(f"note: {format_size(result['bytes'])} {side} varied: middle half of "
                      f"iterations spans {spread(result[side]):.0%} of the median "
                      f"(rank {result[side]['rank']})")


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()
    os.environ[TEST_HOSTS_VARIABLE] = ",".join(HOSTS)
    with tempfile.TemporaryDirectory(prefix="ddl_magic-hierarchical-") as folder:
        results = [compare(nbytes, args.iterations[nbytes], args.repeats, Path(folder))
                   for nbytes in args.sizes]
    print_results(results)
    warn_about_spread(results)
    path = write_results("hierarchical", {
        "settings": {"sizes": args.sizes, "iterations": args.iterations, "repeats": args.repeats,
                     "quick": args.quick, "simulated_hosts": ",".join(HOSTS),
                     "torch_threads_per_rank": 1, "dtype": "float32", "op": "sum",
                     "timeline": "on for both sides",
                     "sides": {side: {"env": SIDE_ENV[side], "transport": SIDE_TRANSPORT[side]}
                               for side in SIDES}},
        "results": results, "load_average_before": load_before,
        "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/hierarchical.py --sizes 4MiB --iterations 20")
    parser.add_argument("--sizes", nargs="+", help=f"tensor sizes (default: {' '.join(SIZES)})")
    parser.add_argument("--iterations", type=int,
                        help="timed allreduces per size (default 100 at 1 MiB, 10 at 64 MiB)")
    parser.add_argument("--repeats", type=int, help="runs of each side, interleaved (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one run of each side, a fifth of the iterations")
    args = parser.parse_args()
    shrink = 5 if args.quick else 1
    args.sizes = [parse_size(size) for size in args.sizes or SIZES]
    args.iterations = {nbytes: args.iterations or max(2, default_iterations(nbytes) // shrink)
                       for nbytes in args.sizes}
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args


if __name__ == "__main__":
    main()
