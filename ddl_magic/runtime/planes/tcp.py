"""A rank's place in a TCP ring: one socket to the right ring neighbour, one from the left,
its hypercube links (`hypercube.py`: the partners one bit of position away, for small
allreduces and the negotiation's cycles) and, on the run's ring while it forms, the
coordination links to rank 0, all connected and authenticated by `rendezvous.connect_ring`.

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
from dataclasses import dataclass

from ...wire.channel import Channel, PeerClosedError, peer_timeout_s, recv_exactly
from ..errors import PeerLostError
from ..world import World
from .hypercube import HypercubeLinks

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


@dataclass(frozen=True)
class RendezvousCount:
    """The connections this rank opened and accepted to form its ring (its cross ring's
    included), each costing both ends the handshake's 3 frames and the rank's number."""

    connections_opened: int = 0
    connections_accepted: int = 0

    FRAMES_PER_CONNECTION = 4

    def summary(self) -> dict:
        return {"connections_opened": self.connections_opened,
                "connections_accepted": self.connections_accepted,
                "frames": self.FRAMES_PER_CONNECTION * (self.connections_opened
                                                        + self.connections_accepted)}


class RingTransport:
    """One rank's place in a ring: `send_to_right`, `recv_from_left`, its `hypercube` links,
    and (on the main ring) the coordination links to rank 0.

    `members` are the ring's ranks in ring order; the ring algorithms work with this rank's
    `position` among them and the ring's `size`.
    """

    def __init__(self, world: World, members: tuple[int, ...], right: socket.socket | None,
                 left: socket.socket | None, coordination: dict[int, Channel], op_timeout: float,
                 hypercube: HypercubeLinks | None = None):
        self.world = world
        self.members = members
        self.position = members.index(world.rank)
        self.size = len(members)
        self._right = right
        self._left = left
        self.coordination = coordination  # rank 0: {rank: channel}; others: {0: channel}
        self.op_timeout = op_timeout
        self.hypercube = hypercube or HypercubeLinks(world, members, {}, op_timeout)
        self.rendezvous = RendezvousCount()  # `rendezvous.connect_ring` fills it in
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
        if isinstance(cause, socket.timeout) and cause.errno is None:  # the socket's own deadline
            what = "timed out after %.0f s" % self.op_timeout
        elif isinstance(cause, socket.timeout):  # ETIMEDOUT: TCP_USER_TIMEOUT or keepalive gave up
            what = f"its host stopped answering (no reply within {peer_timeout_s():g} s)"
        else:
            what = str(cause)
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
        self.hypercube.abort()

    def close(self) -> None:
        if self._sender is not None:
            self._sends.put(None)
        for sock in (self._right, self._left):
            if sock is not None:
                sock.close()
        for channel in self.coordination.values():
            channel.close()
        self.hypercube.close()
