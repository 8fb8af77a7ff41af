"""A training step of the classic MNIST CNN on a GPU: ours against DDP over NCCL.

    python benchmarks/gpu_check_train_step.py OUT.json [--steps 200]

Part of `gpu_check.py` (which runs it); needs a CUDA GPU. The CNN is PyTorch's MNIST example
(two convolutions, 1.2 M parameters, 4.8 MB of gradients), trained with SGD on synthetic
MNIST-shaped batches of 64 per rank that live on the GPU, so the step is the model and the
gradients' allreduce, not a data loader. Each side times every step (zero_grad, forward,
backward, step, then the GPU's work done) after a warm-up; the report is the slowest rank's
median. Sides:

- plain: one process, no wrapper (the floor);
- DDP over NCCL, np 1 (np 2 where the machine has two GPUs: NCCL refuses two ranks per GPU);
- ours, np 1; ours np 1 with DDL_MAGIC_TORCH_PLANE=nccl (the gradients through NCCL);
- ours, np 2 on one GPU (CUDA IPC between the ranks, sharing the GPU's compute).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time

import torch
from torch import nn

from common import run_ours_with

BATCH, WARMUP = 64, 20


def mnist_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10))


def timed_steps(model: nn.Module, optimizer, device: torch.device, steps: int) -> dict:
    images = torch.randn(BATCH, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (BATCH,), device=device)
    loss_fn, times = nn.CrossEntropyLoss(), []
    for step in range(WARMUP + steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    return {"median_s": statistics.median(times), "min_s": min(times), "steps": steps}


def plain(steps: int) -> dict:
    device = torch.device("cuda", 0)
    model = mnist_cnn().to(device)
    return timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), device, steps)


def ddp(rank: int, size: int, port: int, steps: int) -> dict:
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        model = nn.parallel.DistributedDataParallel(mnist_cnn().to(device), device_ids=[rank])
        return timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                           device, steps)
    finally:
        dist.destroy_process_group()


def ours(steps: int) -> dict:
    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context

    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    model = mnist_cnn().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())
    return {**timed_steps(model, optimizer, device, steps),
            "transport": context.current("benchmark").transport}


def in_spawned(fn, np: int, **kwargs) -> list[dict]:
    """`fn(rank, np, port, **kwargs)` on `np` spawned processes (never CUDA in this one)."""
    from common import free_port

    port = free_port()
    with multiprocessing.get_context("spawn").Pool(np) as pool:
        pending = [pool.apply_async(fn, (rank, np, port), kwargs) for rank in range(np)]
        return [result.get(timeout=300) for result in pending]


def slowest(results: list[dict]) -> dict:
    return max(results, key=lambda result: result["median_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="where the JSON goes")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        sides = {"plain np 1": pool.apply(plain, (args.steps,))}
    sides["ddp nccl np 1"] = slowest(in_spawned(ddp, 1, steps=args.steps))
    if gpus >= 2:
        sides["ddp nccl np 2"] = slowest(in_spawned(ddp, 2, steps=args.steps))
    sides["ours np 1"] = slowest(run_ours_with(ours, 1, {"steps": args.steps}))
    sides["ours nccl np 1"] = slowest(run_ours_with(ours, 1, {"steps": args.steps},
                                                    env={"DDL_MAGIC_TORCH_PLANE": "nccl"}))
    sides["ours np 2"] = slowest(run_ours_with(ours, 2, {"steps": args.steps}))
    floor = sides["plain np 1"]["median_s"]
    print(f"MNIST CNN step, batch {BATCH} per rank, {args.steps} timed steps, {gpus} GPU(s): "
          "median ms of the slowest rank")
    for name, result in sides.items():
        print(f"  {name:16} {result['median_s'] * 1e3:8.3f} ms  ({result['median_s'] / floor:.2f}x plain)"
              f"{'  ' + result['transport'] if 'transport' in result else ''}")
    with open(args.output, "w") as out:
        json.dump({"gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else None,
                   "batch_per_rank": BATCH, "sides": sides}, out, indent=2)


if __name__ == "__main__":
    sys.exit(main())
