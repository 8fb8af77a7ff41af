"""A training step of the classic MNIST CNN on a GPU: ours against DDP over NCCL.

    python benchmarks/gpu_check_train_step.py OUT.json [--steps 200]
    python benchmarks/gpu_check_train_step.py OUT.json --device cpu --steps 5   # smoke run

Part of `gpu_check.py` (which runs it on the GPU); ``--device cpu`` runs the same sides on
the CPU (DDP over gloo), to try the script where no GPU is. The CNN is PyTorch's MNIST example
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


def place(device_type: str, index: int) -> torch.device:
    return torch.device("cuda", index % torch.cuda.device_count()) if device_type == "cuda" \
        else torch.device("cpu")


def timed_steps(model: nn.Module, optimizer, device: torch.device, steps: int) -> dict:
    images = torch.randn(BATCH, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (BATCH,), device=device)
    loss_fn, times = nn.CrossEntropyLoss(), []
    for step in range(WARMUP + steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    return {"median_s": statistics.median(times), "min_s": min(times), "steps": steps}


def plain(steps: int, device_type: str) -> dict:
    device = place(device_type, 0)
    model = mnist_cnn().to(device)
    return timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), device, steps)


def ddp(rank: int, size: int, port: int, steps: int, device_type: str) -> dict:
    import torch.distributed as dist

    device = place(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        model = nn.parallel.DistributedDataParallel(
            mnist_cnn().to(device), device_ids=[rank] if device.type == "cuda" else None)
        return timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                           device, steps)
    finally:
        dist.destroy_process_group()


def ours(steps: int, device_type: str) -> dict:
    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context

    hvd.init()
    device = place(device_type, hvd.local_rank())
    if device.type == "cuda":
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
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    gpus = torch.cuda.device_count() if on_gpu else 0
    ddp_name = "ddp nccl" if on_gpu else "ddp gloo"
    each = {"steps": args.steps, "device_type": args.device}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        sides = {"plain np 1": pool.apply(plain, (args.steps, args.device))}
    sides[f"{ddp_name} np 1"] = slowest(in_spawned(ddp, 1, **each))
    if gpus >= 2 or not on_gpu:  # NCCL refuses two ranks on one GPU
        sides[f"{ddp_name} np 2"] = slowest(in_spawned(ddp, 2, **each))
    sides["ours np 1"] = slowest(run_ours_with(ours, 1, each))
    if on_gpu:
        sides["ours nccl np 1"] = slowest(run_ours_with(ours, 1, each,
                                                        env={"DDL_MAGIC_TORCH_PLANE": "nccl"}))
    sides["ours np 2"] = slowest(run_ours_with(ours, 2, each))
    floor = sides["plain np 1"]["median_s"]
    print(f"MNIST CNN step on {args.device}, batch {BATCH} per rank, {args.steps} timed steps, "
          f"{gpus} GPU(s): median ms of the slowest rank")
    for name, result in sides.items():
        print(f"  {name:16} {result['median_s'] * 1e3:8.3f} ms  ({result['median_s'] / floor:.2f}x plain)"
              f"{'  ' + result['transport'] if 'transport' in result else ''}")
    with open(args.output, "w") as out:
        json.dump({"gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else args.device,
                   "batch_per_rank": BATCH, "sides": sides}, out, indent=2)


if __name__ == "__main__":
    sys.exit(main())
