"""Plain DDP, FSDP and FSDP2 code over the ``ddl`` torch.distributed backend against the same code over gloo.

    python benchmarks/ddp_backend.py            # 300 timed steps, 2 runs of each side
    python benchmarks/ddp_backend.py --quick    # smoke run: 50 timed steps, one run of each side

The workload is ``train_step.py``'s MLP: 784-512-512-10, batch 64 per rank, SGD (lr 0.01 x
size, momentum 0.9) on synthetic MNIST-shaped batches, one torch thread per rank. Every side
runs the same torch.distributed code on 2 ranks started by ddl_magic's local launcher (each
rank gets torchrun's environment, so ``dist.init_process_group(backend)`` needs nothing
else); only the backend differs:

- DDP over gloo and over ddl (``DistributedDataParallel(model)``);
- FSDP over gloo and over ddl (``FullyShardedDataParallel(model, device_id=cpu, use_orig_params=True)``);
- FSDP2 over gloo and over ddl (``fully_shard`` on each Linear, then on the model, on a 1-D
  ``init_device_mesh("cpu", (2,))``: parameters are DTensors, each rank holding half);
- plain: one process stepping without a wrapper (``train_step.py``'s), the floor.

Each rank times every step (zero_grad, forward, backward, step) after a warm-up; the sides
run in turn, repeated, and the report takes the less disturbed run's slowest-rank median and
the ratios ddl/gloo, for DDP (target <= 0.7) and for FSDP and FSDP2 (reported).

Same weights: DDP, FSDP and FSDP2 over ddl train a fixed number of steps in which rank r takes its
half of each global batch (``train_step.py``'s batches of rank r), and one process trains the
same steps on the whole global batches (both halves) with the same optimizer. The halves are
equal, so the averaged gradient is the whole batch's, and the weights must agree within float
tolerance (rtol 1e-5, atol 1e-6, as ``torch.testing.assert_close``). Reported: the largest
absolute difference of a weight, and the loss of both final models on the global batches.

Prints the tables and writes ``benchmarks/results/ddp_backend.json``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common import (best_of, interleaved, parse_step_timing_arguments, print_table, run_gloo, run_ours,
                    slowest_rank, spread, summarize, time_iterations, warn_if_busy, write_results)
from train_step import WORKLOADS, mlp, plain_training, sgd, synthetic_batches, training_step

NP = 2
MLP = WORKLOADS["mlp"]
WRAPPERS = ("ddp", "fsdp", "fsdp2")
LABELS = {"ddp": "DDP", "fsdp": "FSDP", "fsdp2": "FSDP2"}
BACKENDS = ("gloo", "ddl")
TARGET_DDP_DDL_OVER_GLOO = 0.7
SAME_WEIGHTS_STEPS = 20
RTOL, ATOL = 1e-5, 1e-6
SPREAD_WARNING = 0.25


# ---- on the ranks ---------------------------------------------------------------------------

def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:  # as FSDP2's users write it: each layer, then the rest
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return nn.parallel.DistributedDataParallel(model)


def timed_training(backend: str, wrapper: str, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group(backend)  # env://: the launcher's MASTER_ADDR, RANK, ...
    model = wrap(mlp(MLP.layers), wrapper)
    train_step = training_step(model, sgd(model, dist.get_world_size()), dist.get_rank(), MLP)
    # The group is left open: it ends with the rank. Destroying it while DDP's reducer still
    # holds it can deadlock on the GIL in torch's gloo (pytorch/pytorch#56297).
    return summarize(time_iterations(train_step, dist.barrier, steps, warmup))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, steps: int) -> None:
    for step in range(steps):
        inputs, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()


def trained_weights(backend: str, wrapper: str, steps: int) -> list[torch.Tensor] | None:
    """Train on this rank's half of every global batch; rank 0 returns the full final weights."""
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    model = wrap(mlp(MLP.layers), wrapper)
    train(model, sgd(model, dist.get_world_size()), synthetic_batches(rank, MLP), steps)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):  # collective: every rank takes part
            weights = [p.detach().clone() for p in model.parameters()]
    elif wrapper == "fsdp2":
        weights = [p.full_tensor().detach() for p in model.parameters()]  # an all-gather each
    else:
        weights = [p.detach().clone() for p in model.module.parameters()]
    return weights if rank == 0 else None


# ---- in the benchmark's process -------------------------------------------------------------

def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's whole batch: the halves of every rank, concatenated."""
    halves = [synthetic_batches(rank, MLP) for rank in range(NP)]
    return [(torch.cat([inputs for inputs, _ in step]), torch.cat([labels for _, labels in step]))
            for step in zip(*halves)]


def loss_of(weights: list[torch.Tensor], batches: list) -> float:
    """Mean cross-entropy of the MLP with `weights` over `batches`."""
    model = mlp(MLP.layers)
    with torch.no_grad():
        for parameter, weight in zip(model.parameters(), weights):
            parameter.copy_(weight)
        return float(torch.stack([nn.functional.cross_entropy(model(x), y) for x, y in batches]).mean())


