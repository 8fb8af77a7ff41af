"""How a ring's bytes move: one `DataPlane` interface, one plane chosen when the ring forms.

    SharedMemoryPlane   every rank of the ring on this host: shared memory (`shared_memory.py`),
                        host memory for CPU tensors, GPU memory mapped between the ranks
                        (CUDA IPC, `peer_memory.py`) for CUDA tensors
    HierarchicalPlane   several hosts with the same number of ranks each: Horovod's
                        HOROVOD_HIERARCHICAL_ALLREDUCE (reduce-scatter within the host through
                        shared memory, the ring across hosts on each rank's part, allgather
                        within the host: 1/local_size of the bytes cross between hosts); its
                        other collectives use the whole ring
    RingPlane           the TCP ring (`ring.py`), ordered host by host

A plane is given one flat buffer per collective: fusion, scaling, staging of GPU tensors and
the timeline's labels are `CollectiveRunner`'s, so a new plane touches none of them. The
plane's `name` is what `context.current().transport` reports and the op queue is chosen by.

Where a GPU plane plugs in: `gpu_memory` is how a plane offers device memory that the ranks
reduce in directly (today the shared-memory plane's CUDA IPC mapping); a plane that carries
CUDA buffers across hosts (NCCL through `torch.distributed`, say) would implement the four
collectives on device buffers, answer `gpu_memory` for its device, and be chosen by
`choose_plane` when every rank has a GPU; everything above it stays as it is.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from ... import kernels
from ..reduce_ops import ReduceOp
from .ring import (SEGMENT_BYTES, UNOBSERVED, RingObserver, ring_allgather, ring_allreduce,
                   ring_broadcast, ring_reduce_scatter)
from .shared_memory import HostGroup
from ..timeline import recorder
from .tcp import RingTransport

Bounds = list[tuple[int, int]]  # (start, end) of each rank's part of a flat buffer, rank order


class Labels(Protocol):
    """How a collective's timeline events are named (`collectives._TimelineLabels`)."""

    def span(self, lane: str, **args): ...


class DataPlane(Protocol):
    """Moves one flat buffer between the ranks of a ring, in place."""

    name: str  # "none" (a world of one), "tcp", "shm" or "shm+tcp"

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        """Every rank's `buffer` becomes the reduction of all of them."""

    def reduce_scatter(self, buffer: torch.Tensor, parts: Bounds, op: ReduceOp,
                       labels: Labels) -> None:
        """Each rank's own part of `buffer` becomes the reduction of that part everywhere."""

    def allgather(self, buffer: torch.Tensor, parts: Bounds, name: str) -> None:
        """Each rank holds its own part of `buffer`; every rank gets every part."""

    def broadcast(self, buffer: torch.Tensor, root: int, name: str) -> None:
        """Every rank's `buffer` becomes `root`'s."""

    def gpu_memory(self, device: torch.device):
        """GPU memory the ranks map between them on `device`, where the plane has it."""

    def close(self) -> None: ...


def choose_plane(transport: RingTransport, host_group: HostGroup | None,
                 cross: RingTransport | None) -> DataPlane:
    """The plane for what `init()` could connect: a host group holding every rank, a host
    group and a ring across hosts, or the ring alone."""
    if host_group is not None and host_group.size == transport.world.size:
        return SharedMemoryPlane(host_group, transport)
    if host_group is not None and cross is not None:
        return HierarchicalPlane(host_group, cross, transport)
    return RingPlane(transport)


class RingPlane:
    """The TCP ring: `ring.py`'s algorithms, each step observed for the timeline."""

    def __init__(self, transport: RingTransport):
        self.transport = transport
        self.name = "none" if transport.world.size == 1 else "tcp"
        self._scratch = _Scratch()

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        ring_allreduce(buffer, self.transport, kernels.reducer(op.kernel_name, buffer),
                       self._scratch.of(buffer.dtype), _observer(labels, self.transport))

    def reduce_scatter(self, buffer: torch.Tensor, parts: Bounds, op: ReduceOp,
                       labels: Labels) -> None:
        ring_reduce_scatter(buffer, parts, self.transport, kernels.reducer(op.kernel_name, buffer),
                            self._scratch.of(buffer.dtype), _observer(labels, self.transport))

    def allgather(self, buffer: torch.Tensor, parts: Bounds, name: str) -> None:
        in_ring_order = [parts[member] for member in self.transport.members]
        with recorder.span("allgather", name, bytes=_nbytes(buffer), size=self.transport.world.size):
            ring_allgather(buffer, in_ring_order, self.transport, self.transport.position)

    def broadcast(self, buffer: torch.Tensor, root: int, name: str) -> None:
        with recorder.span("broadcast", name, bytes=_nbytes(buffer)):
            ring_broadcast(buffer, self.transport, self.transport.members.index(root))

    def gpu_memory(self, device: torch.device) -> None:
        return None

    def close(self) -> None:
        self.transport.close()


class SharedMemoryPlane:
    """Every rank of the ring on this host: each rank reduces from the others' segments."""

    name = "shm"

    def __init__(self, host_group: HostGroup, transport: RingTransport):
        self.host_group = host_group
        self._transport = transport  # connected all the same: closed with the plane
        self._size = transport.world.size

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        with labels.span("shared_memory", op="allreduce", size=self._size):
            self.host_group.allreduce(buffer, op.kernel_name)

    def reduce_scatter(self, buffer: torch.Tensor, parts: Bounds, op: ReduceOp,
                       labels: Labels) -> None:
        with labels.span("shared_memory", op="reducescatter", size=self._size):
            self.host_group.reduce_scatter(
                buffer, [parts[member] for member in self.host_group.ranks], op.kernel_name)

    def allgather(self, buffer: torch.Tensor, parts: Bounds, name: str) -> None:
        with recorder.span("shared_memory", name, op="allgather", bytes=_nbytes(buffer),
                           size=self._size):
            self.host_group.allgather([buffer[start:end] for start, end in parts])

    def broadcast(self, buffer: torch.Tensor, root: int, name: str) -> None:
        with recorder.span("shared_memory", name, op="broadcast", bytes=_nbytes(buffer)):
            self.host_group.broadcast(buffer, root)

    def gpu_memory(self, device: torch.device):
        return self.host_group.gpu_memory(device)

    def close(self) -> None:
        self._transport.close()
        self.host_group.close()


class HierarchicalPlane(RingPlane):
    """Shared memory within each host, the ring across hosts: for allreduce, whose bytes
    cross between hosts only once per host; the other collectives use the whole ring."""

    def __init__(self, host_group: HostGroup, cross: RingTransport, transport: RingTransport):
        super().__init__(transport)
        self.name = "shm+tcp"
        self.host_group = host_group
        self.cross = cross

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        observer = _observer(labels, self.cross)
        scratch, reduce = self._scratch.of(buffer.dtype), kernels.reducer(op.kernel_name, buffer)

        def across_hosts(part: torch.Tensor) -> None:
            ring_allreduce(part, self.cross, reduce, scratch, observer)

        with labels.span("shared_memory", op="hierarchical allreduce",
                         size=self.transport.world.size):
            self.host_group.allreduce(buffer, op.kernel_name, across_hosts)

    def close(self) -> None:
        super().close()
        self.cross.close()
        self.host_group.close()


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


def _observer(labels: Labels, transport: RingTransport) -> RingObserver:
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
