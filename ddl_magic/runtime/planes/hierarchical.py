"""Hierarchical allreduce (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE), for several hosts with
the same number of ranks each: reduce-scatter within the host through shared memory, the
ring across hosts on each rank's part (the *cross ring*: the ranks with this rank's
local_rank, one per host), allgather within the host. Only 1/local_size of the bytes cross
between hosts; a part small enough crosses by recursive doubling instead of the ring, as
`RingPlane` chooses for any ring. Its other collectives use the whole TCP ring, as
`RingPlane` runs them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ... import kernels
from ..reduce_ops import ReduceOp
from .cost_model import allreduce_switch_bytes
from .ring_plane import RingPlane, allreduce_over
from .shared_memory import HostGroup
from .tcp import RingTransport

if TYPE_CHECKING:
    from . import Labels


class HierarchicalPlane(RingPlane):
    """Shared memory within each host, the ring across hosts: for allreduce, whose bytes
    cross between hosts only once per host; the other collectives use the whole ring."""

    def __init__(self, host_group: HostGroup, cross: RingTransport, transport: RingTransport,
                 algorithm: str = "auto"):
        super().__init__(transport, algorithm)
        self.name = "shm+tcp"
        self.host_group = host_group
        self.cross = cross
        self.cross_switch_bytes = allreduce_switch_bytes(algorithm, cross.size, cross.size)

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        reduce = kernels.reducer(op.kernel_name, buffer)

        def across_hosts(part: torch.Tensor) -> None:
            allreduce_over(self.cross, part, reduce, self._scratch, labels,
                           self.cross_switch_bytes)

        with labels.span("shared_memory", op="hierarchical allreduce",
                         size=self.transport.world.size):
            self.host_group.allreduce(buffer, op.kernel_name, across_hosts)

    def abort(self, reason: str) -> None:
        super().abort(reason)
        self.cross.abort()
        self.host_group.abort(reason)

    def close(self) -> None:
        super().close()
        self.cross.close()
        self.host_group.close()
