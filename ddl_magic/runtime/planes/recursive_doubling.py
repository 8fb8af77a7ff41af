"""Recursive doubling: an allreduce in log2 N rounds, for small buffers.

The ring (`ring.py`) sends every byte the fewest times, but it takes 2(N-1) steps, and each
step waits at least one network latency. For 4 KiB on 1024 ranks that is 2046 latencies of
~20 µs, 40 ms of waiting for 4 KiB of data. Recursive doubling takes log2 N rounds: at round
k every rank swaps its whole buffer with the rank whose position differs from its own in bit
k (its partner at distance 2^k on the hypercube, `hypercube.py`) and reduces what it
receives into its own::

        round 0, distance 1     round 1, distance 2     round 2, distance 4
        0 ⇄ 1     2 ⇄ 3         0 ⇄ 2     1 ⇄ 3         0 ⇄ 4     1 ⇄ 5
        4 ⇄ 5     6 ⇄ 7         4 ⇄ 6     5 ⇄ 7         2 ⇄ 6     3 ⇄ 7

        after round k, rank p holds the reduction over the 2^(k+1) positions that share
        p's bits above k: its pair, then its four, then all eight

Every rank ends with the same bits: in each round the two partners reduce the same two
values, a op b on one and b op a on the other, which IEEE arithmetic makes equal.

N not a power of two. Let P be the largest power of two not above N. The N - P positions
from P up first hand their buffer to the position P below them, sit out the rounds among
positions 0..P-1, and get the result back at the end: two rounds more, log2 P + 2 in all::

        N = 6, P = 4:   4 ──► 0    5 ──► 1        fold in: 0 and 1 reduce 4's and 5's
                        rounds 0 and 1 over 0..3  as above
                        0 ──► 4    1 ──► 5        fold out: the result

The fold in is an exchange whose lower side sends an empty message: every rank's first
step then sends something, so a rank that begins a negotiation cycle while its partners
sleep wakes them (`lockstep.py`), whichever position it holds.

Cost: every round moves the whole buffer, K log2 N bytes per rank against the ring's
2K(N-1)/N; for large buffers the ring wins. `cost_model.py` says where one gives way to
the other.

The algorithm is a schedule (`hypercube.py`): it yields each exchange and is sent back what
arrived, so the same lines run over sockets (`HypercubeLinks.run`) and in the scale
simulation. What it reduces is a `Reducible`: a tensor's bytes here, the negotiation's
control vector in `response_cache.py`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .hypercube import Exchange, HypercubeLinks, Receive, Schedule, Send

Reduce = Callable[[torch.Tensor, torch.Tensor], None]  # reduce(dst, src): dst op= src
_NOTHING = memoryview(bytearray())  # where the fold in's empty message lands


class Reducible(Protocol):
    """What recursive doubling reduces: this rank's value, sent whole each round."""

    def payload(self) -> bytes | memoryview:
        """This rank's value as it stands, to send."""

    def landing(self) -> memoryview | None:
        """Where a partner's value is received (None: as bytes, handed to `absorb`)."""

    def absorb(self, received: bytes | None) -> None:
        """Reduce a partner's value (in `landing`, or `received`) into this rank's."""

    def result_landing(self) -> memoryview | None:
        """Where the finished result is received, by a position that folded (None: as
        bytes, handed to `replace`)."""

    def replace(self, received: bytes | None) -> None:
        """Take the finished result, received from the position this one folded into."""


def recursive_doubling(position: int, size: int, value: Reducible) -> Schedule:
    """Reduce `value` across the `size` positions of a ring, in place, as drawn above."""
    largest = 1 << (size.bit_length() - 1)  # P: the largest power of two not above N
    if position >= largest:  # fold in, sit out the rounds, take the result back
        yield Exchange(position - largest, value.payload(), _NOTHING)
        value.replace((yield Receive(position - largest, value.result_landing())))
        return
    folded = position + largest
    if folded < size:
        value.absorb((yield Exchange(folded, b"", value.landing())))
    distance = 1
    while distance < largest:
        value.absorb((yield Exchange(position ^ distance, value.payload(), value.landing())))
        distance <<= 1
    if folded < size:
        yield Send(folded, value.payload())


def rounds(size: int) -> int:
    """Steps of `recursive_doubling` over `size` positions, each moving the whole buffer:
    log2 P, and two more (fold in, fold out) when `size` is not a power of two. The rounds
    on the critical path are at most this (a core position with nothing folded into it
    starts its first round while the others fold in).

    >>> [rounds(n) for n in (1, 2, 3, 4, 6, 8, 1024)]
    [0, 1, 3, 2, 4, 3, 10]
    """
    largest = 1 << (size.bit_length() - 1)
    return largest.bit_length() - 1 + (2 if size > largest else 0)


class TensorReducible:
    """A flat tensor as recursive doubling's value: sent from its own memory, a partner's
    received into `scratch` and reduced into it with `reduce`."""

    def __init__(self, buffer: torch.Tensor, scratch: torch.Tensor, reduce: Reduce):
        self.buffer, self.scratch, self.reduce = buffer, scratch[:buffer.numel()], reduce
        self._bytes = _bytes(buffer)

    def payload(self) -> memoryview:
        return self._bytes

    def landing(self) -> memoryview:
        return _bytes(self.scratch)

    def absorb(self, received: None) -> None:
        self.reduce(self.buffer, self.scratch)

    def result_landing(self) -> memoryview:
        return self._bytes  # the result lands in the buffer itself

    def replace(self, received: None) -> None:
        pass


def recursive_doubling_allreduce(buffer: torch.Tensor, links: HypercubeLinks, reduce: Reduce,
                                 scratch: torch.Tensor) -> None:
    """Reduce the 1-D `buffer` across the ring of `links`, in place; `scratch` holds at least
    as many elements as `buffer`."""
    if links.size == 1 or buffer.numel() == 0:
        return
    links.run(recursive_doubling(links.position, links.size,
                                 TensorReducible(buffer, scratch, reduce)))


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
