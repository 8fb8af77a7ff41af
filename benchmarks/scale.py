"""Scale by counting: what negotiation, small allreduces and rendezvous cost at N ranks.

Two cores cannot run 1024 ranks, and wall time on an oversubscribed machine is no scaling
result, so this counts instead, with the real code:

    python benchmarks/scale.py --simulate 8 64 512 1024      # seconds
    python benchmarks/scale.py --driver 512                  # the real control server

``--simulate N ...`` runs, for each N, N `LockstepNegotiator`s (`runtime/lockstep.py`: the
response cache, the control vector, rank 0's Coordinator) in one process, their cycles
carried out by `hypercube.run_in_memory` (messages in queues, counted as the sockets count
them, frame headers included). A training loop of `--tensors` named gradients runs a first
step (every request new: the uncached path) and steady steps; every rank must agree on every
cycle's responses. It also runs recursive doubling's real schedule on a 4 KiB buffer of N
simulated ranks, counts the rendezvous each rank does to form its ring (from the plan
`rendezvous.connect_ring` follows) and each rank's messages at the driver, and prints the
α-β-γ model's times (`planes/cost_model.py`) for 4 KiB and 64 MiB, ring vs recursive
doubling.

``--driver N`` starts the real `ControlServer` and N emulated ranks over loopback, each
registering as a rank does (handshake, clock probes, Register) with its task reporting
liveness as a Spark task does, and reads the server's counters: messages per rank, threads,
liveness reports per second.

Both write benchmarks/results/scale.json (the keys of each mode).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import print_table, warn_if_busy, write_results
from ddl_magic.runtime.lockstep import LockstepNegotiator
from ddl_magic.runtime.negotiation import Request
from ddl_magic.runtime.planes import cost_model
from ddl_magic.runtime.planes.hypercube import ScheduleCount, links_to_open, run_in_memory
from ddl_magic.runtime.planes.recursive_doubling import TensorReducible, recursive_doubling
from ddl_magic.runtime.planes.tcp import RendezvousCount

FUSION_THRESHOLD = 64 << 20
# Each connection between ranks: the three frames of the handshake, then the rank's number.
FRAMES_PER_CONNECTION = RendezvousCount.FRAMES_PER_CONNECTION


def gradient_requests(tensors: int) -> list[Request]:
    """A model's gradients: `tensors` named float32 tensors of a few shapes."""
    shapes = [(64, 3, 7, 7), (64,), (256, 64, 1, 1), (256,), (512, 512), (1000, 2048), (1000,)]
    return [Request(f"allreduce.layer{index}.grad", "allreduce", torch.float32,
                    shapes[index % len(shapes)], 1) for index in range(tensors)]


def simulate_negotiation(size: int, tensors: int, steady_steps: int = 3) -> dict:
    """A training loop's negotiation on `size` simulated ranks: the first step's cycle (the
    uncached path) and steady steps' cycles, as rank 0 and the busiest rank see them."""
    negotiators = [LockstepNegotiator(tuple(range(size)), position, tuple(range(size)),
                                      FUSION_THRESHOLD, 0.001, 60.0, 300.0)
                   for position in range(size)]
    requests = gradient_requests(tensors)
    steps = []
    for step in range(1 + steady_steps):
        now = float(step)
        for negotiator in negotiators:
            negotiator.add(requests, now)
        outcomes, counts = run_in_memory({p: n.cycle(now) for p, n in enumerate(negotiators)})
        answers = {tuple(r.names for r in outcomes[p].cycle.responses) for p in range(size)}
        if len(answers) != 1:
            raise AssertionError(f"ranks disagree on step {step}'s responses")
        ran = sum(len(names) for names in next(iter(answers)))
        if ran != tensors or any(n.pending for n in negotiators):
            raise AssertionError(f"step {step} ran {ran} of {tensors} tensors")
        steps.append(_cycle_counts(counts, outcomes[0].coordinated))
    return {"first_step": steps[0], "steady_state": steps[-1],
            "steady_cycles_all_cached": all(not s["coordinated"] for s in steps[1:])}


def _cycle_counts(counts: dict[int, ScheduleCount], coordinated: bool) -> dict:
    rank0 = counts[0]
    return {"coordinated": coordinated,
            "rank0_messages_per_cycle": rank0.messages_received,
            "rank0_bytes_per_message": rank0.bytes_received / max(rank0.messages_received, 1),
            "rank0_messages_sent_per_cycle": rank0.messages_sent,
            "max_rank_messages_per_cycle": max(c.messages_received for c in counts.values()),
            "rank0_bytes_per_cycle": rank0.bytes_received,
            "rank0_bytes_sent_per_cycle": rank0.bytes_sent,
            "rounds_per_cycle": max(c.rounds for c in counts.values())}


def simulate_small_allreduce(size: int, nbytes: int = 4096) -> dict:
    """Recursive doubling's real schedule on `size` simulated ranks: rounds, and whether
    every rank ends with the sum (integers, so exactly)."""
    numel = nbytes // 8
    buffers = [torch.full((numel,), position + 1, dtype=torch.int64) for position in range(size)]
    scratch = [torch.empty(numel, dtype=torch.int64) for _ in range(size)]
    _, counts = run_in_memory({
        p: recursive_doubling(p, size, TensorReducible(buffers[p], scratch[p],
                                                       lambda dst, src: dst.add_(src)))
        for p in range(size)})
    total = size * (size + 1) // 2
    return {"recursive_doubling_rounds": max(c.rounds for c in counts.values()),
            "ring_steps": 2 * (size - 1),
            "every_rank_has_the_sum": all(bool((b == total).all()) for b in buffers)}


