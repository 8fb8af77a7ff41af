"""The `ddl` backend for torch.distributed: DDP, FSDP, FSDP2 and DTensor over ddl_magic's runtime.

    import torch.distributed as dist
    dist.init_process_group("ddl")          # in any rank ddl_magic launched
    model = torch.nn.parallel.DistributedDataParallel(model)

Every rank ddl_magic launches has the backend registered before the user's code runs, and
`import ddl_magic.torch` registers it anywhere else. Collectives then travel the same way as
Horovod-style ones: negotiated, fused, through shared memory between ranks on one host and
the TCP ring between hosts, and onto the run's timeline.

torch.distributed names nothing: every rank simply calls the same collectives in the same
order. ddl_magic's negotiation matches collectives by name, so each call is named by its kind
and how many calls of that kind came before it, counted modulo a window: a training step's
collectives come back under the same names, which the negotiation's cache recognises, and a
name is reused only once its previous collective has completed. A rank that passes another
shape than the others gets the negotiation's mismatch error, naming every rank's shape.
Each collective starts as soon as every rank has submitted it, without the fusion window:
DDP and FSDP fuse their tensors into buckets themselves.

FSDP2 (`fully_shard`) and DTensor find the group by its name, on a 1-D `DeviceMesh`: the
group keeps the name torch gives it. FSDP2's gradient divide factor reduces with PREMUL_SUM,
which is the runtime's prescale. `gather` and `scatter` (DTensor's `distribute_tensor`
scatters) ride on the runtime's allgather and broadcast.

What is not here: point-to-point `send`/`recv` and `all_to_all` (DTensor on CPU needs none:
it all-gathers instead), and process groups over a subset of the ranks (and so the
DeviceMesh dimensions that do not span every rank, which make such groups).
They raise an error that says so, so use `gloo` for such code.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.futures import Future

from ..runtime import context
from ..runtime.negotiation import Request
from ..runtime.op_queue import Handle
from ..runtime.reduce_ops import ReduceOp
from .ops import check_reducible

BACKEND_NAME = "ddl"
NAME_WINDOW = 64  # collectives of one kind that may be in flight at once

_REDUCE_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVERAGE,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
}


def register() -> None:
    """Make `init_process_group("ddl")` available in this process (harmless to call twice)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True,
                                      devices=["cpu", "cuda"])


def _create_process_group(options, _backend_options) -> "DdlProcessGroup":
    if context.bootstrap is None and options.group_size > 1:
        raise RuntimeError(
            "the ddl backend needs ranks that ddl_magic started (%%horovod, HorovodRunner, "
            "ddlrun, ddl_magic.TorchDistributor); this process was started otherwise (torchrun?): "
            "launch it with `ddlrun -np N python script.py`, or use the gloo backend")
    world = context.init().world
    members = list(options.global_ranks_in_group) or list(range(options.group_size))
    if members != list(range(world.size)) or options.group_rank != world.rank:
        raise ValueError(
            f"the ddl backend runs collectives over every rank of the run ({world.size}); this "
            f"process group has ranks {members}. Create subgroups with a gloo backend, e.g. "
            "dist.new_group(ranks, backend='gloo'). A DeviceMesh makes such subgroups for "
            "each dimension that does not span every rank: give those dimensions gloo, "
            "init_device_mesh(..., backend_override={dim: 'gloo'}), or use a 1-D mesh")
    return DdlProcessGroup(world.rank, world.size, str(options.group_id))


class _Work(dist._Work):
    """An in-flight collective as torch sees it: `wait()` takes part in running it (so a
    blocking call needs no other thread), and its future resolves when it completes."""

    def __init__(self, handles: list[Handle], future: Future):
        super().__init__()
        self._handles = handles
        self._future = future

    def wait(self, timeout=None) -> bool:
        for handle in self._handles:
            handle.wait()  # raises the collective's error, as gloo's wait() does
        # The handles complete before their results are copied where torch wants them (an
        # all_gather's output list, a reduce_scatter's part): the future is set after that.
        self._future.wait()
        return True

    def get_future(self) -> Future:
        return self._future


