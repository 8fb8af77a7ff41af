"""A data-parallel training step: ``hvd.DistributedOptimizer`` against torch DDP on gloo.

    python benchmarks/train_step.py                    # both workloads, np 1 and 2, 300 timed steps
    python benchmarks/train_step.py --quick            # smoke run: 50 timed steps, one repeat
    python benchmarks/train_step.py --workload iris    # one workload only

Two workloads, both MLPs trained on synthetic batches, one torch thread per rank:

- ``mlp``: 784-512-512-10 (about 670k parameters, 2.7 MB of gradients), SGD with momentum,
  MNIST-shaped batches of 64 per rank: the bytes on the wire matter.
- ``iris``: 4-5-4-3 (83 parameters), Adam, batches of 8 per rank: the step is under a
  millisecond, so what matters is the fixed cost of every allreduce.

Each rank times every step (zero_grad, forward, backward, step) after a warm-up; DDP and
ours run twice each, interleaved, and the report takes the less disturbed run's slowest-rank
median, the ratio ours/DDP, and the scaling efficiency

    throughput at np=2 / (2 x throughput at np=1)  =  step time at np=1 / step time at np=2

(the batch per rank is fixed, so two ranks process twice the samples per step). A plain
single-process step without any wrapper is measured too: the floor at np=1, and for the Iris
MLP part of the target (a tiny model should hardly pay for being distributed). Targets, at
np=2: MLP ours <= 0.5x DDP; Iris ours <= 0.6x DDP and <= 1.5x the plain step.

Prints a table per workload and writes ``benchmarks/results/train_step.json``.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from common import (best_of, interleaved, parse_step_timing_arguments, print_table, run_gloo, run_ours,
                    slowest_rank, spread, summarize, time_iterations, warn_if_busy, write_results)

WORLD_SIZES = (1, 2)
BATCHES_IN_ROTATION = 8
SPREAD_WARNING = 0.25


def sgd(model: nn.Module, world_size: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01 * world_size, momentum=0.9)


def adam(model: nn.Module, world_size: int) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


@dataclass(frozen=True)
class Workload:
    """A model, its optimizer and batch, and what ours must reach against them at np=2."""

    name: str
    layers: tuple[int, ...]
    batch_per_rank: int
    optimizer: Callable[[nn.Module, int], torch.optim.Optimizer]  # (model, world size)
    optimizer_description: str
    target_ours_over_ddp: float
    target_ours_over_plain: float | None = None

    @property
    def title(self) -> str:
        return (f"MLP {'-'.join(map(str, self.layers))}, batch {self.batch_per_rank} per rank, "
                f"{self.optimizer_description}")

    def settings(self) -> dict:
        """What the JSON records about the workload (the optimizer as words)."""
        return {"layers": self.layers, "batch_per_rank": self.batch_per_rank,
                "optimizer": self.optimizer_description, "target_ours_over_ddp": self.target_ours_over_ddp,
                "target_ours_over_plain": self.target_ours_over_plain}


WORKLOADS = {workload.name: workload for workload in (
    # issue 40: <= 0.5x DDP and <= 1.3x the one-process step
    Workload("mlp", (784, 512, 512, 10), 64, sgd, "SGD lr 0.01 x size, momentum 0.9", 0.5, 1.3),
    Workload("iris", (4, 5, 4, 3), 8, adam, "Adam lr 0.01", 0.6, 1.5),
)}
# The MLP's step is also the one timeline_overhead.py times.
LAYERS, BATCH_PER_RANK = WORKLOADS["mlp"].layers, WORKLOADS["mlp"].batch_per_rank


def mlp(layers: tuple[int, ...] = LAYERS) -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    modules: list[nn.Module] = []
    for inputs, outputs in itertools.pairwise(layers):
        modules += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*modules[:-1])


def synthetic_batches(rank: int, workload: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches shaped like the workload's data, different on every rank, as a sharded data set would give."""
    generator = torch.Generator().manual_seed(1000 + rank)
    features, classes = workload.layers[0], workload.layers[-1]
    return [(torch.rand(workload.batch_per_rank, features, generator=generator),
             torch.randint(0, classes, (workload.batch_per_rank,), generator=generator))
            for _ in range(BATCHES_IN_ROTATION)]


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                  workload: Workload = WORKLOADS["mlp"]):
    """A function running one training step on this rank's next synthetic batch."""
    batches = synthetic_batches(rank, workload)
    loss_fn = nn.CrossEntropyLoss()
    step_number = 0

    def train_step():
        nonlocal step_number
        inputs, labels = batches[step_number % len(batches)]
        step_number += 1
        optimizer.zero_grad()
        loss_fn(model(inputs), labels).backward()
        optimizer.step()

    return train_step


