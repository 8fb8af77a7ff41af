"""Running one negotiated response on this rank: fusion buffer in, data plane, fusion buffer out.

The op queue hands each `Response` here together with this rank's entries for its names.
Everything around the data movement lives here — packing many tensors into one fusion
buffer, the prescale and postscale factors, staging CUDA tensors through host memory where
the plane cannot carry them (its `device_types`), and the timeline's labels — so that the plane (`planes/`:
shared memory, the TCP ring, or both, hierarchically) only moves one flat buffer. On one
host a small allreduce's data may even ride on the negotiation round that agrees on it
(`run_attached`).
"""

from __future__ import annotations

import math
import time

import torch

from .. import kernels
from .negotiation import Request, Response
from .planes import DataPlane
from .reduce_ops import ReduceOp
from .planes.shared_memory import BUFFER_BYTES, MESSAGE_BYTES
from .timeline import recorder


class Entry:
    """This rank's side of one submitted collective: its request, tensors and handle.

    (A class with slots, not a dataclass: a burst of small collectives makes thousands.)
    """

    __slots__ = ("request", "tensor", "output", "handle", "submitted_ns")

    def __init__(self, request: Request, tensor: torch.Tensor | None,
                 output: torch.Tensor | None, handle: "object"):
        self.request, self.tensor, self.output, self.handle = request, tensor, output, handle
        self.submitted_ns = time.monotonic_ns()


TIMELINE_NAMES_LISTED = 16
_REDUCE_OPS = {int(op): op for op in ReduceOp}  # a dict lookup: ReduceOp(n) costs a microsecond
ATTACHABLE_BYTES = BUFFER_BYTES - MESSAGE_BYTES
"""The most data that can ride on a negotiation round (see `CollectiveRunner.attachable`)."""
UNPACKED_ENTRY_BYTES = 64 << 10
"""Attached entries averaging this many bytes are reduced straight into their outputs: a
copy per entry then costs less than unpacking a fusion buffer (a training step's buckets)."""


