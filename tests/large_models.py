"""Model-parallel torch code as its users write it, for the tests: HSDP on a 2-D mesh, FSDP2 with
tensor parallelism on a small transformer block, each checked against one process.

Every function that trains runs on every rank of a run of 4 and returns what the tests compare:
the full weights (`DTensor.full_tensor()`, itself a collective) and the losses. The same
functions run over `ddl` and over `gloo`; `*_alone` trains the same steps in one process on the
whole batch, which the ranks split between them.
"""

from __future__ import annotations

SAMPLES = 32
STEPS = 4
WIDTH, HIDDEN, CLASSES = 8, 32, 4


def data():
    import torch

    generator = torch.Generator().manual_seed(1)
    return (torch.randn(SAMPLES, WIDTH, generator=generator),
            torch.randint(0, CLASSES, (SAMPLES,), generator=generator))


def block_model(checkpointed: bool = True):
    """Two residual MLP blocks (the feed-forward half of a transformer block) and a head; the
    blocks recompute their activations in backward when `checkpointed`."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

        def forward(self, x):
            feed_forward = lambda h: self.down(torch.relu(self.up(h)))  # noqa: E731
            return x + (checkpoint(feed_forward, x, use_reentrant=False) if checkpointed
                        else feed_forward(x))

    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(WIDTH, CLASSES))


def train(model, batches_of_this_rank, steps: int = STEPS, optimizer=None) -> list[float]:
    """Adam (lr 0.01, or `optimizer`) on the same batch each step; the losses."""
    import torch

    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        x, y = batches_of_this_rank
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_weights(model) -> list:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()]


def train_hsdp(backend: str, checkpoint_to: str | None = None) -> dict:
    """HSDP: parameters sharded over the "shard" dimension (2 ranks), replicated over the
    "replicate" one (2 ranks); each rank trains on its quarter of the batch. The trained
    model is saved with `torch.distributed.checkpoint` to `checkpoint_to`, if given."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    model = block_model()
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = data()
    losses = train(model, (x[rank::size], y[rank::size]))
    if checkpoint_to is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint_to)
    return {"weights": full_weights(model), "losses": losses,
            "shard_shapes": [tuple(p.to_local().shape) for p in model.parameters()]}


def train_fsdp_tp(backend: str) -> dict:
    """FSDP2 over "dp" (2 ranks) of blocks tensor-parallel over "tp" (2 ranks): `up` split by
    columns, `down` by rows, as Megatron splits a feed-forward layer. The two ranks of a "tp"
    pair see the same batch; the two "dp" halves see different halves of it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not dist.is_initialized():
        dist.init_process_group(backend)
    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("dp", "tp"))
    model = block_model()
    for block in model[:2]:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    x, y = data()
    losses = train(model, (x[dp::dp_size], y[dp::dp_size]))
    return {"weights": full_weights(model), "losses": losses,
            "up_local_shape": tuple(model[0].up.weight.to_local().shape)}


def train_alone() -> list:
    """One process, the whole batch: the ranks' gradients, averaged over equal shares of the
    batch, are this batch's gradient."""
    model = block_model(checkpointed=False)
    train(model, data())
    return full_weights(model)