def time_training(workload: Workload, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                  barrier, steps: int, warmup: int) -> dict:
    """Time `steps` training steps; the summary carries a checksum of the final weights."""
    train_step = training_step(model, optimizer, rank, workload)
    summary = summarize(time_iterations(train_step, barrier, steps, warmup))
    summary["weights_checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    return summary


def ours_training(workload: str, steps: int, warmup: int) -> dict:
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    chosen = WORKLOADS[workload]
    model = mlp(chosen.layers)
    optimizer = hvd.DistributedOptimizer(chosen.optimizer(model, hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return time_training(chosen, model, optimizer, hvd.rank(), hvd.barrier, steps, warmup)


def ddp_training(workload: str, steps: int, warmup: int) -> dict:
    chosen = WORKLOADS[workload]
    model = nn.parallel.DistributedDataParallel(mlp(chosen.layers))
    return time_training(chosen, model, chosen.optimizer(model, dist.get_world_size()), dist.get_rank(),
                         dist.barrier, steps, warmup)


def plain_training(workload: str, steps: int, warmup: int) -> dict:
    """No wrapper at all: what one process needs for the step itself."""
    chosen = WORKLOADS[workload]
    model = mlp(chosen.layers)
    return time_training(chosen, model, chosen.optimizer(model, 1), 0, lambda: None, steps, warmup)


# ---- the driver ---------------------------------------------------------------------------

def benchmark(workload: Workload, args: argparse.Namespace) -> dict:
    """The plain step, a row per world size (DDP and ours), and the scaling efficiency."""
    runs = {"workload": workload.name, "steps": args.steps, "warmup": args.warmup}
    plain = best_of([run_gloo(plain_training, 1, **runs)[0] for _ in range(args.repeats)])
    rows = [measure(workload, np, plain, args.repeats, runs) for np in args.np]
    efficiency = {side: scaling_efficiency(rows, side) for side in ("ddp", "ours")}
    return {"plain_step": plain, "results": rows, "scaling_efficiency": efficiency}


def measure(workload: Workload, np: int, plain: dict, repeats: int, runs: dict) -> dict:
    ddp_runs, ours_runs, apart_runs = interleaved(
        repeats, lambda: run_gloo(ddp_training, np, **runs), lambda: run_ours(ours_training, np, **runs),
        lambda: run_gloo(plain_training, np, **runs))
    ddp = best_of([slowest_rank(ranks) for ranks in ddp_runs])
    ours = best_of([slowest_rank(ranks) for ranks in ours_runs])
    # The floor: np processes each stepping on its own at the same time, nothing exchanged.
    # Ranks share the machine's cores and memory, so even this is slower than `plain`.
    apart = best_of([slowest_rank(ranks) for ranks in apart_runs])
    row = {"np": np, "ddp": ddp, "ours": ours, "plain_side_by_side": apart,
           "ours_over_ddp": ours["median_s"] / ddp["median_s"],
           "ours_over_plain": ours["median_s"] / plain["median_s"],
           "ours_over_side_by_side": ours["median_s"] / apart["median_s"],
           "ranks_in_sync": {"ddp": all(map(in_sync, ddp_runs)), "ours": all(map(in_sync, ours_runs))}}
    row["meets_target"] = meets_target(workload, row) if np == 2 else None
    return row


def meets_target(workload: Workload, row: dict) -> bool:
    return (row["ours_over_ddp"] <= workload.target_ours_over_ddp
            and (workload.target_ours_over_plain is None
                 or row["ours_over_plain"] <= workload.target_ours_over_plain))


def in_sync(rank_summaries: list[dict]) -> bool:
    """Did every rank end with the same weights (gradients really were averaged)?"""
    checksums = [summary["weights_checksum"] for summary in rank_summaries]
    return max(checksums) - min(checksums) <= 1e-6 * max(1.0, abs(checksums[0]))


def scaling_efficiency(rows: list[dict], side: str) -> float | None:
    by_np = {row["np"]: row[side]["median_s"] for row in rows}
    return by_np[1] / by_np[2] if 1 in by_np and 2 in by_np else None


def print_results(workload: Workload, measured: dict) -> None:
    def target(value: float | None, applies: bool) -> str:
        return f"<={value:.1f}" if value is not None and applies else "-"

    verdicts = {True: "meets", False: "MISSES", None: ""}
    table = [[str(row["np"]), f"{row['plain_side_by_side']['median_s'] * 1e3:.2f}",
              f"{row['ddp']['median_s'] * 1e3:.2f}", f"{row['ours']['median_s'] * 1e3:.2f}",
              f"{row['ours_over_ddp']:.2f}", target(workload.target_ours_over_ddp, row["np"] == 2),
              f"{row['ours_over_plain']:.2f}", target(workload.target_ours_over_plain, row["np"] == 2),
              f"{row['ours_over_side_by_side']:.2f}", verdicts[row["meets_target"]]]
             for row in measured["results"]]
    print_table(f"train step, {workload.title}: median ms of the slowest rank",
                ["np", "apart ms", "DDP ms", "ours ms", "ours/DDP", "target", "ours/plain", "target",
                 "ours/apart", "verdict"], table)
    print("apart: np plain processes stepping at the same time with nothing exchanged, the floor "
          "for np ranks on this machine")
    print(f"plain step without a wrapper (one process): {measured['plain_step']['median_s'] * 1e3:.2f} ms")
    efficiency = measured["scaling_efficiency"]
    if efficiency["ours"] is not None:
        print(f"scaling efficiency np=1 -> 2 (throughput at 2 / (2 x throughput at 1)): "
              f"DDP {efficiency['ddp']:.0%}, ours {efficiency['ours']:.0%}")
    for row in measured["results"]:
        for side in ("ddp", "ours"):
            if not row["ranks_in_sync"][side]:
                print(f"WARNING: {side} np={row['np']}: ranks ended with different weights")
            if spread(row[side]) > SPREAD_WARNING:
                print(f"note: {side} np={row['np']} varied: middle half of steps spans "
                      f"{spread(row[side]):.0%} of the median (rank {row[side]['rank']})")


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()
    measured = {}
    for name in args.workload:
        measured[name] = benchmark(WORKLOADS[name], args)
        print_results(WORKLOADS[name], measured[name])
    path = write_results("train_step", {
        "settings": {"steps": args.steps, "warmup": args.warmup, "np": args.np, "repeats": args.repeats,
                     "torch_threads_per_rank": 1},
        "workloads": {name: {**WORKLOADS[name].settings(), **measured[name]} for name in args.workload},
        "load_average_before": load_before, "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python benchmarks/train_step.py --np 2 --steps 500")
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS),
                        help="which workloads (default: all)")
    parser.add_argument("--np", type=int, nargs="+", default=list(WORLD_SIZES),
                        help="world sizes (default 1 2; efficiency and the targets need 2)")
    return parse_step_timing_arguments(parser)


if __name__ == "__main__":
    main()
