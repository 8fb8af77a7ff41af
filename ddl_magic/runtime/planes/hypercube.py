"""The hypercube: links between the ranks of a ring whose positions differ in one bit, and
the schedules that run over them (recursive doubling, the binomial tree).

The ring (`tcp.py`) gives each rank two neighbours; a collective over it takes N-1 steps per
phase. Latency-optimal collectives pair ranks that are 1, 2, 4, ... positions apart instead,
so each rank also has a link to every position that differs from its own in one bit::

        distance 1:   0─1   2─3   4─5   6─7
        distance 2:   0─2   1─3   4─6   5─7
        distance 4:   0─4   1─5   2─6   3─7

At most ⌈log2 N⌉ links per rank (a position p has a link to p XOR 2^k wherever that is a
position of the ring), so rank 0 holds as few as any other rank. Positions are those of the
ring (`RingTransport.position`: host by host), so the short distances stay within a host.

An algorithm over these links is a *schedule*: a generator that yields what this rank does,
in order (`Send`, `Receive`, or `Exchange`: a send and a receive at once), and is sent back
what it received. Written so, the algorithm never touches a socket:

- `HypercubeLinks.run` carries a schedule out over this rank's sockets;
- the scale simulation (`benchmarks/scale.py`) carries out every rank's schedule in one
  process, through an in-memory transport that counts messages, bytes and rounds.

Every message travels as a frame: its kind, the sender's round (a Lamport clock: a message
sent at round r makes its receiver's round at least r + 1, so a rank's round at the end of
a schedule is the length of the longest chain of messages that led to it, the rounds of
latency on the critical path), its length, then its bytes. A frame of kind ABORT carries a
reason instead: a rank whose negotiation failed tells its partners, and they tell theirs, so
every rank learns why within log2 N hops instead of waiting for its op timeout.

Why every wait ends: each socket has the op timeout as its deadline while a schedule runs; a
partner that is gone is a `PeerLostError` naming it, and one that aborted raises its reason.
"""

from __future__ import annotations

import collections
import queue
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Generator, NamedTuple

from ...wire.channel import PeerClosedError, peer_timeout_s, recv_exactly
from ..errors import HorovodInternalError, PeerLostError
from ..world import World


class Send(NamedTuple):
    """Send `payload` to the rank at position `to`."""

    to: int
    payload: bytes | memoryview


class Receive(NamedTuple):
    """Receive the next message from position `source`: into `into` (its exact size), or,
    with `into` None, as the bytes that come back from the yield."""

    source: int
    into: memoryview | None = None


class Exchange(NamedTuple):
    """Send `payload` to `partner` and receive its message at the same time (full duplex)."""

    partner: int
    payload: bytes | memoryview
    into: memoryview | None = None


Operation = Send | Receive | Exchange
Schedule = Generator[Operation, "bytes | None", object]
"""One rank's side of an algorithm: yields operations, is sent what each one received."""


def partners(position: int, size: int) -> list[int]:
    """The positions linked to `position` in a ring of `size`: those one bit away.

    >>> partners(0, 8), partners(5, 6)
    ([1, 2, 4], [4, 1])
    """
    return [position ^ (1 << bit) for bit in range(max(size - 1, 0).bit_length())
            if position ^ (1 << bit) < size]


