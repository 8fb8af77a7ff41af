"""The binomial tree: gathering every rank's bytes at position 0, and broadcasting position
0's bytes to every rank, in ⌈log2 N⌉ rounds over the hypercube's links (`hypercube.py`).

Position p's parent is p with its lowest set bit cleared; its children are p + 1, p + 2,
p + 4, ... below that bit (position 0's run up to N). Parent and child differ in one bit, so
every edge is a hypercube link::

                      0
              ┌───────┼───────┐
              4       2       1          children of 0: 1, 2, 4
            ┌─┴─┐     │                  children of 4: 5, 6
            6   5     3                  children of 2: 3
            │
            7                            children of 6: 7

Gather: a position receives from its children, nearest first (the smallest subtree is
ready soonest), then sends everything it holds to its parent. Broadcast: the reverse, from
position 0 down, farthest child first (the largest subtree has the most rounds still to go).

Position 0 so receives ⌈log2 N⌉ messages per gather and sends ⌈log2 N⌉ per broadcast,
however many ranks there are; the bytes it receives still grow with N (every rank's
announcement reaches it), which is why the negotiation uses the tree only when its cache
cannot answer (`lockstep.py`).
"""

from __future__ import annotations

import pickle

from .hypercube import Receive, Schedule, Send


def _lowest_bit(position: int, size: int) -> int:
    """The distance to the parent (position 0: past every child)."""
    return position & -position if position else 1 << size.bit_length()


def gather(position: int, size: int, mine: bytes) -> Schedule:
    """Every position's `mine`, in position order, at position 0 (None elsewhere)."""
    held = [(position, mine)]
    lowest = _lowest_bit(position, size)
    distance = 1
    while distance < lowest and position + distance < size:
        held += pickle.loads((yield Receive(position + distance)))
        distance <<= 1
    if position:
        yield Send(position - lowest, pickle.dumps(held, protocol=pickle.HIGHEST_PROTOCOL))
        return None
    return [blob for _, blob in sorted(held)]


def broadcast(position: int, size: int, root_payload: bytes | None) -> Schedule:
    """Position 0's `root_payload` on every position (returned)."""
    lowest = _lowest_bit(position, size)
    payload = root_payload if position == 0 else (yield Receive(position - lowest))
    distance = lowest >> 1
    while distance:
        if position + distance < size:
            yield Send(position + distance, payload)
        distance >>= 1
    return payload
