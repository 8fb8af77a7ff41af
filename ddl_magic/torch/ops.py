"""Horovod's collective operations on torch tensors: `allreduce`, `allgather`, `broadcast`, ...

Every operation has an async form returning a handle (`allreduce_async`), a blocking form
(`allreduce`), and where Horovod has one an in-place form (`allreduce_`). The grouped forms
(`grouped_allreduce`, `grouped_allgather`) take a list of tensors and return one handle for
all of them. Operations without a `name` are named by a per-kind counter, which matches
across ranks as long as every rank calls them in the same order (as with Horovod).

    >>> import ddl_magic.torch as hvd
    >>> hvd.init()
    >>> hvd.allreduce(torch.tensor([1.0, 2.0]), op=hvd.Sum)   # a world of one
    tensor([1., 2.])
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from ..kernels.casting import SUPPORTED_DTYPES as REDUCIBLE_DTYPES
from ..runtime import context
from ..runtime.negotiation import Request
from ..runtime.op_queue import Handle
from ..runtime.reduce_ops import ReduceOp, as_reduce_op
from ..runtime.world import World
from .compression import Compression
from .process_sets import (active, active_runtime, entered, global_process_set,
                           on_process_set)

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM,
                                           ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)

# An unnamed operation is named after how many of its kind this process submitted over the
# same ring before it, so ranks that call them in the same order name them alike. A call that
# raises consumes no number, and the count restarts with every ring (each init(), each
# process set): ranks that form a ring together count together, even if one submitted more
# than the others before a failure.
_unnamed_lock = threading.Lock()


@contextlib.contextmanager
def _op_name(kind: str, name: str | None) -> Iterator[str]:
    """`name`, or the next `{kind}.noname.N`, which counts as used only if the body returns."""
    if name is not None:
        yield name
        return
    counts = active_runtime(kind).unnamed_submitted
    with _unnamed_lock:
        yield f"{kind}.noname.{counts[kind]}"
        counts[kind] += 1


def _unnamed_number(kind: str) -> int:
    """How many things of `kind` this process numbered over the active ring before (and one
    more now): ranks that number them in the same order agree on their numbers."""
    counts = active_runtime(kind).unnamed_submitted
    with _unnamed_lock:
        counts[kind] += 1
        return counts[kind] - 1


def _ring(api: str) -> World:
    """This rank's place in the ring the operation runs over (the active process set's)."""
    return active_runtime(api).world


def _backward_over_forward_set(function: type[torch.autograd.Function]):
    """An autograd Function whose backward runs over the process set its forward ran over
    (autograd calls backward later, outside the call that chose the set)."""
    forward, backward = function.forward, function.backward

    def forward_in_set(ctx, *args):
        ctx.process_set = active()
        return forward(ctx, *args)

    def backward_in_set(ctx, *grads):
        with entered(ctx.process_set):
            return backward(ctx, *grads)

    function.forward, function.backward = staticmethod(forward_in_set), staticmethod(backward_in_set)
    return function


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


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (always so on one host)."""
    return context.current("is_homogeneous").world.homogeneous


class GroupHandle:
    """One handle for a grouped operation: `synchronize` returns its outputs as a list."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[Handle]):
        self.handles = handles

    def done(self) -> bool:
        return all(handle.done() for handle in self.handles)

    def wait(self) -> list[torch.Tensor]:
        return [handle.wait() for handle in self.handles]


def poll(handle: Handle | GroupHandle) -> bool:
    """True once the operation behind `handle` has completed (never blocks)."""
    return handle.done()


def synchronize(handle: Handle | GroupHandle) -> torch.Tensor | list[torch.Tensor]:
    """Wait for the operation behind `handle` and return its output tensor (a list of them
    for a grouped operation)."""
    return handle.wait()


def _submit(api: str, kind: str, tensor: torch.Tensor | None, output: torch.Tensor | None,
            name: str | None, wait_follows: bool = False, **fields) -> Handle:
    queue = active_runtime(api).queue
    if name is not None:  # the common case skips the context manager, which costs more than a submit
        return queue.submit(Request.of(name, kind, tensor, **fields), tensor, output, wait_follows)
    with _op_name(kind, name) as op_name:
        return queue.submit(Request.of(op_name, kind, tensor, **fields), tensor, output,
                            wait_follows)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached from autograd and contiguous, without a torch call when it already is."""
    if tensor.requires_grad or not tensor.is_contiguous():
        return tensor.detach().contiguous()
    return tensor


