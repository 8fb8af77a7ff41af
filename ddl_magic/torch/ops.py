"""Horovod's collective operations on torch tensors: `allreduce`, `allgather`, `broadcast`, ...

Every operation has an async form returning a handle (`allreduce_async`), a blocking form
(`allreduce`), and where Horovod has one an in-place form (`allreduce_`). Operations without
a `name` are named by a per-kind counter, which matches across ranks as long as every rank
calls them in the same order (as with Horovod).

    >>> import ddl_magic.torch as hvd
    >>> hvd.init()
    >>> hvd.allreduce(torch.tensor([1.0, 2.0]), op=hvd.Sum)   # a world of one
    tensor([1., 2.])
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from ..runtime import context
from ..runtime.negotiation import Request
from ..runtime.op_queue import Handle
from ..runtime.reduce_ops import ReduceOp, as_reduce_op

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM,
                                           ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)

_unnamed = defaultdict(itertools.count)


def init(*args, **kwargs) -> None:
    """Join the run's ring (or become a world of one outside a launcher). Safe to call twice."""
    context.init()


def shutdown() -> None:
    """Leave the ring; collectives raise until the next `init()`."""
    context.shutdown()


def is_initialized() -> bool:
    return context.is_initialized()


def rank() -> int:
    return context.current("rank").world.rank


def size() -> int:
    return context.current("size").world.size


def local_rank() -> int:
    return context.current("local_rank").world.local_rank


def local_size() -> int:
    return context.current("local_size").world.local_size


def cross_rank() -> int:
    return context.current("cross_rank").world.cross_rank


def cross_size() -> int:
    return context.current("cross_size").world.cross_size


def poll(handle: Handle) -> bool:
    """True once the operation behind `handle` has completed (never blocks)."""
    return handle.done()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for the operation behind `handle` and return its output tensor."""
    return handle.wait()


def _submit(api: str, kind: str, tensor: torch.Tensor | None, output: torch.Tensor | None,
            name: str | None, **fields) -> Handle:
    queue = context.current(api).queue
    if name is None:
        name = f"{kind}.noname.{next(_unnamed[kind])}"
    shape = tuple(tensor.shape) if tensor is not None else ()
    dtype = tensor.dtype if tensor is not None else torch.uint8
    return queue.submit(Request(name, kind, dtype, shape, **fields), tensor, output)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached from autograd and contiguous, without a torch call when it already is."""
    if tensor.requires_grad or not tensor.is_contiguous():
        return tensor.detach().contiguous()
    return tensor


def _contiguous_in_place(tensor: torch.Tensor, api: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"{api}: in-place operations need a contiguous tensor; "
                         "call tensor.contiguous() first or use the out-of-place form")
    return tensor