class DdlProcessGroup(dist.ProcessGroup):
    """torch.distributed's collectives, each submitted to ddl_magic's op queue."""

    def __init__(self, rank: int, size: int, group_id: str):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._prefix = f"ddl{group_id}"
        self._calls: Counter = Counter()
        self._in_flight: dict[str, Handle] = {}
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name on its C++ backends, and a Python process group has none:
    # these overrides keep it here, so `group_name` (DeviceMesh, DTensor, functional
    # collectives resolve a group by it) answers instead of "ProcessGroup name not set".

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, description: str) -> None:
        self._group_desc = description

    def __repr__(self) -> str:
        return f"DdlProcessGroup(rank={self._rank}, size={self._size})"

    # ---- submitting ---------------------------------------------------------------------------

    def _name(self, kind: str) -> str:
        count = self._calls[kind]
        self._calls[kind] = count + 1
        name = f"{self._prefix}.{kind}.{count % NAME_WINDOW}"
        earlier = self._in_flight.get(name)
        if earlier is not None and not earlier.done():
            try:  # every rank submitted it before this one: it completes without us
                earlier.wait()
            except Exception:
                pass  # its own Work reports the failure
        return name

    def _submit(self, api: str, kind: str, tensor: torch.Tensor | None,
                output: torch.Tensor | None, finish, waited_at_once: bool, **fields) -> Handle:
        """Queue one collective; `finish(handle)` runs when it completes and gives the future's value."""
        queue = context.current(f"torch.distributed.{api}").queue
        name = self._name(kind)
        handle = queue.submit(Request.of(name, kind, tensor, **fields), tensor, output,
                              wait_follows=waited_at_once, on_done=finish, fused=True)
        self._in_flight[name] = handle
        return handle

    def _work(self, api: str, submissions, value, opts) -> _Work:
        """Submit `(kind, tensor, output, fields, after)` collectives; the future gets `value`
        once all have completed and each `after(output)` has run.

        A blocking call (`async_op=False`, as all of FSDP2's on CPU) waits on its Work at
        once, and that wait runs the collective: the op queue's thread need not be woken for
        it, which spares a thread switch per collective."""
        future = Future()
        remaining = [len(submissions)]
        failed = []

        def finish(handle: Handle, after) -> None:
            try:
                output = handle.wait()  # complete: returns at once, or raises its error
                if after is not None:
                    after(output)
            except Exception as exc:
                failed.append(exc)
            remaining[0] -= 1
            if remaining[0] == 0:
                if failed:
                    future.set_exception(failed[0])
                else:
                    future.set_result(value)

        handles = [self._submit(api, kind, tensor, output,
                                lambda handle, after=after: finish(handle, after),
                                not opts.asyncOp, **fields)
                   for kind, tensor, output, fields, after in submissions]
        return _Work(handles, future)

    # ---- what DDP and FSDP call ---------------------------------------------------------------

    def allreduce(self, tensors, opts) -> _Work:
        reduction = _reduction(opts.reduceOp, "all_reduce")
        return self._work("all_reduce", [
            ("allreduce", _contiguous(t, "all_reduce"), t, reduction, None)
            for t in _reducible(tensors, "all_reduce")
        ], tensors, opts)

    def allreduce_coalesced(self, tensors, opts) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts) -> _Work:
        _check_rank(opts.rootRank, self._size, "broadcast")
        return self._work("broadcast", [
            ("broadcast", _contiguous(t, "broadcast"), t, {"root": int(opts.rootRank)}, None)
            for t in tensors
        ], tensors, opts)

    def allgather(self, output_lists, inputs, opts) -> _Work:
        return self._work("all_gather", [
            ("allgather", _flat(t), None, {}, _copied_into(outputs))
            for outputs, t in zip(output_lists, inputs)
        ], output_lists, opts)

    def allgather_coalesced(self, output_lists, inputs, opts) -> _Work:
        """`output_lists[r][i]` receives rank r's `inputs[i]` (as gloo, one list per rank)."""
        if len(output_lists) != self._size:
            raise ValueError(f"torch.distributed.all_gather_coalesced: {len(output_lists)} output "
                             f"lists for a group of {self._size}; give one per rank")
        return self._work("all_gather_coalesced", [
            ("allgather", _flat(t), None, {}, _copied_into([outputs[i] for outputs in output_lists]))
            for i, t in enumerate(inputs)
        ], output_lists, opts)

    def all_gather_single(self, output, input, opts) -> _Work:
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts) -> _Work:
        return self._work("all_gather_single", [
            self._gathered_into(o, i) for o, i in zip(outputs, inputs)
        ], outputs, opts)

    def _gathered_into(self, output: torch.Tensor, tensor: torch.Tensor) -> tuple:
        """The submission that allgathers `tensor` into `output`, every rank's part in rank
        order: directly where `output` is a contiguous host tensor (FSDP2's and FSDP's
        all-gathers), sparing a copy of the whole result."""
        if output.numel() != self._size * tensor.numel():
            raise ValueError(f"torch.distributed.all_gather_single: an output of {output.numel()} "
                             f"elements for {self._size} ranks' {tensor.numel()} each")
        if output.is_cpu and output.is_contiguous():
            return ("allgather", _flat(tensor), output.view(-1), {}, None)
        return ("allgather", _flat(tensor), None, {},
                lambda gathered: output.copy_(gathered.view(output.shape)))

    def reduce_scatter_single(self, output, input, opts) -> _Work:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts) -> _Work:
        reduction = _reduction(opts.reduceOp, "reduce_scatter")
        return self._work("reduce_scatter", [
            _scatter_into(o, i.detach().reshape(-1), [o.numel()] * self._size, reduction)
            for o, i in zip(outputs, _reducible(inputs, "reduce_scatter"))
        ], outputs, opts)

    def reduce_scatter(self, outputs, input_lists, opts) -> _Work:
        reduction = _reduction(opts.reduceOp, "reduce_scatter")
        _reducible([t for inputs in input_lists for t in inputs], "reduce_scatter")
        return self._work("reduce_scatter", [
            _scatter_into(output, torch.cat([t.detach().reshape(-1) for t in inputs]),
                          [t.numel() for t in inputs], reduction)
            for output, inputs in zip(outputs, input_lists)
        ], outputs, opts)

    def reduce(self, tensors, opts) -> _Work:
        _check_rank(opts.rootRank, self._size, "reduce")
        reduction = _reduction(opts.reduceOp, "reduce")
        _reducible(tensors, "reduce")
        keep = self._rank == opts.rootRank
        return self._work("reduce", [
            ("allreduce", t.detach().contiguous(), None, reduction,
             (lambda reduced, t=t: t.copy_(reduced)) if keep else None)
            for t in tensors
        ], tensors, opts)

    def barrier(self, opts=None) -> _Work:
        return self._work("barrier", [("barrier", None, None, {}, None)], [], opts or dist.BarrierOptions())

    # The runtime has no rooted gather or scatter: they ride on its allgather and broadcast,
    # moving `size` times the bytes (every rank receives what only one needs). DTensor's
    # `distribute_tensor` scatters, `gather_object` and `scatter_object_list` do too.

    def gather(self, output_lists, inputs, opts) -> _Work:
        """An allgather of which only the root keeps the result."""
        root = opts.rootRank
        _check_rank(root, self._size, "gather")
        tensor = _single(inputs, "gather")
        outputs = None
        if self._rank == root:
            outputs = _single(output_lists, "gather")
            _check_parts(outputs, self._size, "gather", "gather_list")
        return self._work("gather", [
            ("allgather", _flat(tensor), None, {}, None if outputs is None else _copied_into(outputs))
        ], output_lists, opts)

    def scatter(self, outputs, input_lists, opts) -> _Work:
        """A broadcast of the root's whole list, of which each rank keeps its part. Every
        part has the output's size, as gloo requires."""
        root = opts.rootRank
        _check_rank(root, self._size, "scatter")
        output = _single(outputs, "scatter")
        part = output.numel()
        whole = torch.empty(self._size * part, dtype=output.dtype, device=output.device)
        if self._rank == root:
            parts = _single(input_lists, "scatter")
            _check_parts(parts, self._size, "scatter", "scatter_list")
            if any(p.numel() != part for p in parts):
                raise ValueError(f"torch.distributed.scatter: every tensor of scatter_list needs the "
                                 f"output's {part} elements, not {[p.numel() for p in parts]}")
            torch.cat([p.detach().reshape(-1) for p in parts], out=whole)
        mine = slice(self._rank * part, (self._rank + 1) * part)
        return self._work("scatter", [
            ("broadcast", whole, whole, {"root": root},
             lambda received: output.copy_(received[mine].view(output.shape)))
        ], outputs, opts)

    # ---- what the runtime does not have: say so ---------------------------------------------

    def _unsupported(self, call: str):
        raise NotImplementedError(
            f"torch.distributed.{call} is not supported by the ddl backend (it has all_reduce, "
            "broadcast, all_gather, reduce_scatter, reduce, gather, scatter and barrier); use "
            "dist.init_process_group('gloo') for code that needs it")

    def all_to_all_single(self, *args, **kwargs):
        self._unsupported("all_to_all_single")

    def alltoall(self, *args, **kwargs):
        self._unsupported("all_to_all")

    def send(self, *args, **kwargs):
        self._unsupported("send")

    def recv(self, *args, **kwargs):
        self._unsupported("recv")

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv")