def _in_place_target(tensor: torch.Tensor, api: str) -> torch.Tensor:
    """`tensor` detached from autograd (it shares the storage and version counter either
    way), refused unless contiguous. A tensor that needs no grad (a `.grad`) is used as it
    is: each torch call here lets the background thread take the GIL mid-burst."""
    if not tensor.is_contiguous():
        raise ValueError(f"{api}: in-place operations need a contiguous tensor; "
                         "call tensor.contiguous() first or use the out-of-place form")
    return tensor.detach() if tensor.requires_grad else tensor


# ---- allreduce ----------------------------------------------------------------------------

@on_process_set
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


@on_process_set
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Start reducing `tensor` over all ranks, in place."""
    target = _in_place_target(tensor, "allreduce_async_")
    return _allreduce_into(target, target, average, name, op, prescale_factor, postscale_factor,
                           "allreduce_async_")


def _allreduce_into(tensor, output, average, name, op, prescale, postscale, api,
                    wait_follows: bool = False) -> Handle:
    reduce_op = as_reduce_op(op, average)
    check_reducible(tensor, api)
    return _submit(api, "allreduce", tensor, output, name, wait_follows, op=int(reduce_op),
                   prescale=float(prescale), postscale=float(postscale))


def check_reducible(tensor: torch.Tensor, api: str) -> None:
    """Refuse, on the caller's thread, a dtype the reduction kernels do not have."""
    if tensor.dtype not in REDUCIBLE_DTYPES:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in REDUCIBLE_DTYPES))
        raise TypeError(f"{api}: {tensor.dtype} tensors cannot be reduced by ddl_magic; use one "
                        f"of {names} (allgather and broadcast take any dtype)")


@_backward_over_forward_set
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


@on_process_set
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=None, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks (Average by default) and return the result.

    On 2 ranks, ``hvd.allreduce(torch.tensor([float(hvd.rank())]))`` is ``tensor([0.5])`` on
    both, and with ``op=hvd.Sum`` it is ``tensor([1.])``.
    """
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad:
        reduced = _DifferentiableAllreduce.apply(compressed, average, name, op,
                                                 prescale_factor, postscale_factor)
    else:
        reduced = _allreduce_now(compressed, average, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


@on_process_set
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks, in place, and return it."""
    target = _in_place_target(tensor, "allreduce_")
    return synchronize(_allreduce_into(target, target, average, name, op, prescale_factor,
                                       postscale_factor, "allreduce_", wait_follows=True))


@on_process_set
def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set=None) -> GroupHandle:
    """Start reducing several tensors over all ranks, each into a new tensor; they are fused
    into one ring pass where they fit, and `synchronize` returns the list of results."""
    return _grouped_allreduce([_plain(t) for t in tensors], average, name, op, prescale_factor,
                              postscale_factor, "grouped_allreduce_async", in_place=False)


def _grouped_allreduce(tensors, average, name, op, prescale, postscale, api, in_place: bool,
                       wait_follows: bool = False) -> GroupHandle:
    """Tensor i goes under `{name}.{i}`. Every argument is checked before the first tensor is
    submitted: a call that raises leaves nothing behind for the other ranks to wait on."""
    fields = dict(op=int(as_reduce_op(op, average)), prescale=float(prescale),
                  postscale=float(postscale))
    for tensor in tensors:
        check_reducible(tensor, api)
    with _op_name("grouped_allreduce", name) as base:
        return GroupHandle([_submit(api, "allreduce", tensor, tensor if in_place else None,
                                    f"{base}.{i}", wait_follows, **fields)
                            for i, tensor in enumerate(tensors)])


