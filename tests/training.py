"""Plain torch.distributed training code, as a TorchDistributor user writes it, for the tests.

`train` runs on every rank of a run and returns rank 0's final weights along with every
rank's checksum of them; `train_alone` runs the same steps in one process on the whole
batch. With the batch split evenly, DDP's averaged gradient is the whole batch's gradient,
so the two must end with the same weights.
"""

from __future__ import annotations

import os
import signal

SAMPLES = 48  # divisible by every world size the tests use (1 to 4)
STEPS = 5


def _model_and_data():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=generator)
    y = torch.randint(0, 3, (SAMPLES,), generator=generator)
    return model, x, y


def train(backend: str, wrapper: str = "ddp", steps: int = STEPS, kill_rank: int | None = None):
    """DDP (or FSDP) training on every rank; `kill_rank` SIGKILLs itself in its third step."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)  # env://: the launcher's MASTER_ADDR, RANK, ...
    rank, size = dist.get_rank(), dist.get_world_size()
    model, x, y = _model_and_data()
    if wrapper == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(steps):
        if rank == kill_rank and step == 2:
            print(f"rank {rank} kills itself in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(wrapped(x[rank::size]), y[rank::size])
        loss.backward()
        optimizer.step()
    if wrapper == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped):
            weights = [p.detach().clone() for p in wrapped.parameters()]
    else:
        weights = [p.detach().clone() for p in model.parameters()]
    checksums = [None] * size
    dist.all_gather_object(checksums, sum(float(w.double().sum()) for w in weights))
    return weights, checksums


def train_fully_sharded(backend: str, sharding: str, steps: int = STEPS) -> dict:
    """FSDP2 (`fully_shard` on a 1-D `DeviceMesh`) training on every rank, each on its share
    of the batch. `sharding` is "per_layer" (each Linear, then the whole model, as FSDP2's
    users write it) or "whole" (the model as one unit). Returns the full weights
    (`DTensor.full_tensor()`, itself an all-gather) and this rank's shard of each parameter's shape."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    model, x, y = _model_and_data()
    if sharding == "per_layer":
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rank::size]), y[rank::size]).backward()
        optimizer.step()
    return {"weights": [p.full_tensor().detach().clone() for p in model.parameters()],
            "shard_shapes": [tuple(p.to_local().shape) for p in model.parameters()]}


def train_alone(steps: int = STEPS):
    """The same steps in one process, on the whole batch."""
    import torch

    model, x, y = _model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_same_weights(weights, reference) -> None:
    import torch

    assert len(weights) == len(reference)
    for got, expected in zip(weights, reference):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def launcher_environment():
    """What a rank sees of torchrun's and Horovod's environment."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
             "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
    return {name: os.environ.get(name) for name in names}
