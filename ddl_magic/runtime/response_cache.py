"""The response cache every rank keeps alike, and the control vector that asks all ranks at
once what they have pending (Horovod's response cache, its PRs #902 and #1305).

Rank 0's `Coordinator` (`negotiation.py`) gives every request it has answered a cache id,
and every rank learns the id in the same cycle, so every rank's `ResponseCache` holds the
same ids for the same requests. A request this rank has pending that matches its cached
request *hits*, and is named by one bit: bit i of the control vector says "cache id i is
pending here".

One bitwise AND over all ranks of those bits (`ControlVector.combine`, run by recursive
doubling) says which cached requests every rank has pending: those run, fused the same way
on every rank, with no message to rank 0. The same combine ORs the flags, so the same
rounds also say whether any rank needs rank 0 this cycle (a request the cache cannot
answer). The vector is ⌈cached/64⌉ words and one field of flags, whatever the number of
ranks.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from .negotiation import Request

_FLAGS = struct.Struct("<I")


class Flag(enum.IntFlag):
    """What any rank of the cycle says (ORed across ranks)."""

    COORDINATE = 1  # rank 0's Coordinator is needed: an uncached request, a long wait, a join


@dataclass(frozen=True)
class ControlVector:
    """One rank's, then every rank's, say in a cycle.

    >>> mine = ControlVector(hits=0b1011, flags=Flag(0))
    >>> theirs = ControlVector(hits=0b0110, flags=Flag.COORDINATE)
    >>> agreed = mine.combine(theirs)
    >>> bin(agreed.hits), agreed.flags
    ('0b10', <Flag.COORDINATE: 1>)
    >>> ControlVector.decode(agreed.encode(words=1)) == agreed
    True
    """

    hits: int  # bit i: cache id i is pending (on every rank, once combined)
    flags: Flag

    def combine(self, other: "ControlVector") -> "ControlVector":
        return ControlVector(self.hits & other.hits, self.flags | other.flags)

    def encode(self, words: int) -> bytes:
        return _FLAGS.pack(self.flags) + self.hits.to_bytes(8 * words, "little")

    @classmethod
    def decode(cls, data: bytes) -> "ControlVector":
        (flags,) = _FLAGS.unpack_from(data)
        return cls(int.from_bytes(data[_FLAGS.size:], "little"), Flag(flags))


class VectorReducible:
    """The control vector as recursive doubling's value (`recursive_doubling.Reducible`)."""

    def __init__(self, vector: ControlVector, words: int):
        self.vector, self.words = vector, words

    def payload(self) -> bytes:
        return self.vector.encode(self.words)

    def landing(self) -> None:
        return None

    def absorb(self, received: bytes) -> None:
        self.vector = self.vector.combine(ControlVector.decode(received))

    def result_landing(self) -> None:
        return None

    def replace(self, received: bytes) -> None:
        self.vector = ControlVector.decode(received)


class ResponseCache:
    """This rank's copy of the cache: id -> request, and each request's id.

    A name may hold several ids, one per shape (or dtype, or op) it came with: the `ddl`
    backend names a kind's collectives by their count modulo a window, so DDP's buckets of
    different sizes come back under one name with either size, step after step, and each
    must stay a hit.

    >>> cache = ResponseCache()
    >>> grad = Request("grad", "allreduce", None, (4,))
    >>> cache.update({0: grad, 1: grad._replace(shape=(5,))})
    >>> cache.hit(grad), cache.hit(grad._replace(shape=(5,))), cache.hit(grad._replace(shape=(6,)))
    (0, 1, None)
    >>> cache.words
    1
    """

    def __init__(self):
        self.requests: dict[int, Request] = {}
        self._ids: dict[Request, int] = {}

    def hit(self, request: Request) -> int | None:
        """The cache id of exactly this request, or None."""
        return self._ids.get(request)

    def encode(self, request: Request) -> "Request | int":
        """The request as it travels to rank 0: its cache id where it has one."""
        cache_id = self.hit(request)
        return request if cache_id is None else cache_id

    def update(self, updates: dict[int, Request]) -> None:
        for cache_id, request in updates.items():
            self.requests[cache_id] = request
            self._ids[request] = cache_id

    @property
    def words(self) -> int:
        """64-bit words of the control vector: one bit per cache id."""
        return (max(self.requests, default=-1) + 64) // 64