@on_process_set
def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression=None, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=None) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks in as few ring passes as fusion allows.

    >>> weights, bias = hvd.grouped_allreduce([model.weight.grad, model.bias.grad])
    """
    compression = compression or Compression.none
    compressed = [compression.compress(tensor) for tensor in tensors]
    wires = [wire for wire, _ in compressed]
    args = (average, name, op, prescale_factor, postscale_factor)
    if any(wire.requires_grad for wire in wires):
        reduced = _DifferentiableGroupedAllreduce.apply(args, *wires)
    else:
        reduced = _grouped_allreduce_now(wires, *args)
    return [compression.decompress(tensor, ctx) for tensor, (_, ctx) in zip(reduced, compressed)]


def _grouped_allreduce_now(tensors, average, name, op, prescale, postscale) -> list[torch.Tensor]:
    handle = _grouped_allreduce([_plain(t) for t in tensors], average, name, op, prescale,
                                postscale, "grouped_allreduce", in_place=False, wait_follows=True)
    return synchronize(handle)


@_backward_over_forward_set
class _DifferentiableGroupedAllreduce(torch.autograd.Function):
    """Each tensor's gradient is the same grouped allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, args, *tensors):
        ctx.args = args
        return tuple(_grouped_allreduce_now(tensors, *args))

    @staticmethod
    def backward(ctx, *grads):
        average, _, op, prescale, postscale = ctx.args
        return (None, *_grouped_allreduce_now(grads, average, None, op, prescale, postscale))


@on_process_set
def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set=None) -> GroupHandle:
    """Start reducing several tensors over all ranks, each in place."""
    targets = [_in_place_target(t, "grouped_allreduce_async_") for t in tensors]
    return _grouped_allreduce(targets, average, name, op, prescale_factor, postscale_factor,
                              "grouped_allreduce_async_", in_place=True)


@on_process_set
def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set=None) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks, each in place, and return them."""
    targets = [_in_place_target(t, "grouped_allreduce_") for t in tensors]
    synchronize(_grouped_allreduce(targets, average, name, op, prescale_factor,
                                   postscale_factor, "grouped_allreduce_", in_place=True,
                                   wait_follows=True))
    return list(tensors)


# ---- allgather ----------------------------------------------------------------------------

@on_process_set
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set=None) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0 (sizes may differ per rank)."""
    return _allgather_of(tensor, name, "allgather_async", wait_follows=False)


def _allgather_of(tensor, name, api, wait_follows) -> Handle:
    return _submit(api, "allgather", _gatherable(tensor), None, name, wait_follows)


def _gatherable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached and contiguous, a scalar as one row (allgather stacks rows)."""
    source = tensor.detach().contiguous()
    return source.reshape(1) if source.dim() == 0 else source


def _allgather_now(tensor, name=None) -> torch.Tensor:
    return synchronize(_allgather_of(tensor, name, "allgather", wait_follows=True))


@_backward_over_forward_set
class _DifferentiableAllgather(torch.autograd.Function):
    """The gradient of a rank's slice is the average over ranks of the gradient at that slice
    (Horovod's definition: ranks that compute the same loss get their own slice's gradient)."""

    @staticmethod
    def forward(ctx, tensor, name):
        gathered = _allgather_now(tensor, name)
        dims = _allgather_now(torch.tensor([tensor.shape[0] if tensor.dim() else 1]))
        me = _ring("allgather").rank
        ctx.start = int(dims[:me].sum())
        ctx.length = int(dims[me])
        return gathered

    @staticmethod
    def backward(ctx, grad):
        averaged = _allreduce_now(grad.contiguous(), None, None, Average, 1.0, 1.0)
        return averaged[ctx.start:ctx.start + ctx.length], None


@on_process_set
def allgather(tensor: torch.Tensor, name: str | None = None, process_set=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0, in rank order."""
    if tensor.requires_grad:
        return _DifferentiableAllgather.apply(tensor, name)
    return _allgather_now(tensor, name)


@on_process_set
def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set=None) -> GroupHandle:
    """Start allgathers of several tensors; `synchronize` returns the list of results."""
    return _grouped_allgather(tensors, name, "grouped_allgather_async", wait_follows=False)


def _grouped_allgather(tensors, name, api, wait_follows) -> GroupHandle:
    """Tensor i goes under `{name}.{i}`, every tensor checked before any is submitted."""
    sources = [_gatherable(tensor) for tensor in tensors]
    with _op_name("grouped_allgather", name) as base:
        return GroupHandle([_submit(api, "allgather", source, None, f"{base}.{i}", wait_follows)
                            for i, source in enumerate(sources)])