def same_weights(steps: int) -> dict:
    """DDP, FSDP and FSDP2 over ddl against one process trained on the whole batches."""
    batches = global_batches()
    model = mlp(MLP.layers)
    train(model, sgd(model, NP), batches, steps)
    reference = [p.detach() for p in model.parameters()]
    checks = {"one_process_loss": loss_of(reference, batches)}
    for wrapper in WRAPPERS:
        weights = run_ours(trained_weights, NP, backend="ddl", wrapper=wrapper, steps=steps)[0]
        differences = torch.cat([(w - r).abs().flatten() for w, r in zip(weights, reference)])
        checks[f"{wrapper}_ddl"] = {
            "max_abs_difference": float(differences.max()),  # NaN if any weight is
            "within_tolerance": all(torch.isclose(w, r, rtol=RTOL, atol=ATOL).all()
                                    for w, r in zip(weights, reference)),
            "loss": loss_of(weights, batches)}
    return checks


def measure_steps(args: argparse.Namespace) -> dict:
    """Every side's slowest-rank summary (less disturbed run), the plain step, and the ratios."""
    runs = {"steps": args.steps, "warmup": args.warmup}
    sides = [(wrapper, backend) for wrapper in WRAPPERS for backend in BACKENDS]
    measured = interleaved(
        args.repeats,
        *[partial(run_ours, timed_training, NP, backend=backend, wrapper=wrapper, **runs)
          for wrapper, backend in sides],
        partial(run_gloo, plain_training, 1, workload=MLP.name, **runs))
    summaries = {f"{wrapper}_{backend}": best_of([slowest_rank(ranks) for ranks in repeats])
                 for (wrapper, backend), repeats in zip(sides, measured)}
    summaries["plain"] = best_of([ranks[0] for ranks in measured[-1]])
    ratios = {f"{wrapper}_ddl_over_gloo": summaries[f"{wrapper}_ddl"]["median_s"]
              / summaries[f"{wrapper}_gloo"]["median_s"] for wrapper in WRAPPERS}
    return {"sides": summaries, "ratios": ratios,
            "meets_target": ratios["ddp_ddl_over_gloo"] <= TARGET_DDP_DDL_OVER_GLOO}


def print_steps(steps: dict) -> None:
    sides = steps["sides"]
    plain_s = sides["plain"]["median_s"]
    verdict = "meets" if steps["meets_target"] else "MISSES"
    targets = {"ddp": (f"<={TARGET_DDP_DDL_OVER_GLOO:.1f}", verdict), "fsdp": ("-", ""), "fsdp2": ("-", "")}
    rows = []
    for wrapper in WRAPPERS:
        gloo_s, ddl_s = sides[f"{wrapper}_gloo"]["median_s"], sides[f"{wrapper}_ddl"]["median_s"]
        rows.append([LABELS[wrapper], f"{gloo_s * 1e3:.2f}", f"{ddl_s * 1e3:.2f}", f"{ddl_s / gloo_s:.2f}",
                     *targets[wrapper], f"{gloo_s / plain_s:.2f}", f"{ddl_s / plain_s:.2f}"])
    print_table(f"train step, {MLP.title}, np={NP}: median ms of the slowest rank",
                ["wrapper", "gloo ms", "ddl ms", "ddl/gloo", "target", "verdict", "gloo/plain", "ddl/plain"], rows)
    print(f"plain step without a wrapper (one process): {plain_s * 1e3:.2f} ms")
    for name, summary in sides.items():
        if spread(summary) > SPREAD_WARNING:
            print(f"note: {name} varied: middle half of steps spans {spread(summary):.0%} of the median")


def print_same_weights(checks: dict, steps: int) -> None:
    rows = [[f"{LABELS[wrapper]} ddl", f"{checks[f'{wrapper}_ddl']['max_abs_difference']:.2e}",
             f"{checks[f'{wrapper}_ddl']['loss']:.6f}", f"{checks['one_process_loss']:.6f}",
             "same" if checks[f"{wrapper}_ddl"]["within_tolerance"] else "DIFFERENT"]
            for wrapper in WRAPPERS]
    print_table(f"weights after {steps} steps, np={NP} on halves of each batch vs one process on whole "
                f"batches (rtol {RTOL:g}, atol {ATOL:g})",
                ["side", "max |w - w1|", "loss", "loss (one process)", "verdict"], rows)


def main() -> None:
    args = parse_arguments()
    started = time.perf_counter()
    load_before = warn_if_busy()
    checks = same_weights(SAME_WEIGHTS_STEPS)
    steps = measure_steps(args)
    print_steps(steps)
    print_same_weights(checks, SAME_WEIGHTS_STEPS)
    path = write_results("ddp_backend", {
        "settings": {"layers": MLP.layers, "batch_per_rank": MLP.batch_per_rank,
                     "optimizer": MLP.optimizer_description, "np": NP, "steps": args.steps,
                     "warmup": args.warmup, "repeats": args.repeats, "torch_threads_per_rank": 1,
                     "same_weights_steps": SAME_WEIGHTS_STEPS, "rtol": RTOL, "atol": ATOL},
        "target_ddp_ddl_over_gloo": TARGET_DDP_DDL_OVER_GLOO, **steps, "same_weights": checks,
        "load_average_before": load_before, "wall_s": time.perf_counter() - started,
    })
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python benchmarks/ddp_backend.py --steps 500 --repeats 3")
    return parse_step_timing_arguments(parser)


if __name__ == "__main__":
    main()
