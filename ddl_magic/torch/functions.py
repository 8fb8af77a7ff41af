"""Helpers built on the collectives: objects, parameters and optimizer state across ranks."""

from __future__ import annotations

from typing import Any, Iterable

import cloudpickle
import torch

from .ops import allgather, broadcast, broadcast_async_, rank, synchronize
from .process_sets import on_process_set


@on_process_set
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set=None) -> Any:
    """Return `root_rank`'s `obj` on every rank (any cloudpickle-able object).

    >>> config = hvd.broadcast_object({"lr": 0.1} if hvd.rank() == 0 else None)
    """
    name = name or "broadcast_object"
    if rank() == root_rank:
        payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    length = broadcast(length, root_rank, name=f"{name}.length")
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    payload = broadcast(payload, root_rank, name=f"{name}.payload")
    return cloudpickle.loads(payload.numpy().tobytes())


@on_process_set
def allgather_object(obj: Any, name: str | None = None, process_set=None) -> list[Any]:
    """Return the list of every rank's `obj`, in rank order."""
    name = name or "allgather_object"
    payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=f"{name}.length")
    gathered = allgather(payload, name=f"{name}.payload").numpy().tobytes()
    objects, start = [], 0
    for length in lengths.tolist():
        objects.append(cloudpickle.loads(gathered[start:start + length]))
        start += length
    return objects


@on_process_set
def broadcast_parameters(params: "dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]",
                         root_rank: int = 0, process_set=None) -> None:
    """Overwrite every rank's parameters with `root_rank`'s, in place.

    `params` is a `state_dict()` or `named_parameters()`; all broadcasts run concurrently.

    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, "
                             "not a tensor; pass model.state_dict() or model.named_parameters()")
        handles.append(broadcast_async_(tensor.data, root_rank, name=f"broadcast.{name}"))
    for handle in handles:
        synchronize(handle)


@on_process_set
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set=None) -> None:
    """Give every rank `root_rank`'s optimizer state (momenta, step counts, hyperparameters).

    As in Horovod, an optimizer that has not stepped yet gets a zero gradient for every
    parameter that requires one and has none (code written for Horovod may read it).

    A sharded optimizer (`shard_optimizer_state=True`) keeps a different share of the state
    on each rank: it gets `root_rank`'s hyperparameters only. To restore a checkpoint into
    one, call `load_state_dict` on every rank.

    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    if hasattr(optimizer, "broadcast_hyperparameters"):
        optimizer.broadcast_hyperparameters(root_rank)
        return
    if not optimizer.state:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast_optimizer_state")
    if rank() != root_rank:
        optimizer.load_state_dict(state)
