"""Running one negotiated response on this rank: fusion buffer in, ring, fusion buffer out.

The op queue hands each `Response` here together with this rank's entries for its names.
Everything around the ring lives here — packing many tensors into one fusion buffer, the
prescale and postscale factors, staging CUDA tensors through host memory — so `ring.py`
stays the plain algorithm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import kernels
from .negotiation import Request, Response
from .reduce_ops import ReduceOp
from .ring import SEGMENT_BYTES, ring_allgather, ring_allreduce, ring_broadcast
from .timeline import recorder
from .transport import RingTransport


@dataclass
class Entry:
    """This rank's side of one submitted collective: its request, tensors and handle."""

    request: Request
    tensor: torch.Tensor | None
    output: torch.Tensor | None
    handle: "object"
    submitted_ns: int = field(default_factory=time.monotonic_ns)


class CollectiveRunner:
    """Executes responses over the ring, reusing its fusion and scratch buffers between calls."""

    def __init__(self, transport: RingTransport):
        self.transport = transport
        self._fusion: dict[torch.dtype, torch.Tensor] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def run(self, response: Response, entries: list[Entry]) -> None:
        """Run `response` and write results into the entries' outputs."""
        if response.kind == "allreduce":
            self._allreduce(entries)
        elif response.kind == "allgather":
            self._allgather(entries[0], response.first_dims)
        elif response.kind == "broadcast":
            self._broadcast(entries[0])
        # "barrier": agreeing that every rank got here is the whole operation.

    def _allreduce(self, entries: list[Entry]) -> None:
        request = entries[0].request
        op = ReduceOp(request.op)
        postscale = request.postscale / self.transport.world.size if op is ReduceOp.AVERAGE \
            else request.postscale
        single = len(entries) == 1 and _is_host_contiguous(entries[0].output)
        if single:
            # One tensor: reduce directly in its output, skipping the fusion buffer's two copies.
            entry = entries[0]
            if entry.output is not entry.tensor:
                entry.output.copy_(entry.tensor)
            buffer = entry.output.view(-1)
            _scale(buffer, request.prescale)
        else:
            buffer = self._fusion_buffer(request.dtype, sum(e.tensor.numel() for e in entries))
            with recorder.span("pack", _names(entries), bytes=buffer.numel() * buffer.element_size()):
                kernels.pack([_host(e.tensor) for e in entries], buffer, request.prescale)
        reduce = _reducer(op)
        nbytes = buffer.numel() * buffer.element_size()
        names, size = _names(entries), self.transport.world.size

        def phase(lane: str):
            return recorder.span(lane, names, bytes=nbytes, tensors=len(entries), size=size)

        ring_allreduce(buffer, self.transport, reduce, self._scratch_for(request.dtype), phase)
        if single:
            _scale(buffer, postscale)
        else:
            with recorder.span("unpack", _names(entries), bytes=nbytes):
                outputs = [e.output for e in entries]
                staged = [_host(o) for o in outputs]
                kernels.unpack(buffer, staged, postscale)
                _copy_back(outputs, staged)

    def _allgather(self, entry: Entry, first_dims: tuple[int, ...]) -> None:
        tensor = entry.tensor
        row = _row_numel(tensor.shape[1:])
        bounds, start = [], 0
        for dim in first_dims:
            bounds.append((start, start + dim * row))
            start += dim * row
        rank = self.transport.world.rank
        output = torch.empty((sum(first_dims), *tensor.shape[1:]), dtype=tensor.dtype)
        flat = output.view(-1)
        own_start, own_end = bounds[rank]
        flat[own_start:own_end].copy_(_host(tensor).reshape(-1))
        with recorder.span("allgather", entry.request.name, bytes=flat.numel() * flat.element_size(),
                           size=self.transport.world.size):
            ring_allgather(flat, bounds, self.transport, owned=rank)
        entry.output = output.to(tensor.device) if tensor.device.type != "cpu" else output

    def _broadcast(self, entry: Entry) -> None:
        output = entry.output
        if entry.output is not entry.tensor and self.transport.world.rank == entry.request.root:
            output.copy_(entry.tensor)
        staged = output if _is_host_contiguous(output) else _host(output).contiguous()
        with recorder.span("broadcast", entry.request.name,
                           bytes=staged.numel() * staged.element_size()):
            ring_broadcast(staged.view(-1), self.transport, entry.request.root)
        if staged is not output:
            output.copy_(staged)

    def _fusion_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = self._fusion.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype)
            self._fusion[dtype] = buffer
        return buffer[:numel]

    def _scratch_for(self, dtype: torch.dtype) -> torch.Tensor:
        scratch = self._scratch.get(dtype)
        if scratch is None:
            scratch = torch.empty(max(1, SEGMENT_BYTES // dtype.itemsize), dtype=dtype)
            self._scratch[dtype] = scratch
        return scratch


def _reducer(op: ReduceOp):
    name = op.kernel_name

    def reduce(dst: torch.Tensor, src: torch.Tensor) -> None:
        kernels.reduce_(dst, src, name)

    return reduce


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        tensor.mul_(factor)
    else:  # integers: scale in float64 and round toward zero, as the kernels do
        tensor.copy_((tensor.to(torch.float64) * factor).trunc())


def _is_host_contiguous(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """CPU tensors as they are; CUDA tensors staged through host memory for the TCP ring."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")


def _copy_back(outputs: list[torch.Tensor], staged: list[torch.Tensor]) -> None:
    for output, host in zip(outputs, staged):
        if host is not output:
            output.copy_(host)


def _row_numel(shape) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def _names(entries: list[Entry]) -> str:
    return entries[0].request.name if len(entries) == 1 else f"{len(entries)} tensors"

