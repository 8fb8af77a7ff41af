"""How a ring's bytes move: one `DataPlane` interface, one plane chosen when the ring forms.

    SharedMemoryPlane   every rank of the ring on this host (`shared_memory_plane.py`): the
                        rounds of `shared_memory.py`, through host memory for CPU tensors
                        and GPU memory mapped between the ranks (CUDA IPC, `peer_memory.py`)
                        for CUDA tensors
    HierarchicalPlane   several hosts with the same number of ranks each (`hierarchical.py`):
                        Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE (reduce-scatter within the
                        host through shared memory, the ring across hosts on each rank's part,
                        allgather within the host: 1/local_size of the bytes cross between
                        hosts); its other collectives use the whole ring
    RingPlane           the TCP ring (`ring_plane.py`): the algorithm of `ring.py` over the
                        sockets of `tcp.py`, ordered host by host, and recursive doubling
                        (`recursive_doubling.py`) over the ring's hypercube links
                        (`hypercube.py`) for allreduces below the switch point of
                        `cost_model.py`

A plane is given one flat buffer per collective: fusion, scaling, staging of GPU tensors and
the timeline's labels are `CollectiveRunner`'s, so a new plane touches none of them. The
plane's `name` is what `context.current().transport` reports and the op queue is chosen by.
What a plane moves bytes over (the sockets, the mapped segments) is connected by
`rendezvous.py` when the ring forms.

Where a GPU plane plugs in: `gpu_memory` is how a plane offers device memory that the ranks
reduce in directly. Within a host that is today part of the shared-memory plane: the same
rounds run in GPU buffers mapped between the ranks through CUDA IPC (`peer_memory.py`). A
plane that carries CUDA buffers across hosts (NCCL through `torch.distributed`, say) would
be a module of its own here: it implements the four collectives on device buffers, answers
`gpu_memory` for its device, and `choose_plane` picks it when every rank has a GPU;
everything above it (fusion, staging, negotiation, the op queues) stays as it is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..reduce_ops import ReduceOp
from .hierarchical import HierarchicalPlane
from .ring_plane import RingPlane
from .shared_memory import HostGroup
from .shared_memory_plane import SharedMemoryPlane
from .tcp import RingTransport

Bounds = list[tuple[int, int]]  # (start, end) of each rank's part of a flat buffer, rank order


class Labels(Protocol):
    """How a collective's timeline events are named (`collectives._TimelineLabels`)."""

    def span(self, lane: str, **args): ...


class DataPlane(Protocol):
    """Moves one flat buffer between the ranks of a ring, in place."""

    name: str  # "none" (a world of one), "tcp", "shm" or "shm+tcp"
    lockstep_group: HostGroup | None
    """The shared-memory group of every rank of the ring, where the plane is one: the op
    queue then negotiates in lockstep through its rounds, and a small allreduce's data rides
    on the round that agrees on it (`op_queue_shm.py`). None for a ring that leaves the host."""

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

    def abort(self, reason: str) -> None:
        """End every wait of this plane now, from any thread (a pool's cell was stopped):
        each raises, naming `reason`. The plane is unusable after; `close` follows."""

    def close(self) -> None: ...


def choose_plane(transport: RingTransport, host_group: HostGroup | None,
                 cross: RingTransport | None, algorithm: str = "auto") -> DataPlane:
    """The plane for what `init()` could connect: a host group holding every rank, a host
    group and a ring across hosts, or the ring alone. `algorithm`: how TCP rings allreduce
    (`DDL_MAGIC_ALLREDUCE_ALGORITHM`, `cost_model.py`)."""
    if host_group is not None and host_group.size == transport.world.size:
        return SharedMemoryPlane(host_group, transport)
    if host_group is not None and cross is not None:
        return HierarchicalPlane(host_group, cross, transport, algorithm)
    return RingPlane(transport, algorithm)
