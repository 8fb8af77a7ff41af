"""Ranks on one host exchange data through memory they all map, not through sockets.

Every rank owns one segment, created with ``memfd_create``: it has no name in ``/dev/shm``,
so nothing can be left behind there, whatever kills whom. Its neighbours on the host map it
through ``/proc/<pid>/fd/<fd>`` (the owner's pid and descriptor travel over the run's
authenticated coordination channels when the ring forms: `rendezvous.connect_host_group`),
and the memory lives until the last of them unmaps it. A segment holds two counters and two
data buffers::

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

Data with the negotiation. A negotiation cycle is one round of its own (`exchange`): every
rank writes a message at the start of its buffer. A rank may also attach, after the first
`MESSAGE_BYTES`, the data of the allreduce it expects to run next; when the cycle decides on
exactly what every rank attached, `allreduce_attached` reduces it from there, in the same
round (one phase more for a large one), instead of starting a round of its own. A small step
of a training loop then costs one round, not two.

Reduce-scatter, one phase per piece: every rank publishes the parts the others own and
reduces its own part in place from every neighbour's buffer (the first phase of the large
path above, with each rank's part given by the caller).

GPU tensors run the same rounds through buffers in GPU memory that the ranks map from each
other with CUDA IPC (`peer_memory.py`), mapped the first time a collective needs them; the
counters stay here, and each phase's GPU work is fenced before its counter is bumped.

Waiting. A waiting rank spins on the counters for `SPIN_S` when the host has a core for
every rank, then sleeps on the counter's futex in slices of `SLEEP_SLICE_S`; between slices
it checks whether the neighbour's process still exists (a pidfd becomes readable when the
process ends, even if nobody reaps it) and whether the deadline has passed. A neighbour
that dies, by SIGKILL or otherwise, becomes `PeerLostError` within a slice; no wait is
unbounded.

Doorbell. An idle rank sleeps on its doorbell word; a neighbour that starts something the
idle rank must take part in (a negotiation cycle) rings it, at once if the idle rank waits
for one and after a slice if not (see `exchange`), and so does the rank's own user thread
when it submits work for the background thread.

Memory ordering. The counter is written after the data and read before it. x86-64 keeps
stores in order and loads in order (TSO), which is what this relies on; on other machines
the runtime uses TCP (see `supported`).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import os
import select
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from ... import kernels
from . import futex
from ..agreement import gather
from ..errors import CollectiveAbortedError, PeerLostError
from .peer_memory import BUFFER_BYTES, CudaIpcMemory, HostMemory, PeerMemory
from .ring import chunk_bounds
from ..world import World

HEADER_BYTES = 4096  # the counters, on their own page
_DOORBELL_OFFSET = 64  # a cache line away from the progress counter
SMALL_BYTES = 128 << 10
"""Pieces up to this size are reduced by every rank over all buffers: one wait instead of two."""
MESSAGE_BYTES = 64 << 10
"""A round's first bytes carry a negotiation message; data attached to it follows them."""
Payload = Callable[[torch.dtype, int], torch.Tensor]
"""`payload(dtype, numel)`: a view of this rank's payload area in the round being written."""
SPIN_S = 100e-6
_LENGTH = struct.Struct("<q")  # an exchanged message starts with its length
MESSAGE_ROOM = MESSAGE_BYTES - _LENGTH.size
"""The longest message that leaves room to attach data after it."""
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


def _reduce_in_rank_order(out: torch.Tensor, contributions: list[torch.Tensor], reduce) -> None:
    """`out` = every local rank's contribution reduced in local-rank order: the same order,
    so the same bits, on every rank that reduces them all."""
    out.copy_(contributions[0])
    for theirs in contributions[1:]:
        reduce(out, theirs)


def _ended(neighbour: Neighbour) -> bool:
    """Has the neighbour's process ended? (A pidfd turns readable then, reaped or not.)"""
    return bool(select.select([neighbour.pidfd], [], [], 0)[0])


