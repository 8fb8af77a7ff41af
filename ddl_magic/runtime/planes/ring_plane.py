"""The TCP ring as a data plane: `ring.py`'s algorithms over `tcp.py`'s sockets, each phase
and step observed for the timeline (`RingObserver`), so the algorithm itself never sees it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ... import kernels
from ..reduce_ops import ReduceOp
from ..timeline import recorder
from .ring import (SEGMENT_BYTES, UNOBSERVED, RingObserver, ring_allgather, ring_allreduce,
                   ring_broadcast, ring_reduce_scatter)
from .tcp import RingTransport

if TYPE_CHECKING:
    from . import Bounds, Labels


class RingPlane:
    """The TCP ring: `ring.py`'s algorithms, each step observed for the timeline."""

    lockstep_group = None  # the ring leaves the host (or is a world of one)
    device_types = frozenset({"cpu"})  # CUDA buffers are staged through host memory

    def __init__(self, transport: RingTransport):
        self.transport = transport
        self.name = "none" if transport.world.size == 1 else "tcp"
        self._scratch = _Scratch()

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        ring_allreduce(buffer, self.transport, kernels.reducer(op.kernel_name, buffer),
                       self._scratch.of(buffer.dtype), ring_observer(labels, self.transport))

    def reduce_scatter(self, buffer: torch.Tensor, parts: Bounds, op: ReduceOp,
                       labels: Labels) -> None:
        ring_reduce_scatter(buffer, parts, self.transport, kernels.reducer(op.kernel_name, buffer),
                            self._scratch.of(buffer.dtype), ring_observer(labels, self.transport))

    def allgather(self, buffer: torch.Tensor, parts: Bounds, name: str) -> None:
        in_ring_order = [parts[member] for member in self.transport.members]
        with recorder.span("allgather", name, bytes=_nbytes(buffer), size=self.transport.world.size):
            ring_allgather(buffer, in_ring_order, self.transport, self.transport.position)

    def broadcast(self, buffer: torch.Tensor, root: int, name: str) -> None:
        with recorder.span("broadcast", name, bytes=_nbytes(buffer)):
            ring_broadcast(buffer, self.transport, self.transport.members.index(root))

    def gpu_memory(self, device: torch.device) -> None:
        return None

    def abort(self, reason: str) -> None:
        self.transport.abort()

    def close(self) -> None:
        self.transport.close()


class _Scratch:
    """One ring segment's scratch buffer per dtype, reused between calls."""

    def __init__(self):
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def of(self, dtype: torch.dtype) -> torch.Tensor:
        scratch = self._by_dtype.get(dtype)
        if scratch is None:
            scratch = torch.empty(max(1, SEGMENT_BYTES // dtype.itemsize), dtype=dtype)
            self._by_dtype[dtype] = scratch
        return scratch


def ring_observer(labels: Labels, transport: RingTransport) -> RingObserver:
    """What watches a ring collective over `transport`: nothing unless the timeline records."""
    return _TimelineObserver(labels, transport) if recorder.enabled else UNOBSERVED


class _TimelineObserver(RingObserver):
    """Records each ring phase, and each step's chunks, as timeline events."""

    def __init__(self, labels: Labels, transport: RingTransport):
        self.labels = labels
        self.world = transport.world
        # named by rank in the run, as the trace's pid is (they differ in a process set's ring)
        self.right = transport.world.run_ranks[transport.right_rank]
        self.left = transport.world.run_ranks[transport.left_rank]

    def phase(self, name: str):
        return self.labels.span(name, size=self.world.size)

    def step(self, phase, step, sent, sent_chunk, received, received_chunk, started_ns) -> None:
        recorder.record("ring_step", f"{phase} step {step}", started_ns, time.monotonic_ns(),
                        {"phase": phase, "step": step, "sent_chunk": sent_chunk,
                         "sent_bytes": _nbytes(sent), "to": self.right,
                         "received_chunk": received_chunk, "bytes": _nbytes(received),
                         "from": self.left})


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
