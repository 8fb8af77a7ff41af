"""A data-parallel training step: ``hvd.DistributedOptimizer`` against torch DDP on gloo.

    python benchmarks/train_step.py            # np 1 and 2, 300 timed steps each
    python benchmarks/train_step.py --quick    # smoke run: 50 timed steps, one repeat

The model is an MLP 784-512-512-10 (about 670k parameters, 2.7 MB of gradients) trained
with SGD on MNIST-shaped synthetic batches of 64 per rank, one torch thread per rank. Each
rank times every step (zero_grad, forward, backward, step) after a warm-up; each side runs
twice, interleaved with the other, and the report takes the less disturbed run's slowest-rank
median, the ratio ours/DDP, and the scaling efficiency

    throughput at np=2 / (2 x throughput at np=1)  =  step time at np=1 / step time at np=2

(the batch per rank is fixed, so two ranks process twice the samples per step). A plain
single-process step without any wrapper is measured too, as the floor at np=1.

Prints a table and writes ``benchmarks/results/train_step.json``.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.distributed as dist
from torch import nn

from common import (best_of, interleaved, print_table, run_gloo, run_ours, slowest_rank, spread, summarize,
                    time_iterations, warn_if_busy, write_results)

WORLD_SIZES = (1, 2)
BATCH_PER_RANK = 64
LAYERS = (784, 512, 512, 10)
BATCHES_IN_ROTATION = 8
TARGET_OURS_OVER_DDP = 1.0
SPREAD_WARNING = 0.25


def mlp() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    layers: list[nn.Module] = []
    for inputs, outputs in itertools.pairwise(LAYERS):
        layers += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def synthetic_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """MNIST-shaped batches, different on every rank, as a sharded data set would give."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [(torch.rand(BATCH_PER_RANK, LAYERS[0], generator=generator),
             torch.randint(0, LAYERS[-1], (BATCH_PER_RANK,), generator=generator))
            for _ in range(BATCHES_IN_ROTATION)]


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int):
    """A function running one training step on this rank's next synthetic batch."""
    batches = synthetic_batches(rank)
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


def time_training(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, barrier,
                  steps: int, warmup: int) -> dict:
    """Time `steps` training steps; the summary carries a checksum of the final weights."""
    train_step = training_step(model, optimizer, rank)
    summary = summarize(time_iterations(train_step, barrier, steps, warmup))
    summary["weights_checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    return summary


def sgd(model: nn.Module, world_size: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01 * world_size, momentum=0.9)


def ours_training(steps: int, warmup: int) -> dict:
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model, hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return time_training(model, optimizer, hvd.rank(), hvd.barrier, steps, warmup)


def ddp_training(steps: int, warmup: int) -> dict:
    model = nn.parallel.DistributedDataParallel(mlp())
    return time_training(model, sgd(model, dist.get_world_size()), dist.get_rank(), dist.barrier,
                         steps, warmup)


def plain_training(steps: int, warmup: int) -> dict:
    """No wrapper at all: what one process needs for the step itself."""
    model = mlp()
    return time_training(model, sgd(model, 1), 0, lambda: None, steps, warmup)


# ---- the driver ---------------------------------------------------------------------------

def measure(np: int, steps: int, warmup: int, repeats: int) -> dict:
    ddp_runs, ours_runs = interleaved(repeats,
                                      lambda: run_gloo(ddp_training, np, steps=steps, warmup=warmup),
                                      lambda: run_ours(ours_training, np, steps=steps, warmup=warmup))
    ddp = best_of([slowest_rank(ranks) for ranks in ddp_runs])
    ours = best_of([slowest_rank(ranks) for ranks in ours_runs])
    ratio = ours["median_s"] / ddp["median_s"]
    return {"np": np, "ddp": ddp, "ours": ours, "ours_over_ddp": ratio,
            "meets_target": ratio <= TARGET_OURS_OVER_DDP,
            "ranks_in_sync": {"ddp": all(map(in_sync, ddp_runs)), "ours": all(map(in_sync, ours_runs))}}


def in_sync(rank_summaries: list[dict]) -> bool:
    """Did every rank end with the same weights (gradients really were averaged)?"""
    checksums = [summary["weights_checksum"] for summary in rank_summaries]
    return max(checksums) - min(checksums) <= 1e-6 * max(1.0, abs(checksums[0]))


def scaling_efficiency(rows: list[dict], side: str) -> float | None:
    by_np = {row["np"]: row[side]["median_s"] for row in rows}
    return by_np[1] / by_np[2] if 1 in by_np and 2 in by_np else None


def print_results(rows: list[dict], plain: dict, efficiency: dict) -> None:
    table = [[str(row["np"]), f"{row['ddp']['median_s'] * 1e3:.2f}",
              f"{row['ours']['median_s'] * 1e3:.2f}", f"{row['ours_over_ddp']:.2f}",
              f"<={TARGET_OURS_OVER_DDP:.1f}", "meets" if row["meets_target"] else "MISSES"]
             for row in rows]
    print_table(f"train step, MLP {'-'.join(map(str, LAYERS))}, batch {BATCH_PER_RANK} per rank, "
                "SGD: median ms of the slowest rank",
                ["np", "DDP ms", "ours ms", "ours/DDP", "target", "verdict"], table)
    print(f"plain step without a wrapper (one process): {plain['median_s'] * 1e3:.2f} ms")
    if efficiency["ours"] is not None:
        print(f"scaling efficiency np=1 -> 2 (throughput at 2 / (2 x throughput at 1)): "
              f"DDP {efficiency['ddp']:.0%}, ours {efficiency['ours']:.0%}")
    for row in rows:
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
    plain = best_of([run_gloo(plain_training, 1, steps=args.steps, warmup=args.warmup)[0]
                     for _ in range(args.repeats)])
    rows = [measure(np, args.steps, args.warmup, args.repeats) for np in args.np]
    efficiency = {side: scaling_efficiency(rows, side) for side in ("ddp", "ours")}
    print_results(rows, plain, efficiency)
    path = write_results("train_step", {
        "settings": {"layers": LAYERS, "batch_per_rank": BATCH_PER_RANK,
                     "optimizer": "SGD momentum 0.9",
                     "steps": args.steps, "warmup": args.warmup, "np": args.np, "repeats": args.repeats,
                     "torch_threads_per_rank": 1},
        "plain_step": plain, "results": rows, "scaling_efficiency": efficiency,
        "target_ours_over_ddp": TARGET_OURS_OVER_DDP,
        "load_average_before": load_before, "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python benchmarks/train_step.py --np 2 --steps 500")
    parser.add_argument("--np", type=int, nargs="+", default=list(WORLD_SIZES),
                        help="world sizes (default 1 2; efficiency needs both)")
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


if __name__ == "__main__":
    main()