# ---- allreduce ----------------------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Start reducing `tensor` over all ranks into a new tensor; `synchronize` returns it."""
    # The output is allocated when the reduction runs, on the background thread: every torch
    # call here lets that thread take the GIL, which slows a burst of submissions tenfold.
    return _allreduce_into(_plain(tensor), None, average, name, op,
                           prescale_factor, postscale_factor, "allreduce_async")


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Start reducing `tensor` over all ranks, in place."""
    target = _contiguous_in_place(tensor.detach(), "allreduce_async_")
    return _allreduce_into(target, target, average, name, op, prescale_factor, postscale_factor,
                           "allreduce_async_")


def _allreduce_into(tensor, output, average, name, op, prescale, postscale, api) -> Handle:
    reduce_op = as_reduce_op(op, average)
    return _submit(api, "allreduce", tensor, output, name, op=int(reduce_op),
                   prescale=float(prescale), postscale=float(postscale))


class _DifferentiableAllreduce(torch.autograd.Function):
    """allreduce is linear, so its gradient is the allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale):
        ctx.args = (average, op, prescale, postscale)
        return synchronize(allreduce_async(tensor, average, name, op, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale = ctx.args
        reduced = synchronize(allreduce_async(grad, average, None, op, prescale, postscale))
        return reduced, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=None, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks (Average by default) and return the result.

    On 2 ranks, ``hvd.allreduce(torch.tensor([float(hvd.rank())]))`` is ``tensor([0.5])`` on
    both, and with ``op=hvd.Sum`` it is ``tensor([1.])``.
    """
    from .compression import Compression
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad:
        reduced = _DifferentiableAllreduce.apply(compressed, average, name, op,
                                                 prescale_factor, postscale_factor)
    else:
        reduced = synchronize(allreduce_async(compressed, average, name, op,
                                              prescale_factor, postscale_factor))
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks, in place, and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set=None) -> list[Handle]:
    """Start allreduces of several tensors; they are fused into one ring pass where they fit."""
    base = name or f"grouped_allreduce.noname.{next(_unnamed['grouped_allreduce'])}"
    return [allreduce_async(t, average, f"{base}.{i}", op, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression=None, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=None) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks in as few ring passes as fusion allows."""
    handles = grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor)
    return [synchronize(h) for h in handles]


# ---- allgather ----------------------------------------------------------------------------

def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set=None) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0 (sizes may differ per rank)."""
    source = tensor.detach().contiguous()
    if source.dim() == 0:
        source = source.reshape(1)
    return _submit("allgather_async", "allgather", source, None, name)


class _DifferentiableAllgather(torch.autograd.Function):
    """The gradient of a rank's slice is the sum over ranks of the gradient at that slice."""

    @staticmethod
    def forward(ctx, tensor, name):
        gathered = synchronize(allgather_async(tensor, name))
        dims = synchronize(allgather_async(torch.tensor([tensor.shape[0] if tensor.dim() else 1])))
        ctx.start = int(dims[:rank()].sum())
        ctx.length = int(dims[rank()])
        return gathered

    @staticmethod
    def backward(ctx, grad):
        summed = synchronize(allreduce_async(grad.contiguous(), op=Sum))
        return summed[ctx.start:ctx.start + ctx.length], None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0, in rank order."""
    if tensor.requires_grad:
        return _DifferentiableAllgather.apply(tensor, name)
    return synchronize(allgather_async(tensor, name))


# ---- broadcast ----------------------------------------------------------------------------

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set=None) -> Handle:
    """Start copying `root_rank`'s `tensor` to every rank, into a new tensor."""
    source = tensor.detach().contiguous()
    output = source.clone() if rank() == root_rank else torch.empty_like(source)
    return _broadcast_into(source, output, root_rank, name, "broadcast_async")


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set=None) -> Handle:
    """Start copying `root_rank`'s `tensor` into `tensor` on every rank."""
    target = _contiguous_in_place(tensor.detach(), "broadcast_async_")
    return _broadcast_into(target, target, root_rank, name, "broadcast_async_")


def _broadcast_into(tensor, output, root_rank, name, api) -> Handle:
    world_size = context.current(api).world.size
    if not 0 <= root_rank < world_size:
        raise ValueError(f"{api}: root_rank {root_rank} is not a rank of this run (size {world_size})")
    return _submit(api, "broadcast", tensor, output, name, root=int(root_rank))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set=None) -> torch.Tensor:
    """Return `root_rank`'s `tensor` on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set=None) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s, on every rank, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


# ---- barrier ------------------------------------------------------------------------------

def barrier(process_set=None) -> None:
    """Return once every rank has called `barrier()`."""
    synchronize(_submit("barrier", "barrier", None, None, None))


def join(device: int = -1) -> int:
    """Wait for every rank to join, meanwhile taking part in other ranks' allreduces with zeros.

    For ranks with uneven amounts of data: a rank that runs out calls `join()` while the
    others keep training; their averages still divide by `size()`. Returns the rank that
    joined last. Allgather and broadcast raise while some rank has joined.
    """
    return int(synchronize(_submit("join", "join", None, None, "join")).item())