def links_to_open(rank: int, members: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(the ranks this rank connects to, the ranks it accepts from) for the hypercube of the
    ring `members`: the rank at the higher position of each pair connects.

    >>> links_to_open(5, (0, 1, 2, 3, 4, 5))
    ([4, 1], [])
    """
    position = members.index(rank)
    linked = partners(position, len(members))
    return ([members[p] for p in linked if p < position],
            [members[p] for p in linked if p > position])


@dataclass
class ScheduleCount:
    """What one run of a schedule cost this rank."""

    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0  # the Lamport clock at the end: rounds of latency on the critical path


class PeerAborted(HorovodInternalError):
    """A partner's negotiation failed; the message is its reason, which every rank learns."""


_HEADER = struct.Struct("!BIQ")  # kind, the sender's round, length
_MESSAGE, _ABORT = 0, 1
# Below this size a send goes on the calling thread: both partners of an exchange may send
# at once, and the kernel's socket buffers absorb this much while neither is reading yet.
INLINE_SEND_BYTES = 32 * 1024


class HypercubeLinks:
    """This rank's links to its hypercube partners, and a schedule runner over them.

    Only one thread runs schedules (the op queue's background thread); `abort` and `close`
    may come from any thread.
    """

    def __init__(self, world: World, members: tuple[int, ...], sockets: dict[int, socket.socket],
                 op_timeout: float):
        self.world = world
        self.members = members
        self.position = members.index(world.rank)
        self.size = len(members)
        # position -> socket
        self.sockets = {members.index(rank): sock for rank, sock in sockets.items()}
        for sock in self.sockets.values():
            sock.settimeout(op_timeout)
        self.op_timeout = op_timeout
        self._sends: queue.SimpleQueue | None = None
        self.count = ScheduleCount()

    def run(self, schedule: Schedule) -> object:
        """Carry out `schedule` over the sockets and return what it returns; `count` then
        says what it cost."""
        count = self.count = ScheduleCount()
        received: bytes | None = None
        try:
            while True:
                operation = schedule.send(received)
                received = None
                if type(operation) is Send:
                    self._wait(self._send(operation.to, operation.payload, count))
                elif type(operation) is Receive:
                    received = self._receive(operation.source, operation.into, count)
                else:
                    sending = self._send(operation.partner, operation.payload, count)
                    received = self._receive(operation.partner, operation.into, count)
                    self._wait(sending)
        except StopIteration as finished:
            return finished.value

    def readable(self) -> list[socket.socket]:
        """The sockets to watch while idle: a message on one means a partner began a cycle."""
        return list(self.sockets.values())

    def flood_abort(self, reason: str) -> None:
        """Tell every partner that this rank's negotiation failed, and why (best effort:
        a partner that is gone already knows)."""
        data = reason.encode()
        frame = _HEADER.pack(_ABORT, 0, len(data)) + data
        for sock in self.sockets.values():
            try:
                sock.settimeout(1.0)
                sock.sendall(frame)
            except OSError:
                pass

    def _send(self, position: int, payload: bytes | memoryview, count: ScheduleCount):
        count.messages_sent += 1
        count.bytes_sent += len(payload) + _HEADER.size
        header = _HEADER.pack(_MESSAGE, count.rounds, len(payload))
        sock = self.sockets[position]
        if len(payload) <= INLINE_SEND_BYTES:
            self._sendall(sock, position, header + bytes(payload))
            return None
        if self._sends is None:
            self._sends = queue.SimpleQueue()
            threading.Thread(target=self._send_loop, name="ddl-hypercube-sender",
                             daemon=True).start()
        done: list = []
        sent = threading.Event()
        self._sends.put((sock, position, header, payload, sent, done))
        return sent, done

    def _wait(self, sending) -> None:
        if sending is None:
            return
        sent, done = sending
        sent.wait()
        if done:
            raise done[0]

    def _send_loop(self) -> None:
        while True:
            item = self._sends.get()
            if item is None:
                return
            sock, position, header, payload, sent, done = item
            try:
                self._sendall(sock, position, header)
                self._sendall(sock, position, payload)
            except BaseException as exc:  # handed to the waiting schedule
                done.append(exc)
            sent.set()

    def _sendall(self, sock: socket.socket, position: int, data) -> None:
        try:
            sock.sendall(data)
        except OSError as exc:
            raise self._lost(position, exc) from exc

    def _receive(self, position: int, into: memoryview | None, count: ScheduleCount):
        sock = self.sockets[position]
        header = bytearray(_HEADER.size)
        try:
            recv_exactly(sock, memoryview(header))
            kind, their_round, length = _HEADER.unpack(header)
            body = bytearray(length) if into is None or kind == _ABORT else None
            if body is not None:
                recv_exactly(sock, memoryview(body))
        except (OSError, PeerClosedError) as exc:
            raise self._lost(position, exc) from exc
        if kind == _ABORT:
            raise PeerAborted(body.decode(errors="replace"))
        if into is not None:
            if length != len(into):
                raise HorovodInternalError(
                    f"rank {self._rank_at(position)} sent {length} bytes where {len(into)} were "
                    "due: the ranks ran different collectives (a bug: please report it)")
            try:
                recv_exactly(sock, into)
            except (OSError, PeerClosedError) as exc:
                raise self._lost(position, exc) from exc
        count.messages_received += 1
        count.bytes_received += length + _HEADER.size
        count.rounds = max(count.rounds, their_round + 1)
        return None if into is not None else bytes(body)

    def _rank_at(self, position: int) -> int:
        return self.world.run_ranks[self.members[position]]

    def _lost(self, position: int, cause: BaseException) -> PeerLostError:
        rank = self.members[position]
        if isinstance(cause, socket.timeout) and cause.errno is None:  # the socket's deadline
            what = (f"it has not taken part in the negotiation for {self.op_timeout:g} s "
                    "(DDL_MAGIC_TIMEOUT): alive, but not running Python code (a native call "
                    "holding its GIL)")
        elif isinstance(cause, socket.timeout):  # ETIMEDOUT: TCP_USER_TIMEOUT or keepalive
            what = f"its host stopped answering (no reply within {peer_timeout_s():g} s)"
        else:
            what = str(cause) or type(cause).__name__
        return PeerLostError(self.world.run_ranks[rank], self.world.peers[rank].host, what)

    def abort(self) -> None:
        """End every send and receive in progress now, from any thread."""
        for sock in self.sockets.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._sends is not None:
            self._sends.put(None)
        for sock in self.sockets.values():
            sock.close()


def run_in_memory(schedules: dict[int, Schedule]) -> tuple[dict[int, object], dict[int, ScheduleCount]]:
    """Carry out every position's schedule in this one process, over an in-memory hypercube
    that counts as `HypercubeLinks` does (frame headers included): what each schedule
    returned, and what it cost, by position. The scale simulation runs 1024 ranks so.

    >>> from ddl_magic.runtime.planes.binomial_tree import gather
    >>> results, counts = run_in_memory({p: gather(p, 3, bytes([p])) for p in range(3)})
    >>> results[0], counts[0].messages_received, counts[0].rounds
    ([b'\\x00', b'\\x01', b'\\x02'], 2, 1)
    """
    queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
    counts = {position: ScheduleCount() for position in schedules}
    results: dict[int, object] = {}
    waiting: dict[int, tuple[Operation | None, bool]] = {}  # position -> (operation, sent yet)
    for position, schedule in schedules.items():
        waiting[position] = (_advance(schedule, None, position, results), False)
    while any(operation is not None for operation, _ in waiting.values()):
        progressed = False
        for position, (operation, sent) in list(waiting.items()):
            if operation is None:
                continue
            count, schedule = counts[position], schedules[position]
            if type(operation) is not Receive and not sent:
                to = operation.to if type(operation) is Send else operation.partner
                payload = bytes(operation.payload)
                queues[position, to].append((payload, count.rounds))
                count.messages_sent += 1
                count.bytes_sent += len(payload) + _HEADER.size
                sent, progressed = True, True
                if type(operation) is Send:
                    waiting[position] = (_advance(schedule, None, position, results), False)
                    continue
            source = operation.source if type(operation) is Receive else operation.partner
            inbox = queues[source, position]
            if not inbox:
                waiting[position] = (operation, sent)
                continue
            payload, their_round = inbox.popleft()
            count.messages_received += 1
            count.bytes_received += len(payload) + _HEADER.size
            count.rounds = max(count.rounds, their_round + 1)
            if operation.into is not None:
                if len(payload) != len(operation.into):
                    raise ValueError(f"position {position} expected {len(operation.into)} bytes "
                                     f"from {source}, got {len(payload)}")
                operation.into[:] = payload
                payload = None
            waiting[position] = (_advance(schedule, payload, position, results), False)
            progressed = True
        if not progressed:
            stuck = sorted(p for p, (operation, _) in waiting.items() if operation is not None)
            raise RuntimeError(f"the schedules deadlock: positions {stuck} wait for each other")
    return results, counts


def _advance(schedule: Schedule, received, position: int, results: dict) -> Operation | None:
    try:
        return schedule.send(received)
    except StopIteration as finished:
        results[position] = finished.value
        return None
