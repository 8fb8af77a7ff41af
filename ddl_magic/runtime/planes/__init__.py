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
                        sockets of `tcp.py`, ordered host by host
    TorchDistributedPlane  a torch.distributed group (`torch_distributed.py`): NCCL for CUDA
                        buffers beside one of the planes above (`SplitByDevicePlane`), or
                        gloo for every buffer, the CPU stand-in that tests the NCCL path

A plane is given one flat buffer per collective: fusion, scaling, staging of GPU tensors and
the timeline's labels are `CollectiveRunner`'s, so a new plane touches none of them. The
plane's `name` is what `context.current().transport` reports and the op queue is chosen by.
What a plane moves bytes over (the sockets, the mapped segments) is connected by
`rendezvous.py` when the ring forms.

Where GPU buffers go. Within a host, `gpu_memory` is how the shared-memory plane offers
device memory that the ranks reduce in directly: the same rounds run in GPU buffers mapped
between the ranks through CUDA IPC (`peer_memory.py`). Where that cannot carry them (the
ring leaves the host), `choose_plane` puts a torch.distributed plane on NCCL beside the host
plane, and `device_types` tells `CollectiveRunner` that CUDA buffers then need no staging
through host memory. A plane for another kind of device plugs in the same way: a group
formed in `rendezvous.connect_device_group`, a plane that names its device type.
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
from .torch_distributed import DeviceGroup, SplitByDevicePlane, TorchDistributedPlane

Bounds = list[tuple[int, int]]  # (start, end) of each rank's part of a flat buffer, rank order


class Labels(Protocol):
    """How a collective's timeline events are named (`collectives._TimelineLabels`)."""

    def span(self, lane: str, **args): ...


class DataPlane(Protocol):
    """Moves one flat buffer between the ranks of a ring, in place."""

    name: str  # "none" (a world of one), "tcp", "shm", "shm+tcp", "gloo", or one of those + "+nccl"
    device_types: frozenset[str]
    """The device types whose buffers the plane moves itself; a buffer elsewhere is staged
    through host memory (or, within a host, the peer-mapped `gpu_memory`)."""
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
                 cross: RingTransport | None, device_group: DeviceGroup | None = None) -> DataPlane:
    """The plane for what `init()` could connect: a host group holding every rank, a host
    group and a ring across hosts, or the ring alone; with a torch.distributed group, that
    group for every buffer (gloo) or for the CUDA ones (NCCL)."""
    if device_group is not None and device_group.backend == "gloo":
        return TorchDistributedPlane(device_group, transport.op_timeout, transport)
    host = _host_plane(transport, host_group, cross)
    if device_group is None:
        return host
    return SplitByDevicePlane(host, TorchDistributedPlane(device_group, transport.op_timeout))


def _host_plane(transport: RingTransport, host_group: HostGroup | None,
                cross: RingTransport | None) -> DataPlane:
    if host_group is not None and host_group.size == transport.world.size:
        return SharedMemoryPlane(host_group, transport)
    if host_group is not None and cross is not None:
        return HierarchicalPlane(host_group, cross, transport)
    return RingPlane(transport)