class CollectiveRunner:
    """Executes responses over one data plane, reusing its fusion buffers between calls."""

    def __init__(self, plane: DataPlane, rank: int, size: int):
        self.plane = plane
        self._rank, self._size = rank, size
        # The group whose negotiation rounds can carry data (every rank on this host), or None.
        self._lockstep = plane.lockstep_group
        # Buffers on the devices the plane carries need no staging (two flags: a small
        # step asks for every tensor, and `tensor.device` costs an object each time).
        self._carries_cpu = "cpu" in plane.device_types
        self._carries_cuda = "cuda" in plane.device_types
        self._fusion: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._pinned: dict[torch.dtype, torch.Tensor] = {}

    def run(self, response: Response, entries: list[Entry]) -> None:
        """Run `response` and write results into the entries' outputs."""
        if response.kind == "allreduce":
            self._allreduce(entries)
        elif response.kind == "reducescatter":
            self._reducescatter(entries[0])
        elif response.kind == "allgather":
            self._allgather(entries[0], response.first_dims)
        elif response.kind == "broadcast":
            self._broadcast(entries[0])
        # "barrier" and "join": agreeing that every rank got here is the whole operation.

    # ---- data that rides on the negotiation round (one host: see HostGroup.exchange) ------

    def attachable(self, entries: list[Entry]) -> int:
        """The bytes of the one fused allreduce that `entries` would make, if it can ride on
        a negotiation round: host tensors (and outputs), every rank on this host, fitting the
        payload area. 0 if not."""
        if self._lockstep is None or not entries:
            return 0
        first = entries[0].request
        key = ("allreduce", first.dtype, first.op, first.prescale, first.postscale)
        total = 0
        for entry in entries:
            request = entry.request
            if (request.kind, request.dtype, request.op, request.prescale,
                    request.postscale) != key or not entry.tensor.is_cpu \
                    or not entry.tensor.is_contiguous() \
                    or (entry.output is not None and not entry.output.is_cpu):
                return 0
            total += entry.tensor.numel()
        total *= first.dtype.itemsize
        return total if total <= ATTACHABLE_BYTES else 0

    def attach(self, entries: list[Entry], payload, nbytes: int) -> None:
        """Pack the entries' tensors, prescaled, straight into the round's payload area
        (`payload(dtype, numel)` views it)."""
        request = entries[0].request
        area = payload(request.dtype, nbytes // request.dtype.itemsize)
        if len(entries) == 1 and request.prescale == 1.0:
            # One torch call, not a pack's five; part of the exchange, as a copy into a
            # segment is (no event of its own: a step's events cost while recording).
            tensor = entries[0].tensor
            area.copy_(tensor if tensor.dim() == 1 else tensor.view(-1))
            return
        with _span(entries, nbytes, "pack"):
            kernels.pack([e.tensor for e in entries], area, request.prescale)

    def run_attached(self, entries: list[Entry]) -> None:
        """Run the allreduce of `entries`, whose data every rank attached to the last
        negotiation round, and write the results into their outputs.

        Large entries are reduced straight into their outputs; many small ones into the
        fusion buffer, unpacked in one call (a copy per entry would cost more than the bytes).
        """
        request = entries[0].request
        op, postscale = self._prepare_allreduce(entries)
        numel = sum(e.tensor.numel() for e in entries)
        nbytes = numel * request.dtype.itemsize
        if len(entries) == 1:
            output = entries[0].output
            # Reduced straight into its output, on a branch of its own: a small step's
            # allreduce pays for every list built below (a microsecond, measured at 4 KiB).
            if _is_host_contiguous(output):
                flat = output if output.dim() == 1 else output.view(-1)
                with _span(entries, nbytes, "shared_memory", op="allreduce", size=self._size):
                    self._lockstep.allreduce_attached((flat,), op.kernel_name)
                _scale(flat, postscale)
                return
        outputs = [e.output for e in entries]
        if nbytes >= len(entries) * UNPACKED_ENTRY_BYTES and all(map(_is_host_contiguous, outputs)):
            flat = [output if output.dim() == 1 else output.view(-1) for output in outputs]
            with _span(entries, nbytes, "shared_memory", op="allreduce", size=self._size):
                self._lockstep.allreduce_attached(flat, op.kernel_name)
            for output in flat:
                _scale(output, postscale)
            return
        reduced = self._fusion_buffer(request.dtype, numel, torch.device("cpu"))
        with _span(entries, nbytes, "shared_memory", op="allreduce", size=self._size):
            self._lockstep.allreduce_attached([reduced], op.kernel_name)
        with _span(entries, nbytes, "unpack"):  # host outputs, as the tensors are
            kernels.unpack(reduced, outputs, postscale)

    # ---- the collectives ----------------------------------------------------------------

    def _prepare_allreduce(self, entries: list[Entry]) -> tuple[ReduceOp, float]:
        """Give out-of-place entries their outputs (made here, off the user's thread); the
        op and the postscale to apply."""
        for entry in entries:
            if entry.output is None:
                entry.output = torch.empty_like(entry.tensor)
        request = entries[0].request
        op = _REDUCE_OPS[request.op]
        return op, _postscale(request, op, self._size)

    def _allreduce(self, entries: list[Entry]) -> None:
        op, postscale = self._prepare_allreduce(entries)
        if len(entries) == 1 and self._carries(entries[0].output):
            self._allreduce_in_place(entries, op, postscale)
            return
        gpu = self._gpu_memory(entries)
        if gpu is not None:
            with torch.cuda.device(gpu.device):  # Triton launches on the thread's current GPU
                self._allreduce_fused(entries, op, postscale, gpu.device, peer_mapped=True)
            return
        devices = {e.tensor.device for e in entries} | {e.output.device for e in entries}
        self._allreduce_fused(entries, op, postscale,
                              devices.pop() if len(devices) == 1 else torch.device("cpu"),
                              peer_mapped=False)

    def _allreduce_fused(self, entries: list[Entry], op: ReduceOp, postscale: float,
                         device: torch.device, peer_mapped: bool) -> None:
        """Pack the entries where `device` is, allreduce the fusion buffer (`peer_mapped`: a
        GPU buffer the host group's GPU memory carries), unpack."""
        request = entries[0].request
        numel = sum(e.tensor.numel() for e in entries)
        labels = _TimelineLabels(entries, numel * request.dtype.itemsize)
        # Pack where the tensors live (on a GPU: one Triton launch for all of them), ...
        fused = self._fusion_buffer(request.dtype, numel, device)
        with labels.span("pack"):
            kernels.pack([_on(e.tensor, device) for e in entries], fused, request.prescale)
        # ... reduce: GPU buffers of one host through their peer-mapped memory, on the GPU;
        # otherwise from host memory (pinned, for fast copies from and to a GPU), ...
        carried = self._carries_cpu if device.type == "cpu" else self._carries_cuda
        wire = fused if carried or peer_mapped else self._staged_on_host(fused)
        self.plane.allreduce(wire, op, labels)
        if wire is not fused:
            fused.copy_(wire)
        # ... and unpack where the outputs live, applying the postscale on the way.
        with labels.span("unpack"):
            outputs = [e.output for e in entries]
            staged = [_on(o, device) for o in outputs]
            kernels.unpack(fused, staged, postscale)
            _copy_back(outputs, staged)

    def _gpu_memory(self, entries: list[Entry]):
        """The plane's peer-mapped GPU memory, where these entries' allreduce can run in it:
        every entry's tensor on a GPU (the ranks agreed on where each tensor lives, so every
        rank answers alike)."""
        if entries[0].request.device != "cuda":
            return None
        return self.plane.gpu_memory(entries[0].tensor.device)

    def _allreduce_in_place(self, entries: list[Entry], op: ReduceOp, postscale: float) -> None:
        """One tensor the plane carries as it is: reduce directly in its output, skipping the
        fusion buffer's copies."""
        entry = entries[0]
        if entry.output is not entry.tensor:
            entry.output.copy_(entry.tensor)
        buffer = entry.output.view(-1)
        _scale(buffer, entry.request.prescale)
        self.plane.allreduce(buffer, op, _TimelineLabels(entries, buffer.numel() * buffer.element_size()))
        _scale(buffer, postscale)

    def _reducescatter(self, entry: Entry) -> None:
        """Reduce the tensor over all ranks; this rank keeps its `splits[rank]` rows of dim 0.

        Submitted in place (the output is the input, a contiguous host tensor), the input is
        the working buffer: its rows for this rank become the result, the rest is clobbered.
        """
        request = entry.request
        op = _REDUCE_OPS[request.op]
        size, rank = self._size, self._rank
        row = math.prod(request.shape[1:])
        parts, start = [], 0
        for rows in request.splits:
            parts.append((start, start + rows * row))
            start += rows * row
        in_place = entry.output is entry.tensor
        if in_place and self._carries(entry.tensor):
            buffer = entry.tensor.view(-1)
        else:  # the input stays as it was
            buffer = self._fusion_buffer(request.dtype, math.prod(request.shape),
                                         self._working_device(entry.tensor))
            buffer.copy_(entry.tensor.reshape(-1))
        _scale(buffer, request.prescale)
        self.plane.reduce_scatter(buffer, parts, op,
                                  _TimelineLabels([entry], buffer.numel() * buffer.element_size()))
        own_start, own_end = parts[rank]
        mine = buffer[own_start:own_end]
        _scale(mine, _postscale(request, op, size))
        if in_place:
            target = entry.tensor.view(-1)[own_start:own_end]
            if target.data_ptr() != mine.data_ptr():  # a staged GPU tensor: its rows from the host
                target.copy_(mine)
            entry.output = target.view(request.splits[rank], *request.shape[1:])
            return
        mine = mine.view(request.splits[rank], *request.shape[1:])
        if entry.output is not None:
            entry.output.copy_(mine)
        else:  # its own memory: the fusion buffer is reused by the next collective
            entry.output = mine.to(entry.tensor.device, copy=True)

    def _staged_on_host(self, device_buffer: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of `device_buffer`, reusing one pinned buffer per dtype."""
        numel, dtype = device_buffer.numel(), device_buffer.dtype
        pinned = self._pinned.get(dtype)
        if pinned is None or pinned.numel() < numel:
            pinned = torch.empty(numel, dtype=dtype, pin_memory=True)
            self._pinned[dtype] = pinned
        host = pinned[:numel]
        host.copy_(device_buffer, non_blocking=True)
        torch.cuda.current_stream(device_buffer.device).synchronize()
        return host

    def _allgather(self, entry: Entry, first_dims: tuple[int, ...]) -> None:
        tensor = entry.tensor
        row = math.prod(tensor.shape[1:])
        bounds, start = [], 0
        for dim in first_dims:
            bounds.append((start, start + dim * row))
            start += dim * row
        output = entry.output  # given by the caller (a host tensor of the gathered shape), or new
        if output is None:
            output = torch.empty((sum(first_dims), *tensor.shape[1:]), dtype=tensor.dtype,
                                 device=self._working_device(tensor))
        flat = output.view(-1)
        own_start, own_end = bounds[self._rank]
        flat[own_start:own_end].copy_(tensor.reshape(-1))
        self.plane.allgather(flat, bounds, entry.request.name)
        entry.output = output.to(tensor.device)

    def _broadcast(self, entry: Entry) -> None:
        output = entry.output
        if entry.output is not entry.tensor and self._rank == entry.request.root:
            output.copy_(entry.tensor)
        staged = output if self._carries(output) else _host(output).contiguous()
        self.plane.broadcast(staged.view(-1), entry.request.root, entry.request.name)
        if staged is not output:
            output.copy_(staged)

    def close(self) -> None:
        self.plane.close()

    def _carries(self, tensor: torch.Tensor) -> bool:
        """Whether the plane moves `tensor` as it is: contiguous, on a device it carries."""
        on_carried = self._carries_cpu if tensor.is_cpu else tensor.is_cuda and self._carries_cuda
        return on_carried and tensor.is_contiguous()

    def _working_device(self, tensor: torch.Tensor) -> torch.device:
        """Where a working buffer for `tensor` lives: beside it where the plane carries its
        device, else in host memory (staged)."""
        on_carried = self._carries_cpu if tensor.is_cpu else tensor.is_cuda and self._carries_cuda
        return tensor.device if on_carried else torch.device("cpu")

    def _fusion_buffer(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self._fusion.get((dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._fusion[(dtype, device)] = buffer
        return buffer[:numel]


def _span(entries: list[Entry], nbytes: int, lane: str, **args):
    """`_TimelineLabels(entries, nbytes).span(lane, **args)`, with nothing built while the
    timeline is off (a small step pays for every object)."""
    if not recorder.enabled:
        return recorder.span(lane, "")
    return _TimelineLabels(entries, nbytes).span(lane, **args)


class _TimelineLabels:
    """How an allreduce's events are labelled; the tensor list is built only when recording."""

    def __init__(self, entries: list[Entry], nbytes: int):
        self.entries, self.nbytes = entries, nbytes
        self.name = entries[0].request.name if len(entries) == 1 else f"{len(entries)} tensors"

    def span(self, lane: str, **args):
        if not recorder.enabled:
            return recorder.span(lane, self.name)  # the shared no-op
        return recorder.span(lane, self.name, bytes=self.nbytes, tensors=self.tensor_names(), **args)

    def tensor_names(self) -> list[str]:
        """The first few names of a large fusion, so trace files stay small."""
        names = [e.request.name for e in self.entries[:TIMELINE_NAMES_LISTED]]
        if len(self.entries) > TIMELINE_NAMES_LISTED:
            names.append(f"... {len(self.entries) - TIMELINE_NAMES_LISTED} more")
        return names


def _postscale(request: Request, op: ReduceOp, size: int) -> float:
    """The factor a reduction's result is scaled by: Average is a Sum divided by the ranks."""
    return request.postscale / size if op is ReduceOp.AVERAGE else request.postscale


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        tensor.mul_(factor)
    else:  # integers: scale in float64 and round toward zero, as the kernels do
        tensor.copy_((tensor.to(torch.float64) * factor).trunc())


def _is_host_contiguous(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.is_contiguous()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """CPU tensors as they are; CUDA tensors staged through host memory for the TCP ring."""
    return _on(tensor, torch.device("cpu"))


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.detach().to(device)


def _copy_back(outputs: list[torch.Tensor], staged: list[torch.Tensor]) -> None:
    for output, host in zip(outputs, staged):
        if host is not output:
            output.copy_(host)
