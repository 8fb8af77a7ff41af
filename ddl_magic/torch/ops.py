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
            name: str | None, wait_follows: bool = False, **fields) -> Handle:
    queue = context.current(api).queue
    if name is None:
        name = f"{kind}.noname.{next(_unnamed[kind])}"
    shape = tuple(tensor.shape) if tensor is not None else ()
    dtype = tensor.dtype if tensor is not None else torch.uint8
    return queue.submit(Request(name, kind, dtype, shape, **fields), tensor, output, wait_follows)


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


def _allreduce_now(tensor, average, name, op, prescale, postscale) -> torch.Tensor:
    """The blocking allreduce: submitted as one the caller waits for at once."""
    handle = _allreduce_into(_plain(tensor), None, average, name, op, prescale, postscale,
                             "allreduce", wait_follows=True)
    return synchronize(handle)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Start reducing `tensor` over all ranks, in place."""
    target = _contiguous_in_place(tensor.detach(), "allreduce_async_")
    return _allreduce_into(target, target, average, name, op, prescale_factor, postscale_factor,
                           "allreduce_async_")


def _allreduce_into(tensor, output, average, name, op, prescale, postscale, api,
                    wait_follows: bool = False) -> Handle:
    reduce_op = as_reduce_op(op, average)
    return _submit(api, "allreduce", tensor, output, name, wait_follows, op=int(reduce_op),
                   prescale=float(prescale), postscale=float(postscale))


class _DifferentiableAllreduce(torch.autograd.Function):
    """allreduce is linear, so its gradient is the allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale):
        ctx.args = (average, op, prescale, postscale)
        return _allreduce_now(tensor, average, name, op, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale = ctx.args
        reduced = _allreduce_now(grad, average, None, op, prescale, postscale)
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
        reduced = _allreduce_now(compressed, average, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks, in place, and return it."""
    target = _contiguous_in_place(tensor.detach(), "allreduce_")
    return synchronize(_allreduce_into(target, target, average, name, op, prescale_factor,
                                       postscale_factor, "allreduce_", wait_follows=True))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set=None) -> list[Handle]:
    """Start allreduces of several tensors; they are fused into one ring pass where they fit."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor,
                              wait_follows=False)


def _grouped_allreduce(tensors, average, name, op, prescale, postscale, wait_follows) -> list[Handle]:
    base = name or f"grouped_allreduce.noname.{next(_unnamed['grouped_allreduce'])}"
    return [_allreduce_into(_plain(t), None, average, f"{base}.{i}", op, prescale, postscale,
                            "grouped_allreduce", wait_follows) for i, t in enumerate(tensors)]


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression=None, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=None) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks in as few ring passes as fusion allows."""
    handles = _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor,
                                 wait_follows=True)
    return [synchronize(h) for h in handles]


# ---- allgather ----------------------------------------------------------------------------

def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set=None) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0 (sizes may differ per rank)."""
    return _allgather_of(tensor, name, "allgather_async", wait_follows=False)


def _allgather_of(tensor, name, api, wait_follows) -> Handle:
    source = tensor.detach().contiguous()
    if source.dim() == 0:
        source = source.reshape(1)
    return _submit(api, "allgather", source, None, name, wait_follows)


def _allgather_now(tensor, name=None) -> torch.Tensor:
    return synchronize(_allgather_of(tensor, name, "allgather", wait_follows=True))


class _DifferentiableAllgather(torch.autograd.Function):
    """The gradient of a rank's slice is the sum over ranks of the gradient at that slice."""

    @staticmethod
    def forward(ctx, tensor, name):
        gathered = _allgather_now(tensor, name)
        dims = _allgather_now(torch.tensor([tensor.shape[0] if tensor.dim() else 1]))
        ctx.start = int(dims[:rank()].sum())
        ctx.length = int(dims[rank()])
        return gathered

    @staticmethod
    def backward(ctx, grad):
        summed = _allreduce_now(grad.contiguous(), None, None, Sum, 1.0, 1.0)
        return summed[ctx.start:ctx.start + ctx.length], None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0, in rank order."""
    if tensor.requires_grad:
        return _DifferentiableAllgather.apply(tensor, name)
    return _allgather_now(tensor, name)


# ---- broadcast ----------------------------------------------------------------------------

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set=None) -> Handle:
    """Start copying `root_rank`'s `tensor` to every rank, into a new tensor."""
    return _broadcast_anew(tensor, root_rank, name, "broadcast_async", wait_follows=False)


def _broadcast_anew(tensor, root_rank, name, api, wait_follows) -> Handle:
    source = tensor.detach().contiguous()
    output = source.clone() if rank() == root_rank else torch.empty_like(source)
    return _broadcast_into(source, output, root_rank, name, api, wait_follows)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set=None) -> Handle:
    """Start copying `root_rank`'s `tensor` into `tensor` on every rank."""
    target = _contiguous_in_place(tensor.detach(), "broadcast_async_")
    return _broadcast_into(target, target, root_rank, name, "broadcast_async_")


def _broadcast_into(tensor, output, root_rank, name, api, wait_follows: bool = False) -> Handle:
    world_size = context.current(api).world.size
    if not 0 <= root_rank < world_size:
        raise ValueError(f"{api}: root_rank {root_rank} is not a rank of this run (size {world_size})")
    return _submit(api, "broadcast", tensor, output, name, wait_follows, root=int(root_rank))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set=None) -> torch.Tensor:
    """Return `root_rank`'s `tensor` on every rank."""
    return synchronize(_broadcast_anew(tensor, root_rank, name, "broadcast", wait_follows=True))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set=None) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s, on every rank, and return it."""
    target = _contiguous_in_place(tensor.detach(), "broadcast_")
    return synchronize(_broadcast_into(target, target, root_rank, name, "broadcast_",
                                       wait_follows=True))


# ---- barrier ------------------------------------------------------------------------------

def barrier(process_set=None) -> None:
    """Return once every rank has called `barrier()`."""
    synchronize(_submit("barrier", "barrier", None, None, None, wait_follows=True))


def join(device: int = -1) -> int:
    """Wait for every rank to join, meanwhile taking part in other ranks' allreduces with zeros.

    For ranks with uneven amounts of data: a rank that runs out calls `join()` while the
    others keep training; their averages still divide by `size()`. Returns the rank that
    joined last. Allgather and broadcast raise while some rank has joined.
    """
    return int(synchronize(_submit("join", "join", None, None, "join", wait_follows=True)).item())