@_backward_over_forward_set
class _DifferentiableGroupedAllgather(torch.autograd.Function):
    """Each tensor's gradient as in `allgather`: the average over ranks at this rank's slice."""

    @staticmethod
    def forward(ctx, name, *tensors):
        handle = _grouped_allgather(tensors, name, "grouped_allgather", wait_follows=True)
        gathered = synchronize(handle)
        # every rank's first dimensions: a row per rank, a column per tensor
        rows = _allgather_now(torch.tensor([[t.shape[0] if t.dim() else 1 for t in tensors]]))
        me = _ring("grouped_allgather").rank
        ctx.starts = rows[:me].sum(0).tolist()
        ctx.lengths = rows[me].tolist()
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads):
        handle = _grouped_allreduce([_plain(grad) for grad in grads], None, None, Average, 1.0,
                                    1.0, "grouped_allgather", in_place=False, wait_follows=True)
        return (None, *(averaged[start:start + length] for averaged, start, length
                        in zip(synchronize(handle), ctx.starts, ctx.lengths)))


@on_process_set
def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set=None) -> list[torch.Tensor]:
    """Concatenate every rank's tensors along dimension 0, in rank order, position by position.

    On 2 ranks, ``hvd.grouped_allgather([torch.tensor([hvd.rank()]), torch.ones(hvd.rank(), 2)])``
    is ``[tensor([0, 1]), torch.ones(1, 2)]`` on both: first dimensions may differ per rank.
    """
    if any(tensor.requires_grad for tensor in tensors):
        return list(_DifferentiableGroupedAllgather.apply(name, *tensors))
    return synchronize(_grouped_allgather(tensors, name, "grouped_allgather", wait_follows=True))


# ---- reducescatter --------------------------------------------------------------------------
# The ring's scatter-reduce phase alone (or one shared-memory phase): each rank receives only
# what it keeps, half the bytes of an allreduce.

def _rows_of(first_dim: int, rank_: int, size_: int) -> tuple[int, int]:
    """Rank `rank_`'s rows of `first_dim`, split as Horovod splits them: the first
    `first_dim % size_` ranks get one row more than the others.

    >>> [_rows_of(5, r, 2) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    base, extra = divmod(first_dim, size_)
    start = rank_ * base + min(rank_, extra)
    return start, start + base + (1 if rank_ < extra else 0)


def _reducescatter_fields(tensor: torch.Tensor, op, prescale, postscale, api: str) -> dict:
    """The request fields of a reducescatter of `tensor`, every argument checked first."""
    if tensor.dim() == 0:
        raise ValueError(f"{api}: a scalar cannot be scattered over ranks; give a tensor with "
                         "at least one dimension (its rows are split between the ranks)")
    reduce_op = as_reduce_op(op)
    check_reducible(tensor, api)
    world = _ring(api).size
    splits = tuple(end - start for start, end in
                   (_rows_of(tensor.shape[0], r, world) for r in range(world)))
    return dict(op=int(reduce_op), prescale=float(prescale), postscale=float(postscale),
                splits=splits)


@on_process_set
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int | None = Average,
                        process_set=None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing `tensor` over all ranks; `synchronize` gives this rank's rows of the
    result (the first `rows % size` ranks get one row more)."""
    return _reducescatter(tensor, name, op, prescale_factor, postscale_factor,
                          "reducescatter_async", wait_follows=False)


def _reducescatter(tensor, name, op, prescale, postscale, api, wait_follows) -> Handle:
    fields = _reducescatter_fields(tensor, op, prescale, postscale, api)
    return _submit(api, "reducescatter", _plain(tensor), None, name, wait_follows, **fields)


def reducescatter_parts_async_(tensor: torch.Tensor, splits: tuple[int, ...], name: str,
                               op: int, prescale: float, postscale: float, api: str) -> Handle:
    """Reduce-scatter in place where rank r keeps `splits[r]` rows instead of Horovod's even
    split (a sharded optimizer's shares of its parameters). `tensor` (contiguous, on the
    host) is the working buffer: the result is a view of this rank's rows of it, and the
    other rows are clobbered."""
    fields = _reducescatter_fields(tensor, op, prescale, postscale, api)
    ranks = _ring(api).size
    if len(splits) != ranks or sum(splits) != tensor.shape[0]:
        raise ValueError(f"{api}: splits {list(splits)} must give each of the {ranks} ranks "
                         f"its rows of the {tensor.shape[0]}")
    fields["splits"] = tuple(int(rows) for rows in splits)
    target = _in_place_target(tensor, api)
    return _submit(api, "reducescatter", target, target, name, **fields)


