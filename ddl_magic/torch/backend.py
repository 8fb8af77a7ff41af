"""The `ddl` backend for torch.distributed: DDP, FSDP2, HSDP, tensor parallelism, DTensor and
DeepSpeed over ddl_magic's runtime.

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

Groups. A group over every rank runs over the run's ring; `new_group(ranks)` over some of
them, and so every dimension of an N-D `DeviceMesh` (HSDP's, tensor parallelism's, a
`_flatten`ed one), runs over a ring of its members formed when torch creates the group
(`group_rings.py`): shared memory within a host, TCP across hosts. Ranks in arguments are
the group's, as torch passes them; errors and the timeline name run ranks. `send`/`recv`
between two ranks run over a ring of the pair, formed the first time they talk.

FSDP2 (`fully_shard`), DTensor and functional collectives find a group by its name: the group
keeps the name torch gives it. FSDP2's gradient divide factor reduces with PREMUL_SUM, which is
the runtime's prescale. The runtime has no rooted gather or scatter and no all-to-all: `gather`
and `scatter` (DTensor's `distribute_tensor` scatters) ride on its allgather and broadcast, and
`all_to_all` on its allgather, each moving `size` times the bytes they need.

What is not here: `recv` from any source (a receive is paired with its sender by name), and
the bitwise reductions. They raise an error that says so.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.futures import Future

from ..runtime import context
from ..runtime.context import Runtime
from ..runtime.negotiation import Request
from ..runtime.op_queue import Handle, OpQueue
from ..runtime.reduce_ops import ReduceOp
from . import group_rings
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
    world = context.init().world  # numbered by the group's order of its ranks, as torch numbers them
    members = list(options.global_ranks_in_group) or list(range(world.size))
    runtime = group_rings.ring_for_group(members, options.store, str(options.group_id))
    return DdlProcessGroup(options.group_rank, members, str(options.group_id), runtime,
                           options.store)


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
    """torch.distributed's collectives, each submitted to ddl_magic's op queue: the run's
    ring's, or the group's own ring's where the group has some of the run's ranks."""

    def __init__(self, rank: int, members: list[int], group_id: str, runtime: Runtime | None,
                 store: dist.Store):
        super().__init__(rank, len(members))
        self._rank, self._size = rank, len(members)
        self._members = members  # run ranks, in the group's order
        self._runtime = runtime  # None: the run's ring, whichever is current
        self._store = store
        self._pairs: dict[tuple[int, int], Runtime] = {}  # send/recv rings, by group ranks
        self._prefix = f"ddl{group_id}"
        self._calls: Counter = Counter()
        # Each name's collective until it completes (a name is reused NAME_WINDOW calls later):
        # a completed one is dropped at once, or its output (FSDP2's all-gathered layer) would
        # be kept alive for NAME_WINDOW calls.
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

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices whose tensors this group takes (torch asks a group's C++ backends, and
        a Python group has none): DCP's `async_save` checks for the CPU."""
        return [torch.device("cpu"), *([torch.device("cuda")] if torch.cuda.is_available() else [])]

    def shutdown(self) -> None:
        """`destroy_process_group`: the group's own rings close (the run's ring stays)."""
        for runtime in [self._runtime, *self._pairs.values()]:
            if runtime is not None:
                context.close_subset(runtime)
        self._pairs.clear()

    def __repr__(self) -> str:
        return f"DdlProcessGroup(rank={self._rank}, size={self._size}, ranks={self._members})"

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

    def _queue(self, api: str, runtime: Runtime | None) -> OpQueue:
        """The op queue of `runtime`, or of the run's current ring for None."""
        if runtime is None:
            return context.current(f"torch.distributed.{api}").queue
        if not context.is_open(runtime):
            raise RuntimeError(
                f"torch.distributed.{api}: the ring of {self} was closed (the group was "
                "destroyed, or the run's rings were re-formed, as after a failed pool cell): "
                "create the group again")
        return runtime.queue

    def _submit(self, api: str, kind: str, tensor: torch.Tensor | None,
                output: torch.Tensor | None, finish, waited_at_once: bool,
                runtime: Runtime | None, label: str, **fields) -> Handle:
        """Queue one collective; `finish(handle)` runs when it completes and gives the future's value."""
        queue = self._queue(api, runtime)
        name = self._name(label)
        handle = queue.submit(Request.of(name, kind, tensor, **fields), tensor, output,
                              wait_follows=waited_at_once, on_done=finish, fused=True)
        self._in_flight[name] = handle
        if handle.done():  # it completed before it was kept (a world of one runs at once)
            self._in_flight.pop(name, None)
        return handle

    def _work(self, api: str, submissions, value, opts, runtime: Runtime | None = None,
              label: str | None = None) -> _Work:
        """Submit `(kind, tensor, output, fields, after)` collectives over this group's ring
        (or `runtime`); the future gets `value` once all have completed and each
        `after(output)` has run. Each is named by its kind (or `label`) and how many came before.

        A blocking call (`async_op=False`, as all of FSDP2's on CPU) waits on its Work at
        once, and that wait runs the collective: the op queue's thread need not be woken for
        it, which spares a thread switch per collective."""
        future = Future()
        remaining = [len(submissions)]
        failed = []

        def finish(handle: Handle, after) -> None:
            if self._in_flight.get(handle.name) is handle:
                self._in_flight.pop(handle.name, None)
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

        runtime = runtime or self._runtime
        handles = [self._submit(api, kind, tensor, output,
                                lambda handle, after=after: finish(handle, after),
                                not opts.asyncOp, runtime, label or kind, **fields)
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

    # ---- all-to-all: every rank's allgathered input, of which each keeps its parts --------------
    # The runtime has no all-to-all: it moves `size` times the bytes one would (every rank
    # receives every part), which DTensor's shard-to-shard redistribution on CPU avoids (it
    # all-gathers instead), and which Mixture-of-Experts layers would feel.

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts) -> _Work:
        """Rank r's output holds, in rank order, the part of every rank's input meant for r:
        dim 0 split by `input_split_sizes` (evenly if empty) on the sender, and received into
        parts of `output_split_sizes` rows."""
        rows_in = _split_rows(input, input_split_sizes, self._size, "input")
        rows_out = _split_rows(output, output_split_sizes, self._size, "output")
        row = _row_numel(input, output)
        if list(input_split_sizes) or list(output_split_sizes):
            every_split = self._splits_of_every_rank(rows_in)
        else:
            every_split = [rows_in] * self._size
        for source, splits in enumerate(every_split):
            if splits[self._rank] != rows_out[source]:
                raise ValueError(
                    f"torch.distributed.all_to_all_single: rank {self._rank} expects "
                    f"{rows_out[source]} rows from rank {source}, which sends it {splits[self._rank]}")

        def keep_mine(gathered: torch.Tensor) -> None:
            parts, start = [], 0
            for splits in every_split:
                offset = start + sum(splits[:self._rank]) * row
                parts.append(gathered[offset:offset + splits[self._rank] * row])
                start += sum(splits) * row
            output.copy_(torch.cat(parts).view(output.shape))

        return self._work("all_to_all", [("allgather", _flat(input), None, {}, keep_mine)],
                          [output], opts)

    def alltoall(self, outputs, inputs, opts) -> _Work:
        """`dist.all_to_all`: the lists as one all_to_all_single of their concatenations."""
        _check_parts(inputs, self._size, "all_to_all", "input_tensor_list")
        _check_parts(outputs, self._size, "all_to_all", "output_tensor_list")
        whole_in = torch.cat([t.detach().reshape(-1) for t in inputs])
        whole_out = torch.empty(sum(t.numel() for t in outputs), dtype=whole_in.dtype)
        work = self.all_to_all_single(whole_out, whole_in, [t.numel() for t in outputs],
                                      [t.numel() for t in inputs], opts)
        work.wait()
        _copy_chunks(whole_out, outputs)
        return work

    # torch 2.11 and older call these five by their former names (GPU machines' images
    # hold 2.11): without them FSDP2's all-gather there found "no backend for device type cpu".
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    def _splits_of_every_rank(self, mine: list[int]) -> list[list[int]]:
        """Every rank's input splits, which say where in its input each receiver's part starts."""
        splits = torch.tensor(mine, dtype=torch.int64)
        every = torch.empty(self._size * self._size, dtype=torch.int64)
        self._work("all_to_all_splits", [("allgather", splits, every, {}, None)], [],
                   _NoOptions()).wait()
        return every.view(self._size, self._size).tolist()

    # ---- point to point: a broadcast over the pair's own ring ----------------------------------
    # The sender and the receiver name their n-th message of a tag alike, so a receive pairs
    # with the send it matches whatever else either of them does meanwhile.

    def send(self, tensors, dst: int, tag: int) -> _Work:
        tensor = _single(tensors, "send")
        return self._point_to_point("send", tensor.detach().contiguous(), None, self._rank, dst, tag)

    def recv(self, tensors, src: int, tag: int) -> _Work:
        tensor = _single(tensors, "recv")
        if tensor.is_contiguous():
            return self._point_to_point("recv", tensor.detach(), None, src, self._rank, tag)
        received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return self._point_to_point("recv", received, tensor.copy_, src, self._rank, tag)

    def recv_anysource(self, tensors, tag: int):
        raise NotImplementedError(
            "torch.distributed.recv without src is not supported by the ddl backend: a receive "
            "is paired with its sender's send by name, so name the sender (recv(tensor, src=r))")

    def _point_to_point(self, api: str, tensor: torch.Tensor, after, src: int, dst: int,
                        tag: int) -> _Work:
        peer = dst if src == self._rank else src
        _check_rank(peer, self._size, api)
        if peer == self._rank:
            raise ValueError(f"torch.distributed.{api}: rank {self._rank} cannot {api} to itself")
        pair = (min(src, dst), max(src, dst))
        runtime = self._pairs.get(pair)
        if runtime is None:
            runtime = group_rings.ring_for_pair(
                (self._members[pair[0]], self._members[pair[1]]), self._store, self._group_name)
            self._pairs[pair] = runtime
        return self._work(api, [("broadcast", tensor, tensor, {"root": pair.index(src)}, after)],
                          [tensor], _NoOptions(), runtime, f"p2p.{src}>{dst}.t{tag}")