def rendezvous_counts(size: int, ranks_per_host: int) -> dict:
    """Messages each rank sends and receives to form its ring (from the plan
    `rendezvous.connect_ring` follows), and the driver's messages for the run."""
    members = tuple(range(size))
    frames = [0] * size
    for rank in members:
        right = members[(rank + 1) % size]
        connects, _ = links_to_open(rank, members)
        partners = [right, *connects] + ([0] if rank else [])
        for partner in partners:  # a connection costs both ends its frames
            frames[rank] += FRAMES_PER_CONNECTION
            frames[partner] += FRAMES_PER_CONNECTION
    if ranks_per_host > 1 and size > ranks_per_host:  # shared memory agreed through rank 0
        for rank in members[1:]:
            frames[rank] += 2 * 2  # two gathers: send one, receive the list
        frames[0] += 2 * 2 * (size - 1)
    # At the driver, per rank: the handshake (3 frames), 5 clock probes and readings, then
    # Register and Start: the rendezvous itself is Register and Start.
    return {"rendezvous_messages_total": 2 * size,
            "driver_frames_total": (3 + 10 + 2) * size,
            "rendezvous_messages_max_rank": max(frames),
            "rendezvous_messages_median_rank": sorted(frames)[size // 2],
            "ring_connections_rank0": 2 + len(links_to_open(0, members)[1]) + (size - 1)}


def model_times(size: int) -> dict:
    link = cost_model.NETWORK
    return {f"{name}_{label}_s": function(nbytes, size, link)
            for label, nbytes in (("4KiB", 4096), ("64MiB", 64 << 20))
            for name, function in (("ring", cost_model.ring_allreduce_s),
                                   ("recursive_doubling", cost_model.recursive_doubling_s))
            } | {"switch_bytes": cost_model.switch_bytes(size, link)}


def simulate(sizes: list[int], tensors: int, ranks_per_host: int) -> dict:
    results = {}
    for size in sizes:
        started = time.perf_counter()
        results[size] = {**simulate_negotiation(size, tensors),
                         **simulate_small_allreduce(size),
                         **rendezvous_counts(size, ranks_per_host),
                         "model": model_times(size),
                         "simulated_in_s": time.perf_counter() - started}
    return results


def print_simulation(results: dict, tensors: int) -> None:
    rows = []
    for size, r in results.items():
        first, steady = r["first_step"], r["steady_state"]
        rows.append([size, steady["rank0_messages_per_cycle"], steady["rank0_messages_sent_per_cycle"],
                     steady["max_rank_messages_per_cycle"], steady["rank0_bytes_per_cycle"],
                     steady["rounds_per_cycle"], size - 1,
                     first["rank0_messages_per_cycle"], first["rank0_bytes_per_cycle"],
                     first["rounds_per_cycle"]])
    print_table(f"negotiation per cycle ({tensors} cached tensors; rank 0 counts what it receives,"
                " and sends)",
                ["N", "rank0 msgs", "sent", "max rank", "rank0 B", "rounds", "before: rank0 msgs",
                 "1st: rank0 msgs", "1st: rank0 B", "1st: rounds"], rows)
    rows = [[size, r["recursive_doubling_rounds"], r["ring_steps"],
             f"{r['model']['recursive_doubling_4KiB_s'] * 1e3:.2f}",
             f"{r['model']['ring_4KiB_s'] * 1e3:.2f}",
             f"{r['model']['recursive_doubling_64MiB_s']:.2f}",
             f"{r['model']['ring_64MiB_s']:.2f}", r["model"]["switch_bytes"]]
            for size, r in results.items()]
    print_table("allreduce: rounds, and the model's times (ms for 4 KiB, s for 64 MiB)",
                ["N", "RD rounds", "ring steps", "RD 4K", "ring 4K", "RD 64M", "ring 64M",
                 "switch B"], rows)
    rows = [[size, r["rendezvous_messages_total"], r["driver_frames_total"],
             r["rendezvous_messages_max_rank"], r["rendezvous_messages_median_rank"],
             r["ring_connections_rank0"]] for size, r in results.items()]
    print_table("rendezvous", ["N", "driver: Register+Start", "driver: all frames",
                               "ring: max rank", "ring: median rank", "rank0 connections"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate", type=int, nargs="+", metavar="N",
                        help="simulate these numbers of ranks (e.g. 8 64 512 1024)")
    parser.add_argument("--tensors", type=int, default=100, help="gradients per step (default 100)")
    parser.add_argument("--ranks-per-host", type=int, default=8,
                        help="for the rendezvous count (default 8: a node of 8 GPUs)")
    parser.add_argument("--driver", type=int, metavar="N",
                        help="the real control server with N emulated ranks over loopback")
    args = parser.parse_args()
    if not args.simulate and not args.driver:
        parser.error("give --simulate N ... and/or --driver N")
    payload: dict = {}
    if args.simulate:
        results = simulate(args.simulate, args.tensors, args.ranks_per_host)
        print_simulation(results, args.tensors)
        payload["simulation"] = {"tensors": args.tensors, "ranks_per_host": args.ranks_per_host,
                                 "alpha_beta_gamma": vars(cost_model.NETWORK),
                                 "by_size": results}
    if args.driver:
        from scale_driver import measure_driver, print_driver

        warn_if_busy()
        driver = measure_driver(args.driver)
        print_driver(driver)
        payload["driver"] = driver
    path = write_results("scale", payload)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