class HostGroup:
    """The ranks of one host, and the collectives they run through shared memory.

    `segments` is every local rank's segment in local-rank order (this rank's own among
    them), so the same index means the same rank on every member. Data moves through their
    buffers (`memory`) for host tensors, and through GPU buffers mapped on first use
    (`gpu_memory`) for CUDA tensors; the counters are the segments' either way.
    """

    def __init__(self, world: World, ranks: list[int], own: Segment,
                 neighbours: dict[int, Neighbour], op_timeout: float):
        self.world = world
        self.ranks = ranks
        self.index = ranks.index(world.rank)
        self.own = own
        self.neighbours = [neighbours[r] for r in ranks if r != world.rank]
        self.segments = [own if r == world.rank else neighbours[r].segment for r in ranks]
        self.memory = HostMemory([segment.buffers for segment in self.segments])
        self._gpu_memory: CudaIpcMemory | None = None
        self._gpu_mapped = False  # whether the ranks have tried to map GPU buffers yet
        self._others = [index for index in range(len(ranks)) if index != self.index]
        self._reducers: dict[tuple, Callable[[torch.Tensor, torch.Tensor], None]] = {}
        self.op_timeout = op_timeout
        self.spin_s = SPIN_S if len(ranks) <= len(os.sched_getaffinity(0)) else 0.0
        self._round = 0
        self._attached_to: int | None = None  # the buffer of the last exchange, if data rode on it
        self._aborted: str | None = None  # why `abort` ended every wait (a pool's cell was stopped)

    @property
    def size(self) -> int:
        return len(self.ranks)

    # ---- collectives -----------------------------------------------------------------------
    # `buffer` is a 1-D tensor on the host, or on a GPU whose `device_memory` is mapped.

    def allreduce(self, buffer: torch.Tensor, op: str,
                  across_hosts: Callable[[torch.Tensor], None] | None = None) -> None:
        """Reduce `buffer` over the host's ranks, in place (`op`: kernels' name).

        Hierarchical allreduce: with `across_hosts`, each rank hands its part of the host's
        reduction to it (which reduces it with the same part on the other hosts, in place)
        before the parts are gathered, so the result is reduced over every rank of the run.
        Its rounds are whole buffers: each round waits for a collective across the network,
        whose latency counts for more than the caches do.
        """
        memory, reduce = self._memory_of(buffer), self._reducer(op, buffer)
        round_bytes = memory.round_bytes if across_hosts is None else BUFFER_BYTES
        for piece in self._pieces(buffer, round_bytes):
            if across_hosts is None and piece.numel() * piece.element_size() <= SMALL_BYTES:
                self._reduce_everywhere(memory, piece, reduce)
            else:
                self._reduce_scatter_allgather(memory, piece, reduce, across_hosts)

    def reduce_scatter(self, buffer: torch.Tensor, parts: list[tuple[int, int]], op: str) -> None:
        """Reduce `buffer` over the host's ranks so that local rank i's part,
        `buffer[parts[i][0]:parts[i][1]]`, holds the reduction on local rank i (the rest of
        each rank's buffer is left as it was)."""
        memory, reduce = self._memory_of(buffer), self._reducer(op, buffer)
        own_start, own_end = parts[self.index]
        per_round = memory.round_bytes // buffer.element_size()
        for piece_start in range(0, buffer.numel(), per_round):
            piece = buffer[piece_start:piece_start + per_round]
            start = min(max(own_start - piece_start, 0), piece.numel())  # my part, in this piece
            end = min(max(own_end - piece_start, start), piece.numel())
            round_buffer = self._next_buffer()
            mine = memory.view(self.index, round_buffer, piece.dtype, piece.numel())
            mine[:start].copy_(piece[:start])
            mine[end:].copy_(piece[end:])
            self._publish_and_wait(memory)
            if end > start:
                reduced = piece[start:end]
                for index in self._others:
                    theirs = memory.view(index, round_buffer, piece.dtype, piece.numel())
                    reduce(reduced, theirs[start:end])

    def allgather(self, blocks: list[torch.Tensor]) -> None:
        """`blocks[i]` is local rank i's block (this rank's filled in): fill in the others."""
        mine = blocks[self.index]
        memory = self._memory_of(mine)
        per_round = memory.round_bytes // mine.element_size()
        longest = max(block.numel() for block in blocks)
        for start in range(0, max(longest, 1), per_round):
            buffer = self._next_buffer()
            piece = mine[start:start + per_round]
            memory.view(self.index, buffer, mine.dtype, piece.numel()).copy_(piece)
            self._publish_and_wait(memory)
            for index in self._others:
                theirs = blocks[index][start:start + per_round]
                theirs.copy_(memory.view(index, buffer, theirs.dtype, theirs.numel()))

    def broadcast(self, buffer: torch.Tensor, root_index: int) -> None:
        """Copy local rank `root_index`'s `buffer` to every rank of the host."""
        memory = self._memory_of(buffer)
        for piece in self._pieces(buffer, memory.round_bytes):
            round_buffer = self._next_buffer()
            if self.index == root_index:
                memory.view(self.index, round_buffer, piece.dtype, piece.numel()).copy_(piece)
            self._publish_and_wait(memory)
            if self.index != root_index:
                piece.copy_(memory.view(root_index, round_buffer, piece.dtype, piece.numel()))

    def exchange(self, message: bytes, attach: Callable[[Payload], None] | None = None,
                 asleep: Collection[int] = ()) -> list[bytes]:
        """Every local rank's `message`, in local-rank order: one round (more if one is huge).

        `attach(payload)` fills this rank's payload area before the round is published (the
        host buffer after its first `MESSAGE_BYTES`; `payload(dtype, numel)` views it), only
        with a message that fits before it: see `allreduce_attached`.

        Neighbours that have not started this round have their doorbells rung: at once the
        ones in `asleep` (local indices of ranks that wait for a round, their thread most
        likely asleep on the doorbell), the others after a slice. A rank that waits for
        nothing is busy, and its own thread comes when its user next waits: woken sooner, its
        background thread would only announce that it has nothing, taking the GIL and the
        core from the user, and the round this rank needs would still be the next one.
        """
        if attach is not None and len(message) > MESSAGE_ROOM:
            raise ValueError(f"a message of {len(message)} bytes leaves no room to attach data")
        capacity = BUFFER_BYTES - _LENGTH.size
        received = [bytearray() for _ in self.ranks]
        lengths: list[int] = []
        offset = 0
        while not lengths or offset < max(lengths):
            buffer = self._next_buffer()
            self.own.write_message(buffer, len(message), message[offset:offset + capacity])
            if attach is not None:
                attach(functools.partial(self.memory.view, self.index, buffer, offset=MESSAGE_BYTES))
                attach = None
            self._publish_and_wait(self.memory, asleep)
            asleep = ()  # (rung once: the later rounds of a huge message follow at once)
            if not lengths:
                lengths = [segment.message_length(buffer) for segment in self.segments]
                self._attached_to = buffer
                if max(lengths) <= capacity:  # the usual case: one round, read as it is
                    return [segment.read_message(buffer, length)
                            for segment, length in zip(self.segments, lengths)]
            for index, segment in enumerate(self.segments):
                take = min(capacity, lengths[index] - offset)
                if take > 0:
                    received[index] += segment.read_message(buffer, take)
            offset += capacity
        if max(lengths) > capacity:
            self._attached_to = None  # later rounds of this exchange reused the buffer
        return [bytes(data) for data in received]

    def allreduce_attached(self, outputs: Sequence[torch.Tensor], op: str) -> None:
        """Reduce what every rank attached to the last `exchange` into the 1-D host tensors
        `outputs`, of one dtype: their elements end to end, at the start of each payload area.

        Call it right after that exchange, before anything else runs a round: the round
        after next may overwrite the attached data. Small data is reduced by every rank over
        all payloads (no further wait); large data in place, each rank its part in its own
        payload area, which the others copy out, straight into the outputs it overlaps,
        after one more phase.
        """
        buffer, self._attached_to = self._attached_to, None
        if buffer is None:
            raise RuntimeError("allreduce_attached: the last exchange carried no attached data")
        dtype, reduce = outputs[0].dtype, self._reducer(op, outputs[0])
        # (A small step's one output is the whole payload: no offsets, no views of views.)
        starts = [0, outputs[0].numel()] if len(outputs) == 1 else \
            list(itertools.accumulate((output.numel() for output in outputs), initial=0))
        numel = starts[-1]
        attached = [self.memory.view(index, buffer, dtype, numel, MESSAGE_BYTES)
                    for index in range(self.size)]
        if numel * dtype.itemsize <= SMALL_BYTES:
            for output, start in zip(outputs, starts):
                theirs = attached if len(outputs) == 1 else \
                    [data[start:start + output.numel()] for data in attached]
                _reduce_in_rank_order(output, theirs, reduce)
            return
        parts = chunk_bounds(numel, self.size)
        start, end = parts[self.index]
        reduced = attached[self.index][start:end]
        for index in self._others:
            reduce(reduced, attached[index][start:end])
        self._publish_and_wait(self.memory)
        for output, output_start in zip(outputs, starts):
            output_end = output_start + output.numel()
            for index, (part_start, part_end) in enumerate(parts):
                low, high = max(output_start, part_start), min(output_end, part_end)
                if low < high:
                    output[low - output_start:high - output_start].copy_(attached[index][low:high])

    def gpu_memory(self, device: torch.device) -> CudaIpcMemory | None:
        """The ranks' GPU buffers, this rank's on `device` (the first GPU a collective of
        this rank used: later calls return the same, whatever their device), mapped on first
        use; None where CUDA IPC does not work here (the caller then stages through host
        memory).

        Every local rank calls this at the same point: they run the same collectives in the
        same order, and the ranks of a collective agree on its device type. So the mapping is
        agreed over `exchange`: either every rank maps its neighbours' buffers or none does.
        """
        if not self._gpu_mapped:
            self._gpu_mapped = True
            self._gpu_memory = self._map_gpu_memory(device)
        return self._gpu_memory

    def neighbour_started_a_round(self) -> bool:
        """Has a neighbour moved past this rank, i.e. begun a round this rank has not?"""
        mine = self.own.progress
        return any(neighbour.segment.progress > mine for neighbour in self.neighbours)

    def sleep_on_doorbell(self, seen: int, timeout_s: float) -> None:
        """Sleep until the doorbell moves past `seen` (read it before deciding to sleep), at
        most `timeout_s` (and at most one slice: the caller re-checks its neighbours)."""
        futex.wait(self.own.doorbell_address, seen, min(timeout_s, SLEEP_SLICE_S))

    def abort(self, reason: str) -> None:
        """End every wait of this rank now, from any thread: each raises
        `CollectiveAbortedError(reason)` within a slice (woken at once where it sleeps). The
        memory stays mapped until `close`, which a waiter may still be reading."""
        self._aborted = reason
        self.own.ring()
        for neighbour in self.neighbours:
            futex.wake_all(neighbour.segment.progress_address)

    def check_neighbours(self) -> None:
        """Raise `PeerLostError` for a neighbour whose process has ended."""
        for neighbour in self.neighbours:
            if _ended(neighbour):
                raise self._lost(neighbour, "its process ended")

    def _reduce_everywhere(self, memory: PeerMemory, piece: torch.Tensor, reduce) -> None:
        """One phase: publish my piece, then reduce all of them in local-rank order myself."""
        buffer = self._next_buffer()
        numel, dtype = piece.numel(), piece.dtype
        memory.view(self.index, buffer, dtype, numel).copy_(piece)
        self._publish_and_wait(memory)
        _reduce_in_rank_order(piece, [memory.view(index, buffer, dtype, numel)
                                      for index in range(self.size)], reduce)

    def _reduce_scatter_allgather(self, memory: PeerMemory, piece: torch.Tensor, reduce,
                                  across_hosts: Callable[[torch.Tensor], None] | None) -> None:
        """Two phases: each rank reduces its part in place, publishes it, then all copy all parts.

        A rank's own part never goes through its buffer on the way in: it is reduced where it
        is, from the neighbours' buffers, and copied out once for them to read. Large pieces
        are bound by memory bandwidth, and this saves a read and a write of 1/N of the piece.
        """
        buffer = self._next_buffer()
        numel, dtype = piece.numel(), piece.dtype
        mine = memory.view(self.index, buffer, dtype, numel)
        parts = chunk_bounds(numel, self.size)
        start, end = parts[self.index]
        mine[:start].copy_(piece[:start])  # the parts the neighbours reduce
        mine[end:].copy_(piece[end:])
        self._publish_and_wait(memory)
        reduced = piece[start:end]
        for index in self._others:
            reduce(reduced, memory.view(index, buffer, dtype, numel)[start:end])
        if across_hosts is not None:
            across_hosts(reduced)  # the neighbours wait in the next phase meanwhile
        mine[start:end].copy_(reduced)
        self._publish_and_wait(memory)
        for index in self._others:
            part_start, part_end = parts[index]
            piece[part_start:part_end].copy_(
                memory.view(index, buffer, dtype, numel)[part_start:part_end])

    def _reducer(self, op: str, like: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """`kernels.reducer`, kept per op, dtype and device: a step reduces alike every time."""
        key = (op, like.dtype, like.device)
        reduce = self._reducers.get(key)
        if reduce is None:
            reduce = self._reducers[key] = kernels.reducer(op, like)
        return reduce

    def _memory_of(self, tensor: torch.Tensor) -> PeerMemory:
        if self._gpu_memory is not None and tensor.device == self._gpu_memory.device:
            return self._gpu_memory
        if not tensor.is_cpu:
            raise RuntimeError(f"no peer-mapped memory on {tensor.device}: stage through the host")
        return self.memory

    def _map_gpu_memory(self, device: torch.device) -> CudaIpcMemory | None:
        own_pointer, handle, problem = 0, b"", None
        try:
            own_pointer, handle = CudaIpcMemory.export(device)
        except (RuntimeError, OSError) as exc:
            problem = f"rank {self.world.rank}: {exc}"
        offers = gather((handle, problem), self.exchange)
        problems = [problem for _, problem in offers if problem]
        memory = None
        if not problems:
            try:
                memory = CudaIpcMemory.open(device, self.index, own_pointer,
                                            [handle for handle, _ in offers])
            except (RuntimeError, OSError) as exc:
                problem = f"rank {self.world.rank}: {exc}"
            problems = [p for p in gather(problem, self.exchange) if p]
        if not problems:
            return memory
        if memory is not None:
            memory.close()
        elif own_pointer:
            CudaIpcMemory(device, [], own_pointer, []).close()
        if self.index == 0:
            print(f"ddl_magic note: GPU tensors on this host are staged through host memory, "
                  f"not exchanged through CUDA IPC: {problems[0]}", file=sys.stderr, flush=True)
        return None

    def _pieces(self, buffer: torch.Tensor, round_bytes: int) -> list[torch.Tensor]:
        per_round = round_bytes // buffer.element_size()
        return [buffer[start:start + per_round] for start in range(0, buffer.numel(), per_round)]

    def _next_buffer(self) -> int:
        buffer = self._round % 2
        self._round += 1
        return buffer

    # ---- synchronisation -------------------------------------------------------------------

    def _publish_and_wait(self, memory: PeerMemory, asleep: Collection[int] | None = None) -> None:
        """End a phase: tell the neighbours, then wait until each has ended it too. (The
        `memory` the phase moved data through is fenced first: see `peer_memory.py`.)

        `asleep` (a negotiation round, see `exchange`): ring those late neighbours' doorbells
        now, and every late neighbour's after a slice."""
        memory.fence()
        target = self.own.publish()
        deadline = time.monotonic() + self.op_timeout
        if asleep:
            for index, neighbour in zip(self._others, self.neighbours):
                if index in asleep and neighbour.segment.progress < target:
                    neighbour.segment.ring()
        for neighbour in self.neighbours:
            if neighbour.segment.progress < target:
                self._wait_for(neighbour, target, deadline, ring_after_a_slice=asleep is not None)

    def _wait_for(self, neighbour: Neighbour, target: int, deadline: float,
                  ring_after_a_slice: bool) -> None:
        """Spin, then sleep until `neighbour` reaches `target`."""
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
            if self._aborted is not None:
                raise CollectiveAbortedError(self._aborted)
            if _ended(neighbour):
                raise self._lost(neighbour, "its process ended during a shared-memory collective")
            if time.monotonic() > deadline:
                raise self._lost(neighbour, f"timed out after {self.op_timeout:.0f} s "
                                            "in a shared-memory collective")
            if ring_after_a_slice:
                segment.ring()
                ring_after_a_slice = False

    def _lost(self, neighbour: Neighbour, what: str) -> PeerLostError:
        return PeerLostError(self.world.run_ranks[neighbour.rank],
                             self.world.peers[neighbour.rank].host, what)

    def close(self) -> None:
        if self._gpu_memory is not None:
            self._gpu_memory.close()
        for neighbour in self.neighbours:
            neighbour.segment.close()
            os.close(neighbour.pidfd)
        self.own.close()
