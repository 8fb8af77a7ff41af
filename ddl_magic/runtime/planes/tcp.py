"""TCP connections between ranks: one socket to the right ring neighbour, one from the left,
and the coordination links to rank 0.

The ring's order is the world's `ring_order()`: ranks host by host. Where hierarchical
allreduce runs (several hosts, the same number of ranks on each, shared memory within
them), every rank also joins a *cross ring* of the ranks with its local_rank, one per host.

The ring needs full duplex: while a rank receives a chunk from its left neighbour it is
sending another chunk to its right one. Receiving happens on the caller's thread; sending
large buffers happens on a dedicated sender thread, so both directions of the wire stay busy
(both `sendall` and `recv_into` release the GIL). Small sends go inline: they fit in the
kernel's socket buffers, so they cannot block against the neighbour's own small send.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

from ...wire.channel import (HANDSHAKE_TIMEOUT_S, AuthenticationError, Channel, PeerClosedError,
                        recv_exactly)
from ..errors import PeerLostError
from ..world import World

# Below this size a send is done on the calling thread: the socket buffers (>= 144 KiB on
# Linux loopback: 16 KiB send + 128 KiB receive) absorb it even if the peer is sending too.
INLINE_SEND_BYTES = 32 * 1024


class PendingSend:
    """A send running on the sender thread; `wait()` returns when the bytes are on the wire."""

    __slots__ = ("_done", "_error")

    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


_ALREADY_SENT = PendingSend()
_ALREADY_SENT._done.set()


class RingTransport:
    """One rank's place in a ring: `send_to_right`, `recv_from_left`, and (on the main ring)
    the coordination links to rank 0.

    `members` are the ring's ranks in ring order; the ring algorithms work with this rank's
    `position` among them and the ring's `size`.
    """

    def __init__(self, world: World, members: tuple[int, ...], right: socket.socket | None,
                 left: socket.socket | None, coordination: dict[int, Channel], op_timeout: float):
        self.world = world
        self.members = members
        self.position = members.index(world.rank)
        self.size = len(members)
        self._right = right
        self._left = left
        self.coordination = coordination  # rank 0: {rank: channel}; others: {0: channel}
        self.op_timeout = op_timeout
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        if right is not None:
            right.settimeout(op_timeout)
            left.settimeout(op_timeout)
            self._sender = threading.Thread(target=self._send_loop, name="ddl-ring-sender", daemon=True)
            self._sender.start()

    @property
    def right_rank(self) -> int:
        return self.members[(self.position + 1) % self.size]

    @property
    def left_rank(self) -> int:
        return self.members[(self.position - 1) % self.size]

    def send_to_right(self, data: memoryview) -> PendingSend:
        """Start sending `data` to the right neighbour; the caller must `wait()` before reusing it."""
        if len(data) <= INLINE_SEND_BYTES:
            self._sendall(data)
            return _ALREADY_SENT
        pending = PendingSend()
        self._sends.put((data, pending))
        return pending

    def recv_from_left(self, into: memoryview) -> None:
        """Fill `into` with the next bytes from the left neighbour."""
        try:
            recv_exactly(self._left, into)
        except (OSError, PeerClosedError) as exc:
            raise self._lost(self.left_rank, exc) from exc

    def _sendall(self, data: memoryview) -> None:
        try:
            self._right.sendall(data)
        except OSError as exc:
            raise self._lost(self.right_rank, exc) from exc

    def _send_loop(self) -> None:
        while True:
            item = self._sends.get()
            if item is None:
                return
            data, pending = item
            try:
                self._sendall(data)
            except BaseException as exc:  # handed to the waiting ring step
                pending._error = exc
            pending._done.set()

    def _lost(self, rank: int, cause: BaseException) -> PeerLostError:
        what = "timed out after %.0f s" % self.op_timeout if isinstance(cause, socket.timeout) else str(cause)
        return PeerLostError(self.world.run_ranks[rank], self.world.peers[rank].host, what)

    def abort(self) -> None:
        """End every send and receive in progress now, from any thread (a pool's cell was
        stopped): shutting the sockets down wakes whoever is blocked on them; `close` follows."""
        sockets = [self._right, self._left, *(c.sock for c in self.coordination.values())]
        for sock in sockets:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed

    def close(self) -> None:
        if self._sender is not None:
            self._sends.put(None)
        for sock in (self._right, self._left):
            if sock is not None:
                sock.close()
        for channel in self.coordination.values():
            channel.close()


def connect_ring(world: World, listener: socket.socket, secret: bytes, timeout: float,
                 op_timeout: float, cross: bool = False) -> tuple[RingTransport, RingTransport | None]:
    """Open this rank's ring and coordination connections (and its cross ring if `cross`),
    authenticating every one.

    Each rank connects to its right neighbour in each ring (and, except rank 0, to rank 0)
    and accepts the connection from its left neighbours (and, on rank 0, from every other
    rank). A connection that fails the handshake is dropped and does not count; the run
    goes on.
    """
    ring = world.ring_order()
    if world.size == 1:
        return RingTransport(world, ring, None, None, {}, op_timeout), None
    deadline = time.monotonic() + timeout
    rings = {"ring": ring, "cross": world.cross_ring_order()} if cross else {"ring": ring}
    neighbours = {purpose: _neighbours(world.rank, members) for purpose, members in rings.items()}
    expected = {(purpose, left) for purpose, (left, _) in neighbours.items()}
    if world.rank == 0:
        expected |= {("coord", r) for r in range(1, world.size)}
    accepted: dict[tuple[str, int], Channel] = {}
    acceptor = threading.Thread(
        target=_accept_expected, args=(listener, secret, expected, accepted, deadline), daemon=True
    )
    acceptor.start()

    def connect(rank: int, purpose: str) -> Channel:
        try:
            channel = Channel.connect(world.peers[rank].address, secret, purpose,
                                      max(0.1, deadline - time.monotonic()))
        except (OSError, AuthenticationError) as exc:
            raise PeerLostError(world.run_ranks[rank], world.peers[rank].host,
                                f"could not connect: {exc}") from exc
        channel.send(world.rank)  # tells the acceptor who we are
        return channel

    rights = {purpose: connect(right, purpose) for purpose, (_, right) in neighbours.items()}
    coordination = {} if world.rank == 0 else {0: connect(0, "coord")}
    acceptor.join(max(0.0, deadline - time.monotonic()))
    missing = expected - accepted.keys()
    if missing:
        kind, rank = sorted(missing)[0]
        raise PeerLostError(world.run_ranks[rank], world.peers[rank].host,
                            f"did not open its {kind} connection within {timeout:.0f} s")
    if world.rank == 0:
        coordination = {rank: accepted[("coord", rank)] for rank in range(1, world.size)}
    transports = {
        purpose: RingTransport(world, rings[purpose], rights[purpose].sock,
                               accepted[(purpose, left)].sock,
                               coordination if purpose == "ring" else {}, op_timeout)
        for purpose, (left, _) in neighbours.items()
    }
    return transports["ring"], transports.get("cross")


def _neighbours(rank: int, members: tuple[int, ...]) -> tuple[int, int]:
    """(left, right) of `rank` in a ring of `members`."""
    position = members.index(rank)
    return members[(position - 1) % len(members)], members[(position + 1) % len(members)]


def _accept_expected(listener: socket.socket, secret: bytes, expected: set, accepted: dict,
                     deadline: float) -> None:
    """Accept until every expected (purpose, rank) connection has proved the secret.

    Each handshake runs on its own thread, so a stranger that connects and says nothing
    cannot hold up the neighbours queued behind it.
    """
    lock = threading.Lock()
    complete = threading.Event()

    def authenticate(sock: socket.socket) -> None:
        try:
            channel, purpose = Channel.accept(sock, secret, {"ring", "cross", "coord"},
                                              min(HANDSHAKE_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
        except (OSError, AuthenticationError, PeerClosedError):
            return  # refused: it does not count, and the run goes on
        try:
            channel.sock.settimeout(max(0.1, deadline - time.monotonic()))
            rank = channel.recv()
            channel.sock.settimeout(None)
            if not isinstance(rank, int):
                raise ValueError(f"expected a rank, got {type(rank).__name__}")
        except Exception:  # gone, silent, or its first message is no rank: refused the same way
            channel.close()
            return
        with lock:
            if (purpose, rank) in expected and (purpose, rank) not in accepted:
                accepted[(purpose, rank)] = channel
                if expected <= accepted.keys():
                    complete.set()
                return
        channel.close()

    listener.settimeout(0.05)  # bounds each wait so the loop sees `complete` and the deadline
    while not complete.is_set() and time.monotonic() < deadline:
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            continue
        threading.Thread(target=authenticate, args=(sock,), daemon=True).start()
    complete.wait(max(0.0, deadline - time.monotonic()))