def _reducible(tensors, call: str):
    for tensor in tensors:
        check_reducible(tensor, f"torch.distributed.{call}")
    return tensors


def _reduction(op: dist.ReduceOp, call: str) -> dict:
    """The request fields of a reduction with `op`. PREMUL_SUM (FSDP2's gradient divide
    factor) is a SUM whose inputs are first multiplied by its factor: the runtime's prescale."""
    kind = op.op  # torch hands over a ReduceOp object; its RedOpType says which
    if kind == dist.ReduceOp.PREMUL_SUM:
        return {"op": int(ReduceOp.SUM), "prescale": float(op.factor)}  # a float, or a 1-element tensor
    try:
        return {"op": int(_REDUCE_OPS[kind])}
    except KeyError:
        raise NotImplementedError(
            f"torch.distributed.{call}: the ddl backend reduces with SUM, AVG, MIN, MAX, "
            f"PRODUCT or PREMUL_SUM, not {kind.name}") from None


def _check_rank(root: int, size: int, call: str) -> None:
    if not 0 <= root < size:
        raise ValueError(f"torch.distributed.{call}: rank {root} is not in this group of {size}")


def _contiguous(tensor: torch.Tensor, call: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"torch.distributed.{call} on the ddl backend needs contiguous tensors")
    return tensor.detach()


