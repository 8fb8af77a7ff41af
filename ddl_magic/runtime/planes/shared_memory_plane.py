"""The shared-memory plane: every rank of the ring on this host, each collective one
`HostGroup` call (`shared_memory.py`), through host memory or GPU memory mapped between the
ranks (`peer_memory.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..reduce_ops import ReduceOp
from ..timeline import recorder
from .shared_memory import HostGroup
from .tcp import RingTransport

if TYPE_CHECKING:
    from . import Bounds, Labels


class SharedMemoryPlane:
    """Every rank of the ring on this host: each rank reduces from the others' segments."""

    name = "shm"
    device_types = frozenset({"cpu"})  # CUDA buffers: staged, or `gpu_memory` within a host

    def __init__(self, host_group: HostGroup, transport: RingTransport):
        self.host_group = host_group
        self.lockstep_group = host_group  # every rank of the ring is in it
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

    def abort(self, reason: str) -> None:
        self.host_group.abort(reason)
        self._transport.abort()

    def close(self) -> None:
        self._transport.close()
        self.host_group.close()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
