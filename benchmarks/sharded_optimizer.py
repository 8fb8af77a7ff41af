"""Sharded optimizer state (ZeRO-1) against the unsharded DistributedOptimizer: Adam's state
bytes per rank and the step time, on a 50M-parameter MLP at np 2 and 4.

    python benchmarks/sharded_optimizer.py             # 10 timed steps, 2 interleaved repeats
    python benchmarks/sharded_optimizer.py --quick     # smoke run: 3 timed steps, one repeat

Each rank trains the MLP 1024-3400-3400-3400-3400-3400-10 (49.8M parameters, 199 MB of
float32) on its own synthetic batches of 32, Adam lr 1e-4, one torch thread per rank, and
reports the bytes of its optimizer state (Adam's two moments per element; step counts left
out) and the median of its step times (zero_grad, forward, backward, step). Unsharded and
sharded runs alternate; the less disturbed repeat (smaller slowest-rank median) is reported.

Targets (issue 10): state bytes per rank about 1/N of the unsharded run's; step time within
1.1x of the unsharded run's. Prints a table and writes ``benchmarks/results/sharded_optimizer.json``.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch import nn

from common import (best_of, interleaved, print_table, run_ours, slowest_rank, summarize,
                    time_iterations, warn_if_busy, write_results)

LAYERS = (1024, 3400, 3400, 3400, 3400, 3400, 10)
BATCH_PER_RANK = 32
WORLD_SIZES = (2, 4)
TARGET_STEP_RATIO = 1.1


def mlp() -> nn.Module:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for inputs, outputs in itertools.pairwise(LAYERS):
        modules += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*modules[:-1])


def train(shard: bool, steps: int, warmup: int) -> dict:
    """One rank: time `steps` Adam steps; its state bytes and step-time summary."""
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                         named_parameters=model.named_parameters(),
                                         shard_optimizer_state=shard)
    generator = torch.Generator().manual_seed(hvd.rank())
    inputs = torch.rand(BATCH_PER_RANK, LAYERS[0], generator=generator)
    labels = torch.randint(0, LAYERS[-1], (BATCH_PER_RANK,), generator=generator)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    summary = summarize(time_iterations(step, hvd.barrier, steps, warmup))
    summary["state_bytes"] = sum(value.numel() * value.element_size()
                                 for state in optimizer.state.values() for value in state.values()
                                 if isinstance(value, torch.Tensor) and value.dim() > 0)
    summary["checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    hvd.shutdown()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="timed steps per run (default 10, --quick 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, help="interleaved runs of each side (default 2, --quick 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 2)
    warn_if_busy()
    n_parameters = sum(p.numel() for p in mlp().parameters())
    rows, results = [], {}
    for np in WORLD_SIZES:
        unsharded_runs, sharded_runs = interleaved(
            repeats,
            lambda: run_ours(train, np, shard=False, steps=steps, warmup=args.warmup),
            lambda: run_ours(train, np, shard=True, steps=steps, warmup=args.warmup))
        unsharded = best_of([slowest_rank(run) for run in unsharded_runs])
        sharded = best_of([slowest_rank(run) for run in sharded_runs])
        whole_state = max(rank["state_bytes"] for rank in unsharded_runs[0])
        shares = [rank["state_bytes"] for rank in sharded_runs[0]]
        step_ratio = sharded["median_s"] / unsharded["median_s"]
        results[np] = {"unsharded": unsharded, "sharded": sharded,
                       "unsharded_state_bytes_per_rank": whole_state,
                       "sharded_state_bytes_per_rank": shares,
                       "largest_share_of_whole": max(shares) / whole_state,
                       "step_time_ratio": step_ratio,
                       # sums of 50M weights after the same steps: reduction order differs
                       "weights_checksum_difference": abs(unsharded_runs[0][0]["checksum"]
                                                          - sharded_runs[0][0]["checksum"])}
        rows.append([str(np), f"{whole_state / 2**20:.0f}", f"{max(shares) / 2**20:.0f}",
                     f"{max(shares) / whole_state:.3f} (1/N = {1 / np:.3f})",
                     f"{unsharded['median_s'] * 1e3:.0f}", f"{sharded['median_s'] * 1e3:.0f}",
                     f"{step_ratio:.2f} (target <= {TARGET_STEP_RATIO})"])
    print_table(f"Adam on MLP {'-'.join(map(str, LAYERS))} ({n_parameters / 1e6:.1f}M parameters), "
                f"batch {BATCH_PER_RANK} per rank, {steps} timed steps",
                ["np", "state MiB/rank", "sharded MiB/rank", "share of whole", "step ms",
                 "sharded step ms", "sharded/unsharded"], rows)
    path = write_results("sharded_optimizer", {
        "layers": LAYERS, "parameters": n_parameters, "batch_per_rank": BATCH_PER_RANK,
        "steps": steps, "repeats": repeats, "target_step_ratio": TARGET_STEP_RATIO,
        "results": {str(np): result for np, result in results.items()}})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