def allgather_into_async(tensor: torch.Tensor, output: torch.Tensor, name: str) -> Handle:
    """`allgather_async` into `output`, a contiguous host tensor of the gathered shape that
    is reused from call to call (a sharded optimizer's parameters, every step)."""
    return _submit("allgather", "allgather", _gatherable(tensor), output, name)


def _reducescatter_now(tensor, name, op, prescale, postscale) -> torch.Tensor:
    return synchronize(_reducescatter(tensor, name, op, prescale, postscale, "reducescatter",
                                      wait_follows=True))


@_backward_over_forward_set
class _DifferentiableReducescatter(torch.autograd.Function):
    """A rank's rows come from every rank's same rows: the gradient is the allgather of the
    incoming gradients, scaled as Horovod scales it."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale):
        ctx.scale = _reducescatter_gradient_scale(op, prescale, postscale)
        return _reducescatter_now(tensor, name, op, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        return _allgather_now(grad * ctx.scale), None, None, None, None


def _reducescatter_gradient_scale(op, prescale: float, postscale: float) -> float:
    ranks = _ring("reducescatter").size
    return (ranks if as_reduce_op(op) is ReduceOp.SUM else 1.0) * prescale * postscale


@on_process_set
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=None,
                  op: int | None = Average, process_set=None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over all ranks (Average by default) and return this rank's rows.

    On 2 ranks, ``hvd.reducescatter(torch.ones(3, 2), op=hvd.Sum)`` is ``2 * torch.ones(2, 2)``
    on rank 0 and ``2 * torch.ones(1, 2)`` on rank 1.
    """
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad:
        reduced = _DifferentiableReducescatter.apply(compressed, name, op, prescale_factor,
                                                     postscale_factor)
    else:
        reduced = _reducescatter_now(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


@on_process_set
def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                op: int | None = Average, process_set=None,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> GroupHandle:
    """Start reducescattering several tensors at once; `synchronize` gives the list of this
    rank's rows of each."""
    return _grouped_reducescatter(tensors, name, op, prescale_factor, postscale_factor,
                                  "grouped_reducescatter_async", wait_follows=False)


def _grouped_reducescatter(tensors, name, op, prescale, postscale, api, wait_follows):
    """Tensor i goes under `{name}.{i}`, every tensor checked before any is submitted."""
    fields = [_reducescatter_fields(t, op, prescale, postscale, api) for t in tensors]
    with _op_name("grouped_reducescatter", name) as base:
        return GroupHandle([_submit(api, "reducescatter", _plain(tensor), None, f"{base}.{i}",
                                    wait_follows, **tensor_fields)
                            for i, (tensor, tensor_fields) in enumerate(zip(tensors, fields))])


def _grouped_reducescatter_now(tensors, name, op, prescale, postscale) -> list[torch.Tensor]:
    return synchronize(_grouped_reducescatter(tensors, name, op, prescale, postscale,
                                              "grouped_reducescatter", wait_follows=True))


@_backward_over_forward_set
class _DifferentiableGroupedReducescatter(torch.autograd.Function):
    """Each tensor's gradient as in `reducescatter`, gathered in one grouped allgather."""

    @staticmethod
    def forward(ctx, args, *tensors):
        name, op, prescale, postscale = args
        ctx.scale = _reducescatter_gradient_scale(op, prescale, postscale)
        return tuple(_grouped_reducescatter_now(tensors, name, op, prescale, postscale))

    @staticmethod
    def backward(ctx, *grads):
        handle = _grouped_allgather([grad * ctx.scale for grad in grads], None,
                                    "grouped_reducescatter", wait_follows=True)
        return (None, *synchronize(handle))


@on_process_set
def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression=None, op: int | None = Average, process_set=None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """`reducescatter` of several tensors, submitted together: one handle, one wait."""
    compression = compression or Compression.none
    compressed = [compression.compress(tensor) for tensor in tensors]
    wires = [wire for wire, _ in compressed]
    args = (name, op, prescale_factor, postscale_factor)
    if any(wire.requires_grad for wire in wires):
        reduced = _DifferentiableGroupedReducescatter.apply(args, *wires)
    else:
        reduced = _grouped_reducescatter_now(wires, *args)
    return [compression.decompress(tensor, ctx) for tensor, (_, ctx) in zip(reduced, compressed)]


# ---- alltoall -------------------------------------------------------------------------------
# For now an alltoall is an allgather of every rank's input, of which each rank keeps the
# blocks sent to it: right on every transport, at N-1 times the bytes of a direct exchange.

def _alltoall_splits(tensor: torch.Tensor, splits, api: str) -> list[int]:
    """How many rows of `tensor` go to each rank, checked as Horovod checks them."""
    if tensor.dim() == 0:
        raise ValueError(f"{api}: a scalar cannot be split among ranks; give a tensor whose "
                         "rows (dimension 0) go to the ranks")
    ranks, rows = _ring(api).size, tensor.shape[0]
    if splits is None:
        if rows % ranks:
            raise ValueError(f"{api}: {rows} rows cannot be split equally among {ranks} ranks; "
                             "pass splits= (how many rows go to each rank, in rank order)")
        return [rows // ranks] * ranks
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"{api}: splits must hold int32 values, as Horovod's, not {splits.dtype}")
        splits = splits.tolist()
    splits = list(splits)
    if len(splits) != ranks or any(not isinstance(s, int) or s < 0 for s in splits):
        raise ValueError(f"{api}: splits {splits} must give a count of rows, 0 or more, for each "
                         f"of the {ranks} ranks")
    if sum(splits) > rows:
        raise ValueError(f"{api}: splits {splits} send {sum(splits)} rows, but the tensor has {rows}")
    return splits


class _AlltoallHandle:
    """An alltoall in flight: the allgathers of every rank's splits and of every rank's rows."""

    __slots__ = ("_splits", "_rows", "_ring")

    def __init__(self, splits: Handle, rows: Handle, ring: World):
        self._splits, self._rows, self._ring = splits, rows, ring

    def done(self) -> bool:
        return self._splits.done() and self._rows.done()

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows every rank sent this one, in rank order; how many came from each rank)."""
        ranks, me = self._ring.size, self._ring.rank
        sent = self._splits.wait().view(ranks, ranks)  # sent[s, r]: rows rank s sends rank r
        gathered = self._rows.wait()
        blocks, start = [], 0
        for source in range(ranks):
            offset = start + int(sent[source, :me].sum())
            blocks.append(gathered[offset:offset + int(sent[source, me])])
            start += int(sent[source].sum())
        return torch.cat(blocks), sent[:, me].to(torch.int32)


@on_process_set
def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set=None) -> _AlltoallHandle:
    """Start sending `splits[r]` rows of `tensor` to each rank r (equal parts without
    `splits`); `synchronize` gives (the rows received, in rank order; how many from each)."""
    return _alltoall(tensor, splits, name, "alltoall_async")


def _alltoall(tensor, splits, name, api) -> _AlltoallHandle:
    counts = _alltoall_splits(tensor, splits, api)
    with _op_name("alltoall", name) as base:
        return _AlltoallHandle(
            _submit(api, "allgather", torch.tensor(counts), None, f"{base}.splits"),
            _submit(api, "allgather", _gatherable(tensor[:sum(counts)]), None, f"{base}.rows"),
            _ring(api))


@_backward_over_forward_set
class _DifferentiableAlltoall(torch.autograd.Function):
    """The gradient of what a rank sent is what came back when every rank returns the
    gradients of the rows it received, to the ranks they came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name):
        output, received = synchronize(_alltoall(tensor, splits, name, "alltoall"))
        ctx.received, ctx.rows = received, tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received):
        returned, _ = synchronize(_alltoall(grad.contiguous(), ctx.received, None, "alltoall"))
        if returned.shape[0] < ctx.rows:  # rows past the splits were not sent: no gradient
            padding = returned.new_zeros((ctx.rows - returned.shape[0], *returned.shape[1:]))
            returned = torch.cat([returned, padding])
        return returned, None, None