def _scatter_into(output: torch.Tensor, whole: torch.Tensor, splits: list[int], reduction: dict) -> tuple:
    """The submission that reduce-scatters the 1-D `whole`, rank r keeping `splits[r]`
    elements, into `output` (directly where it is contiguous)."""
    fields = {**reduction, "splits": tuple(splits)}
    if output.is_contiguous():
        return ("reducescatter", whole.contiguous(), output.view(-1), fields, None)
    return ("reducescatter", whole.contiguous(), None, fields,
            lambda mine: output.copy_(mine.view(output.shape)))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous()


def _single(tensors: list, call: str):
    if len(tensors) != 1:
        raise ValueError(f"torch.distributed.{call} on the ddl backend takes one tensor (list) "
                         f"per call, not {len(tensors)}")
    return tensors[0]


def _check_parts(parts: list[torch.Tensor], size: int, call: str, argument: str) -> None:
    if len(parts) != size:
        raise ValueError(f"torch.distributed.{call}: {argument} has {len(parts)} tensors for a "
                         f"group of {size}; give one per rank")


def _copied_into(outputs: list[torch.Tensor]):
    """What copies an allgather's 1-D result, every rank's part in rank order, into `outputs`."""
    return lambda gathered: _copy_chunks(gathered, outputs)


def _copy_chunks(gathered: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    start = 0
    for output in outputs:
        output.view(-1).copy_(gathered[start:start + output.numel()])
        start += output.numel()
