"""Ranks on one host exchange data through memory they all map, not through sockets.

Every rank owns one segment, created with ``memfd_create``: it has no name in ``/dev/shm``,
so nothing can be left behind there, whatever kills whom. Its neighbours on the host map it
through ``/proc/<pid>/fd/<fd>`` (the owner's pid and descriptor travel over the run's
authenticated coordination channels), and the memory lives until the last of them unmaps
it. A segment holds two counters and two data buffers::

    rank r's segment:   [ progress  doorbell | buffer 0 | buffer 1 ]
                          counters             (BUFFER_BYTES each)

Rounds. Every collective on the host is a sequence of rounds, and every local rank runs the
same sequence (the negotiation put the collectives in one order everywhere). Round k uses
buffer k % 2. A round is one or two *phases*; a phase is: write into my buffer, bump my
progress counter, wait until every neighbour's counter has caught up with mine, read their
buffers. Because a neighbour can only start writing buffer b again two rounds later, after
it has waited for my counter in the round between, which I bump only when I have finished
reading, no buffer is overwritten while someone still reads it: one wait per phase is all
the synchronisation there is (DeepSpeed's CPU allreduce uses the same double buffering).

Allreduce, for each piece of the buffer that fits in a data buffer:

- small pieces (``SMALL_BYTES``), one phase: every rank copies its piece into its buffer,
  then reduces all buffers itself, in local-rank order;
- large pieces, two phases (reduce-scatter in place, then allgather): the piece is cut into
  one part per local rank; every rank publishes the parts the others reduce, reduces *its*
  part in place from every neighbour's buffer and publishes the result, and after the
  second wait copies every reduced part out of its owner's buffer.

Either way each element is reduced by one computation that every rank reads the result of
(or that every rank runs identically), so all ranks end bit-identical.

Reduce-scatter, one phase per piece: every rank publishes the parts the others own and
reduces its own part in place from every neighbour's buffer (the first phase of the large
path above, with each rank's part given by the caller).

Waiting. A waiting rank spins on the counters for `SPIN_S` when the host has a core for
every rank, then sleeps on the counter's futex in slices of `SLEEP_SLICE_S`; between slices
it checks whether the neighbour's process still exists (a pidfd becomes readable when the
process ends, even if nobody reaps it) and whether the deadline has passed. A neighbour
that dies, by SIGKILL or otherwise, becomes `PeerLostError` within a slice; no wait is
unbounded.

Doorbell. An idle rank sleeps on its doorbell word; a neighbour that starts something the
idle rank must take part in (a negotiation cycle) rings it, and so does the rank's own
user thread when it submits work for the background thread.

Memory ordering. The counter is written after the data and read before it. x86-64 keeps
stores in order and loads in order (TSO), which is what this relies on; on other machines
the runtime uses TCP (see `supported`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import kernels
from . import futex
from .errors import PeerLostError
from .ring import chunk_bounds
from .settings import TRANSPORT_VARIABLE
from .world import World

HEADER_BYTES = 4096  # the counters, on their own page
_DOORBELL_OFFSET = 64  # a cache line away from the progress counter
BUFFER_BYTES = 8 << 20
"""Bytes per data buffer: a larger allreduce runs as several rounds, alternating buffers."""
SMALL_BYTES = 128 << 10
"""Pieces up to this size are reduced by every rank over all buffers: one wait instead of two."""
SPIN_S = 100e-6
_LENGTH = struct.Struct("<q")  # an exchanged message starts with its length
SLEEP_SLICE_S = 0.05


def supported() -> bool:
    """Shared memory can carry collectives on this machine (x86-64 Linux with memfd and futex)."""
    return futex.supported() and hasattr(os, "memfd_create") and hasattr(os, "pidfd_open")


class Segment:
    """One rank's shared memory: its progress counter and its two data buffers."""

    def __init__(self, fd: int):
        self.fd: int | None = fd  # closed once every neighbour has mapped the segment
        self._map = mmap.mmap(fd, HEADER_BYTES + 2 * BUFFER_BYTES)
        self._progress = ctypes.c_int64.from_buffer(self._map, 0)
        self.progress_address = ctypes.addressof(self._progress)
        self._doorbell = ctypes.c_int64.from_buffer(self._map, _DOORBELL_OFFSET)
        self.doorbell_address = ctypes.addressof(self._doorbell)
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES,
                                count=2 * BUFFER_BYTES)
        self.buffers = (data[:BUFFER_BYTES], data[BUFFER_BYTES:])

    @classmethod
    def create(cls) -> "Segment":
        fd = os.memfd_create("ddl_magic", os.MFD_CLOEXEC)
        os.ftruncate(fd, HEADER_BYTES + 2 * BUFFER_BYTES)  # pages appear when first touched
        return cls(fd)

    @classmethod
    def open(cls, pid: int, fd: int) -> "Segment":
        """Map another process's segment, by its pid and descriptor number."""
        return cls(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC))

    @property
    def progress(self) -> int:
        return self._progress.value

    def publish(self) -> int:
        """Bump the progress counter and wake whoever sleeps on it; returns the new value."""
        value = self._progress.value + 1
        self._progress.value = value
        futex.wake_all(self.progress_address)
        return value

    @property
    def doorbell(self) -> int:
        return self._doorbell.value

    def ring(self) -> None:
        """Wake whoever sleeps on this segment's doorbell (several ringers may lose a count:
        only the change matters)."""
        self._doorbell.value += 1
        futex.wake_all(self.doorbell_address)

    def view(self, buffer: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.buffers[buffer][:numel * dtype.itemsize].view(dtype)

    # Messages (negotiation) go through the mapping directly: a few small tensor operations
    # would cost more than the whole exchange.
    def write_message(self, buffer: int, total_length: int, piece: bytes) -> None:
        """A piece of a message of `total_length` bytes, in data buffer `buffer`."""
        start = HEADER_BYTES + buffer * BUFFER_BYTES
        _LENGTH.pack_into(self._map, start, total_length)
        self._map[start + _LENGTH.size:start + _LENGTH.size + len(piece)] = piece

    def message_length(self, buffer: int) -> int:
        return _LENGTH.unpack_from(self._map, HEADER_BYTES + buffer * BUFFER_BYTES)[0]

    def read_message(self, buffer: int, length: int) -> bytes:
        start = HEADER_BYTES + buffer * BUFFER_BYTES + _LENGTH.size
        return self._map[start:start + length]

    def close(self) -> None:
        """Let the memory go: it is unmapped when the last tensor viewing it is collected.

        Never `mmap.close()` here: it would unmap memory that a tensor still points at, and
        the next access to that tensor would crash the process.
        """
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class Neighbour:
    """Another rank on this host: its segment and a descriptor that says when it exits."""

    rank: int
    segment: Segment
    pidfd: int


def _ended(neighbour: Neighbour) -> bool:
    """Has the neighbour's process ended? (A pidfd turns readable then, reaped or not.)"""
    return bool(select.select([neighbour.pidfd], [], [], 0)[0])


class HostGroup:
    """The ranks of one host, and the collectives they run through shared memory.

    `segments` is every local rank's segment in local-rank order (this rank's own among
    them), so the same index means the same rank on every member.
    """

    def __init__(self, world: World, ranks: list[int], own: Segment,
                 neighbours: dict[int, Neighbour], op_timeout: float):
        self.world = world
        self.ranks = ranks
        self.index = ranks.index(world.rank)
        self.own = own
        self.neighbours = [neighbours[r] for r in ranks if r != world.rank]
        self.segments = [own if r == world.rank else neighbours[r].segment for r in ranks]
        self.op_timeout = op_timeout
        self.spin_s = SPIN_S if len(ranks) <= len(os.sched_getaffinity(0)) else 0.0
        self._round = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    # ---- collectives -----------------------------------------------------------------------

    def allreduce(self, buffer: torch.Tensor, op: str,
                  across_hosts: Callable[[torch.Tensor], None] | None = None) -> None:
        """Reduce the 1-D host tensor `buffer` over the host's ranks, in place (`op`: kernels' name).

        Hierarchical allreduce: with `across_hosts`, each rank hands its part of the host's
        reduction to it (which reduces it with the same part on the other hosts, in place)
        before the parts are gathered, so the result is reduced over every rank of the run.
        """
        for piece in self._pieces(buffer):
            if across_hosts is None and piece.numel() * piece.element_size() <= SMALL_BYTES:
                self._reduce_everywhere(piece, op)
            else:
                self._reduce_scatter_allgather(piece, op, across_hosts)

    def reduce_scatter(self, buffer: torch.Tensor, parts: list[tuple[int, int]], op: str) -> None:
        """Reduce the 1-D host tensor `buffer` over the host's ranks so that local rank i's
        part, `buffer[parts[i][0]:parts[i][1]]`, holds the reduction on local rank i (the
        rest of each rank's buffer is left as it was)."""
        own_start, own_end = parts[self.index]
        per_round = BUFFER_BYTES // buffer.element_size()
        for piece_start in range(0, buffer.numel(), per_round):
            piece = buffer[piece_start:piece_start + per_round]
            start = min(max(own_start - piece_start, 0), piece.numel())  # my part, in this piece
            end = min(max(own_end - piece_start, start), piece.numel())
            round_buffer = self._next_buffer()
            mine = self.own.view(round_buffer, piece.dtype, piece.numel())
            mine[:start].copy_(piece[:start])
            mine[end:].copy_(piece[end:])
            self._publish_and_wait()
            if end > start:
                reduced = piece[start:end]
                for index, segment in enumerate(self.segments):
                    if index != self.index:
                        theirs = segment.view(round_buffer, piece.dtype, piece.numel())
                        kernels.reduce_(reduced, theirs[start:end], op)

    def allgather(self, blocks: list[torch.Tensor]) -> None:
        """`blocks[i]` is local rank i's 1-D block (this rank's filled in): fill in the others."""
        mine = blocks[self.index]
        itemsize = mine.element_size()
        per_round = BUFFER_BYTES // itemsize
        longest = max(block.numel() for block in blocks)
        for start in range(0, max(longest, 1), per_round):
            buffer = self._next_buffer()
            piece = mine[start:start + per_round]
            self.own.view(buffer, mine.dtype, piece.numel()).copy_(piece)
            self._publish_and_wait()
            for index, block in enumerate(blocks):
                if index != self.index:
                    theirs = block[start:start + per_round]
                    theirs.copy_(self.segments[index].view(buffer, block.dtype, theirs.numel()))

    def broadcast(self, buffer: torch.Tensor, root_index: int) -> None:
        """Copy local rank `root_index`'s 1-D `buffer` to every rank of the host."""
        for piece in self._pieces(buffer):
            round_buffer = self._next_buffer()
            if self.index == root_index:
                self.own.view(round_buffer, piece.dtype, piece.numel()).copy_(piece)
            self._publish_and_wait()
            if self.index != root_index:
                piece.copy_(self.segments[root_index].view(round_buffer, piece.dtype, piece.numel()))

    def exchange(self, message: bytes) -> list[bytes]:
        """Every local rank's `message`, in local-rank order: one round (more if one is huge).

        Neighbours that have not started this round yet have their doorbells rung, so an
        idle one joins at once.
        """
        capacity = BUFFER_BYTES - _LENGTH.size
        received = [bytearray() for _ in self.ranks]
        lengths: list[int] = []
        offset = 0
        while not lengths or offset < max(lengths):
            buffer = self._next_buffer()
            self.own.write_message(buffer, len(message), message[offset:offset + capacity])
            self._publish_and_wait(ring_late_neighbours=True)
            if not lengths:
                lengths = [segment.message_length(buffer) for segment in self.segments]
            for index, segment in enumerate(self.segments):
                take = min(capacity, lengths[index] - offset)
                if take > 0:
                    received[index] += segment.read_message(buffer, take)
            offset += capacity
        return [bytes(data) for data in received]

    def neighbour_started_a_round(self) -> bool:
        """Has a neighbour moved past this rank, i.e. begun a round this rank has not?"""
        mine = self.own.progress
        return any(neighbour.segment.progress > mine for neighbour in self.neighbours)

    def sleep_on_doorbell(self, seen: int, timeout_s: float) -> None:
        """Sleep until the doorbell moves past `seen` (read it before deciding to sleep), at
        most `timeout_s` (and at most one slice: the caller re-checks its neighbours)."""
        futex.wait(self.own.doorbell_address, seen, min(timeout_s, SLEEP_SLICE_S))

    def check_neighbours(self) -> None:
        """Raise `PeerLostError` for a neighbour whose process has ended."""
        for neighbour in self.neighbours:
            if _ended(neighbour):
                raise self._lost(neighbour, "its process ended")

    def _reduce_everywhere(self, piece: torch.Tensor, op: str) -> None:
        """One phase: publish my piece, then reduce all of them in local-rank order myself."""
        buffer = self._next_buffer()
        numel, dtype = piece.numel(), piece.dtype
        self.own.view(buffer, dtype, numel).copy_(piece)
        self._publish_and_wait()
        piece.copy_(self.segments[0].view(buffer, dtype, numel))
        for segment in self.segments[1:]:
            kernels.reduce_(piece, segment.view(buffer, dtype, numel), op)

    def _reduce_scatter_allgather(self, piece: torch.Tensor, op: str,
                                  across_hosts: Callable[[torch.Tensor], None] | None) -> None:
        """Two phases: each rank reduces its part in place, publishes it, then all copy all parts.

        A rank's own part never goes through its buffer on the way in: it is reduced where it
        is, from the neighbours' buffers, and copied out once for them to read. Large pieces
        are bound by memory bandwidth, and this saves a read and a write of 1/N of the piece.
        """
        buffer = self._next_buffer()
        numel, dtype = piece.numel(), piece.dtype
        mine = self.own.view(buffer, dtype, numel)
        parts = chunk_bounds(numel, self.size)
        start, end = parts[self.index]
        mine[:start].copy_(piece[:start])  # the parts the neighbours reduce
        mine[end:].copy_(piece[end:])
        self._publish_and_wait()
        reduced = piece[start:end]
        for index, segment in enumerate(self.segments):
            if index != self.index:
                kernels.reduce_(reduced, segment.view(buffer, dtype, numel)[start:end], op)
        if across_hosts is not None:
            across_hosts(reduced)  # the neighbours wait in the next phase meanwhile
        mine[start:end].copy_(reduced)
        self._publish_and_wait()
        for index, (part_start, part_end) in enumerate(parts):
            if index != self.index:
                piece[part_start:part_end].copy_(
                    self.segments[index].view(buffer, dtype, numel)[part_start:part_end])

    def _pieces(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        per_round = BUFFER_BYTES // buffer.element_size()
        return [buffer[start:start + per_round] for start in range(0, buffer.numel(), per_round)]

    def _next_buffer(self) -> int:
        buffer = self._round % 2
        self._round += 1
        return buffer

    # ---- synchronisation -------------------------------------------------------------------

    def _publish_and_wait(self, ring_late_neighbours: bool = False) -> None:
        """End a phase: tell the neighbours, then wait until each has ended it too."""
        target = self.own.publish()
        late = [n for n in self.neighbours if n.segment.progress < target]
        if ring_late_neighbours:
            for neighbour in late:
                neighbour.segment.ring()
        deadline = time.monotonic() + self.op_timeout
        for neighbour in late:
            self._wait_for(neighbour, target, deadline)

    def _wait_for(self, neighbour: Neighbour, target: int, deadline: float) -> None:
        segment = neighbour.segment
        spin_until = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_until:
            if segment.progress >= target:
                return
        while True:
            seen = segment.progress
            if seen >= target:
                return
            futex.wait(segment.progress_address, seen, SLEEP_SLICE_S)
            if segment.progress >= target:
                return
            if _ended(neighbour):
                raise self._lost(neighbour, "its process ended during a shared-memory collective")
            if time.monotonic() > deadline:
                raise self._lost(neighbour, f"timed out after {self.op_timeout:.0f} s "
                                            "in a shared-memory collective")

    def _lost(self, neighbour: Neighbour, what: str) -> PeerLostError:
        return PeerLostError(self.world.run_ranks[neighbour.rank],
                             self.world.peers[neighbour.rank].host, what)

    def close(self) -> None:
        for neighbour in self.neighbours:
            neighbour.segment.close()
            os.close(neighbour.pidfd)
        self.own.close()


# ---- forming the groups at init() ----------------------------------------------------------

def connect_host_group(world: World, coordination: dict, choice: str,
                       op_timeout: float) -> HostGroup | None:
    """Map the segments of this rank's host neighbours; None where the ranks use TCP instead.

    Every rank calls this at `init()`, right after the ring is connected. Whether shared
    memory is wanted at all follows from the peer table and `choice`, the same on every
    rank; whether it works is agreed over the coordination channels, so either every host
    uses it or none does, and `shm` that cannot work is an error on every rank.
    """
    if choice == "tcp" or len(world.hosts) == world.size:  # no host has two ranks
        return None
    on_this_host = world.ranks_on(world.peers[world.rank].host)
    own = Segment.create() if supported() else None
    offers = _exchange(world, coordination, (os.getpid(), own.fd) if own else None, op_timeout)
    neighbours: dict[int, Neighbour] = {}
    problem = None
    if own is None:
        problem = ("shared memory between processes needs x86-64 Linux (memfd, futex, pidfd); "
                   f"this is {os.uname().sysname} on {os.uname().machine}")
    else:
        try:
            for rank in on_this_host:
                if rank != world.rank:
                    pid, fd = offers[rank]
                    neighbours[rank] = Neighbour(rank, Segment.open(pid, fd), os.pidfd_open(pid))
        except (OSError, TypeError) as exc:
            problem = f"rank {world.rank} could not map rank {rank}'s memory on the same host: {exc}"
    problems = [p for p in _exchange(world, coordination, problem, op_timeout) if p]
    if own is not None:
        os.close(own.fd)  # every neighbour has mapped it (or given up): the mappings keep it alive
        own.fd = None
    if problems:
        for neighbour in neighbours.values():
            neighbour.segment.close()
            os.close(neighbour.pidfd)
        if own is not None:
            own.close()
        if choice == "shm":
            raise RuntimeError(f"{TRANSPORT_VARIABLE}=shm, but shared memory cannot be used: "
                               f"{problems[0]}. Set {TRANSPORT_VARIABLE}=auto to fall back to TCP.")
        if world.rank == 0:
            print(f"ddl_magic note: ranks on one host use TCP, not shared memory: {problems[0]}",
                  file=sys.stderr, flush=True)
        return None
    for neighbour in neighbours.values():
        os.close(neighbour.segment.fd)
        neighbour.segment.fd = None
    return HostGroup(world, on_this_host, own, neighbours, op_timeout)


def _exchange(world: World, coordination: dict, mine, timeout: float) -> list:
    """Every rank's `mine`, in rank order, gathered and sent back by rank 0."""
    channels = coordination.items()
    try:
        for _, channel in channels:
            channel.sock.settimeout(timeout)
        if world.rank != 0:
            coordination[0].send(mine)
            return coordination[0].recv()
        gathered = [mine] + [None] * (world.size - 1)
        for rank, channel in channels:
            gathered[rank] = channel.recv()
        for _, channel in channels:
            channel.send(gathered)
        return gathered
    except (OSError, EOFError, ConnectionError) as exc:
        rank = 0 if world.rank != 0 else next(iter(coordination))
        raise PeerLostError(world.run_ranks[rank], world.peers[rank].host,
                            f"lost while setting up shared memory: {exc}") from exc
    finally:
        for _, channel in channels:
            channel.sock.settimeout(None)