@on_process_set
def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None, process_set=None):
    """Send `splits[r]` rows of `tensor` to each rank r, in rank order (`tensor.shape[0] /
    size` rows each without `splits`); returns the rows every rank sent this one, in rank
    order, and with `splits` also how many came from each rank (an int32 tensor).

    On 2 ranks, rank 0's ``hvd.alltoall(torch.tensor([0, 0, 1]), splits=[2, 1])`` sends
    ``[0, 0]`` to itself and ``[1]`` to rank 1.
    """
    if tensor.requires_grad:
        output, received = _DifferentiableAlltoall.apply(tensor, splits, name)
    else:
        output, received = synchronize(_alltoall(tensor, splits, name, "alltoall"))
    return output if splits is None else (output, received)


# ---- sparse allreduce ----------------------------------------------------------------------

@on_process_set
def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int | None = None,
                           process_set=None) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO `tensor` over all ranks (op Sum or Average) by gathering
    every rank's indices and values; the returned function waits and gives the result, a
    sparse tensor whose repeated indices add up when coalesced (Horovod's contract).

    >>> reduced = hvd.sparse_allreduce_async(embedding.weight.grad, name="emb", op=hvd.Average)()
    """
    reduce_op = as_reduce_op(op)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"sparse_allreduce_async: op must be Sum or Average, not {reduce_op.name}")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async: the tensor is dense; use allreduce_async")
    # allgather stacks rows: one row per non-zero, its coordinates in the indices' row
    indices = allgather_async(tensor._indices().transpose(0, 1), name=f"{name}.indices")
    values = allgather_async(tensor._values(), name=f"{name}.values")
    world_size = _ring("sparse_allreduce_async").size

    def result() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if reduce_op is ReduceOp.AVERAGE:
            gathered_values = gathered_values / world_size
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values,
                                       tensor.shape, check_invariants=True)

    return result


# ---- broadcast ----------------------------------------------------------------------------

@on_process_set
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set=None) -> Handle:
    """Start copying `root_rank`'s `tensor` to every rank, into a new tensor."""
    return _broadcast_anew(tensor, root_rank, name, "broadcast_async", wait_follows=False)


def _broadcast_anew(tensor, root_rank, name, api, wait_follows) -> Handle:
    source = tensor.detach().contiguous()
    output = source.clone() if rank() == root_rank else torch.empty_like(source)
    return _broadcast_into(source, output, root_rank, name, api, wait_follows)


@on_process_set
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set=None) -> Handle:
    """Start copying `root_rank`'s `tensor` into `tensor` on every rank."""
    target = _in_place_target(tensor, "broadcast_async_")
    return _broadcast_into(target, target, root_rank, name, "broadcast_async_")


