"""Where each of many tensors lives, in a form one kernel launch can read.

The batched pack/unpack kernels run one program per block of ``block``
elements of one tensor. Each program needs its tensor's address and size, the
tensor's place in the buffer, and which of the tensor's blocks it is::

    sizes        5, 3, 9            (block = 4)
    buffer       a a a a a b b b c c c c c c c c c
    starts       0         5     8
    programs     a0 a1 b0 c0 c1 c2
    block_owner  0  0  1  2  2  2   (tensor of each program)
    first_block  0     2  3         (first program of each tensor)

A training step packs the same gradients at the same addresses every time, so
tables are cached by (device, addresses, sizes). A miss costs one blocking
host-to-device copy, which also means a table is complete before any stream
uses it; a hit costs nothing on the device. The cache holds addresses as
integers, never the tensors themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentTable:
    """Device-resident int64 tables describing tensors laid end to end in a buffer."""

    addresses: torch.Tensor
    starts: torch.Tensor
    sizes: torch.Tensor
    first_block: torch.Tensor
    block_owner: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.block_owner.numel()


def segment_table(tensors: Sequence[torch.Tensor], block: int) -> SegmentTable:
    """The (cached) table for ``tensors`` packed in order, ``block`` elements per program.

    >>> table = segment_table([torch.zeros(5), torch.zeros(3), torch.zeros(9)], block=4)
    >>> table.block_owner.tolist(), table.starts.tolist()
    ([0, 0, 1, 2, 2, 2], [0, 5, 8])
    """
    return _build(
        tensors[0].device,
        block,
        tuple(t.data_ptr() for t in tensors),
        tuple(t.numel() for t in tensors),
    )


@functools.lru_cache(maxsize=64)
def _build(device: torch.device, block: int, addresses: tuple, sizes: tuple) -> SegmentTable:
    sizes_host = torch.tensor(sizes, dtype=torch.int64)
    blocks = (sizes_host + block - 1) // block
    starts = sizes_host.cumsum(0) - sizes_host
    first_block = blocks.cumsum(0) - blocks
    block_owner = torch.repeat_interleave(torch.arange(len(sizes)), blocks)
    # One host-to-device copy for all five tables.
    addresses_host = torch.tensor(addresses, dtype=torch.int64)
    host = torch.cat([addresses_host, starts, sizes_host, first_block, block_owner])
    table = host.to(device)
    count = len(sizes)
    return SegmentTable(*table.split([count, count, count, count, block_owner.numel()]))