class _NoOptions:
    """The options of a call that torch hands none (send, recv): its Work is waited on by its
    caller, at once or later."""

    asyncOp = True


def _reducible(tensors, call: str):
    for tensor in tensors:
        check_reducible(tensor, f"torch.distributed.{call}")
    return tensors


def _reduction(op: dist.ReduceOp, call: str) -> dict:
    """The request fields of a reduction with `op`. PREMUL_SUM (FSDP2's gradient divide
    factor) is a SUM whose inputs are first multiplied by its factor: the runtime's prescale."""
    kind = op.op  # torch hands over a ReduceOp object; its RedOpType says which
    if kind == dist.ReduceOp.PREMUL_SUM:
        # Its factor: a float, or a 1-element tensor (read as pickling does: torch 2.11 has no
        # `factor` attribute yet).
        _, factor = op.__getstate__()
        return {"op": int(ReduceOp.SUM), "prescale": float(factor)}
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


def _split_rows(tensor: torch.Tensor, splits, size: int, which: str) -> list[int]:
    """Rows of dim 0 per rank: `splits`, or an even split."""
    splits = [int(s) for s in splits]
    rows = tensor.shape[0] if tensor.dim() else tensor.numel()
    if not splits:
        if rows % size:
            raise ValueError(f"torch.distributed.all_to_all_single: the {which} has {rows} rows, "
                             f"which {size} ranks cannot split evenly; give {which}_split_sizes")
        return [rows // size] * size
    if len(splits) != size or sum(splits) != rows:
        raise ValueError(f"torch.distributed.all_to_all_single: {which}_split_sizes {splits} must "
                         f"give one part per rank ({size}) and add up to its {rows} rows")
    return splits


def _row_numel(input: torch.Tensor, output: torch.Tensor) -> int:
    """Elements per row of dim 0, which input and output share."""
    shape = tuple(input.shape[1:])
    if shape != tuple(output.shape[1:]) or input.dtype != output.dtype:
        raise ValueError("torch.distributed.all_to_all_single: input and output differ beyond dim 0 "
                         f"({tuple(input.shape)} {input.dtype}, {tuple(output.shape)} {output.dtype})")
    return int(torch.Size(shape).numel())


def _copied_into(outputs: list[torch.Tensor]):
    """What copies an allgather's 1-D result, every rank's part in rank order, into `outputs`."""
    return lambda gathered: _copy_chunks(gathered, outputs)


def _copy_chunks(gathered: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    start = 0
    for output in outputs:
        output.view(-1).copy_(gathered[start:start + output.numel()])
        start += output.numel()