def _broadcast_into(tensor, output, root_rank, name, api, wait_follows: bool = False) -> Handle:
    """`root_rank` is a global rank, as in Horovod, also over a process set."""
    members = active_runtime(api).world.run_ranks
    if root_rank not in members:
        where = (f"this run (size {len(members)})" if active() is global_process_set
                 else f"{active()}")
        raise ValueError(f"{api}: root_rank {root_rank} is not a rank of {where}")
    return _submit(api, "broadcast", tensor, output, name, wait_follows,
                   root=members.index(root_rank))


@on_process_set
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set=None) -> torch.Tensor:
    """Return `root_rank`'s `tensor` on every rank."""
    if tensor.requires_grad:
        return _DifferentiableBroadcast.apply(tensor, root_rank, name)
    return _broadcast_now(tensor, root_rank, name)


def _broadcast_now(tensor, root_rank, name) -> torch.Tensor:
    return synchronize(_broadcast_anew(tensor, root_rank, name, "broadcast", wait_follows=True))


@_backward_over_forward_set
class _DifferentiableBroadcast(torch.autograd.Function):
    """Only the root's tensor reaches the output: its gradient is the average over ranks of
    the incoming gradient, and every other rank's is zero (as in Horovod)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return _broadcast_now(tensor, root_rank, name)

    @staticmethod
    def backward(ctx, grad):
        averaged = _allreduce_now(grad.contiguous(), None, None, Average, 1.0, 1.0)
        return (averaged if rank() == ctx.root_rank else torch.zeros_like(averaged)), None, None


@on_process_set
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set=None) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s, on every rank, and return it."""
    target = _in_place_target(tensor, "broadcast_")
    return synchronize(_broadcast_into(target, target, root_rank, name, "broadcast_",
                                       wait_follows=True))


# ---- barrier ------------------------------------------------------------------------------

@on_process_set
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
