"""Ring collectives: allreduce as scatter-reduce followed by allgather, reduce-scatter, and
broadcast.

This is the algorithm of Baidu's ring-allreduce (the code Horovod grew from), on N ranks
arranged in a ring, each sending only to its right neighbour and receiving only from its
left one (rank r below is the r-th rank around the ring, `transport.position`: the transport
orders a ring host by host)::

        rank 0 ──► rank 1 ──► rank 2
          ▲                      │
          └──────── rank 3 ◄─────┘

The buffer is cut into N chunks, chunk c covering ``bounds[c]``.

Scatter-reduce, N-1 steps. At step i, rank r sends chunk (r - i) and receives chunk
(r - i - 1), which it reduces into its own copy of that chunk. Each chunk travels once
around the ring collecting every rank's contribution, so after N-1 steps rank r holds the
complete reduction of chunk (r + 1)::

        step 0: rank r sends chunk r,     receives chunk r-1 and reduces it
        step 1: rank r sends chunk r-1,   receives chunk r-2 and reduces it
        ...
        after:  rank r owns the fully reduced chunk r+1

Allgather, N-1 steps. Rank r starts by owning chunk (r + 1); at step i it sends the chunk
it completed last, (r + 1 - i), and receives chunk (r - i), copying it into place. After
N-1 steps every rank has every reduced chunk.

Every rank sends K(N-1)/N bytes in each phase, 2K(N-1)/N in all, whatever N is: this is
what makes the ring bandwidth-optimal (a parameter server receives K(N-1) bytes).

A reduce-scatter is the first phase alone, with the chunks numbered so that rank r finishes
with chunk r, its own part of the result: half the bytes of an allreduce. A sharded
optimizer reduce-scatters the gradients and allgathers the updated parameters: the same
bytes as one allreduce, split around its step.

What the loops below add to the lecture:
- the send of a step runs on the transport's sender thread while this thread receives,
  so both directions of every link are busy at once (full duplex);
- a received chunk is read and reduced in segments of `SEGMENT_BYTES`, so reducing one
  segment overlaps the kernel receiving the next one;
- a `RingObserver` may watch each phase and step (the timeline's does); the default one
  watches nothing and costs nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager

import torch

from .tcp import RingTransport

# Reducing in 1 MiB segments lets the arithmetic overlap the wire; smaller segments cost more
# in per-call overhead than they win in overlap (measured in benchmarks/allreduce.py).
SEGMENT_BYTES = 1 << 20

Reduce = Callable[[torch.Tensor, torch.Tensor], None]  # reduce(dst, src): dst op= src


class RingObserver:
    """Watches the ring at work (the timeline does, when it is on). This base watches nothing."""

    def phase(self, name: str) -> ContextManager:
        """Wraps one phase: "scatter_reduce" or "allgather"."""
        return contextlib.nullcontext()

    def step(self, phase: str, step: int, sent: torch.Tensor, sent_chunk: int,
             received: torch.Tensor, received_chunk: int, started_ns: int) -> None:
        """One step of a phase finished: which chunks went right and came from the left."""


UNOBSERVED = RingObserver()


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Cut `numel` elements into `parts` contiguous chunks whose sizes differ by at most one.

    >>> chunk_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_allreduce(buffer: torch.Tensor, transport: RingTransport, reduce: Reduce,
                   scratch: torch.Tensor, observer: RingObserver = UNOBSERVED) -> None:
    """Reduce the 1-D `buffer` across all ranks, in place; `scratch` holds one received segment."""
    size = transport.size
    if size == 1 or buffer.numel() == 0:
        return
    bounds = chunk_bounds(buffer.numel(), size)
    owned = transport.position + 1
    with observer.phase("scatter_reduce"):
        scatter_reduce(buffer, bounds, transport, reduce, scratch, owned, observer)
    with observer.phase("allgather"):
        ring_allgather(buffer, bounds, transport, owned, observer)


def ring_reduce_scatter(buffer: torch.Tensor, parts: list[tuple[int, int]],
                        transport: RingTransport, reduce: Reduce, scratch: torch.Tensor,
                        observer: RingObserver = UNOBSERVED) -> None:
    """Reduce the 1-D `buffer` across all ranks so that each rank r ends with the complete
    reduction of its own part, `buffer[parts[r][0]:parts[r][1]]` (parts in rank order, any
    sizes); the rest of its buffer is left partly reduced."""
    if transport.size == 1 or buffer.numel() == 0:
        return
    in_ring_order = [parts[member] for member in transport.members]
    with observer.phase("scatter_reduce"):
        scatter_reduce(buffer, in_ring_order, transport, reduce, scratch, transport.position,
                       observer)


def scatter_reduce(buffer: torch.Tensor, bounds: list[tuple[int, int]], transport: RingTransport,
                   reduce: Reduce, scratch: torch.Tensor, owned: int,
                   observer: RingObserver = UNOBSERVED) -> None:
    """After this, rank r holds the reduction over all ranks of chunk (`owned`) of `buffer`.

    The lecture's schedule is `owned` = r + 1: at step i rank r sends chunk (owned - 1 - i)
    and receives chunk (owned - 2 - i), so the chunk it receives last, at step N-2, is
    chunk (owned - N) = owned, and every other rank's contribution to it has arrived.
    """
    size = transport.size
    segment = max(1, SEGMENT_BYTES // buffer.element_size())
    for step in range(size - 1):
        started_ns = time.monotonic_ns()
        send_chunk = (owned - 1 - step) % size
        recv_chunk = (owned - 2 - step) % size
        sent = _chunk(buffer, bounds, send_chunk)
        sending = transport.send_to_right(_bytes(sent))
        received = _chunk(buffer, bounds, recv_chunk)
        for start in range(0, received.numel(), segment):
            mine = received[start:start + segment]
            theirs = scratch[:mine.numel()]
            transport.recv_from_left(_bytes(theirs))
            reduce(mine, theirs)
        sending.wait()
        observer.step("scatter_reduce", step, sent, send_chunk, received, recv_chunk, started_ns)


def ring_allgather(buffer: torch.Tensor, bounds: list[tuple[int, int]], transport: RingTransport,
                   owned: int, observer: RingObserver = UNOBSERVED) -> None:
    """Circulate the chunks so every rank ends with all of them.

    On entry each rank r holds only chunk (`owned`) — (r + 1) after a scatter-reduce, r for a
    plain allgather of per-rank blocks. At step i it sends chunk (owned - i), which it
    completed at the previous step, and receives chunk (owned - i - 1).
    """
    size = transport.size
    for step in range(size - 1):
        started_ns = time.monotonic_ns()
        send_chunk = (owned - step) % size
        recv_chunk = (owned - step - 1) % size
        sent, received = _chunk(buffer, bounds, send_chunk), _chunk(buffer, bounds, recv_chunk)
        sending = transport.send_to_right(_bytes(sent))
        transport.recv_from_left(_bytes(received))
        sending.wait()
        observer.step("allgather", step, sent, send_chunk, received, recv_chunk, started_ns)


def ring_broadcast(buffer: torch.Tensor, transport: RingTransport, root: int) -> None:
    """Copy the 1-D `buffer` of the rank at position `root` to every rank, pipelined segment
    by segment along the ring.

    Each rank forwards a segment to its right neighbour as soon as it has received it, so
    the time is one pass of the data plus (N - 1) segments, not (N - 1) passes.
    """
    rank, size = transport.position, transport.size
    if size == 1 or buffer.numel() == 0:
        return
    forwards = (rank + 1) % size != root
    segment = max(1, SEGMENT_BYTES // buffer.element_size())
    sends = []
    for start in range(0, buffer.numel(), segment):
        piece = _bytes(buffer[start:start + segment])
        if rank != root:
            transport.recv_from_left(piece)
        if forwards:
            sends.append(transport.send_to_right(piece))
    for sending in sends:
        sending.wait()


def _chunk(buffer: torch.Tensor, bounds: list[tuple[int, int]], index: int) -> torch.Tensor:
    start, end = bounds[index]
    return buffer[start:end]


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, for the socket calls (works for bfloat16 too)."""
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
