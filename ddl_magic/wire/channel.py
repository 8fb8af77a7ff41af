"""The one wire protocol of ddl_magic: length-prefixed frames over TCP, after mutual proof of the secret.

Every connection of a run (rank -> driver control, rank -> rank ring and coordination) opens
with the same handshake, so no byte a stranger sends is ever unpickled::

    server                                   client
      ── hello: 32 random bytes (nonce_s) ──►
      ◄── nonce_c + HMAC(secret, "client" | nonce_s | nonce_c | purpose) + purpose ──
      ── HMAC(secret, "server" | nonce_c | nonce_s | purpose) ──►

Both sides prove they hold the run's secret, and the `purpose` string (``"control"``,
``"ring"``, ``"coord"``) is bound into the proof, so a proof cannot be replayed on another
kind of connection; the server accepts only the purposes it expects. Until the handshake succeeds a frame may be at most
``_HANDSHAKE_FRAME_LIMIT`` bytes; a peer that sends anything else is dropped.

After the handshake, `Channel.send` / `Channel.recv` carry pickled Python objects. Bulk
tensor data between ring neighbours does not use frames at all: both sides know the sizes,
so the ring sends raw bytes with `socket.sendall` and `socket.recv_into` (see
`ddl_magic.runtime.planes.tcp`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
import threading
import time

_LENGTH = struct.Struct("!Q")
ABORTED_EXIT_CODE = 143  # 128 + SIGTERM: what a rank exits with when the driver stops it
_NONCE_BYTES = 32
_HANDSHAKE_FRAME_LIMIT = 256
# How long a peer that connected may take to prove the run's secret (and, for a rank, to
# register) before the connection is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
# How long a rank, or the Spark task that starts it, may take to reach the driver and prove the
# secret: a driver busy starting other ranks under load answers late, not never.
CONNECT_TIMEOUT_S = 30.0
PEER_TIMEOUT_VARIABLE = "DDL_MAGIC_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT_S = 10.0
_KEEPALIVE_PROBES = 3
_PREALLOCATED_FRAME_BYTES = 16 << 20


class AuthenticationError(ConnectionError):
    """The peer could not prove it holds the run's secret (or sent something else entirely)."""


class PeerClosedError(ConnectionError):
    """The peer closed the connection (or its process died)."""


def new_secret() -> bytes:
    """A fresh per-run secret: 32 random bytes, never printed or put on a command line."""
    return os.urandom(32)


def peer_timeout_s() -> float:
    """`DDL_MAGIC_PEER_TIMEOUT`: the longest a silent peer, or a host that cannot be reached,
    goes unnoticed on a connection of the run, in seconds (default 10)."""
    value = os.environ.get(PEER_TIMEOUT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{PEER_TIMEOUT_VARIABLE}={value!r} is not a number of seconds") from None
    if seconds < 2:
        raise ValueError(f"{PEER_TIMEOUT_VARIABLE}={value!r}: give at least 2 seconds, the time "
                         "a few keepalive probes need")
    return seconds


def tune_socket(sock: socket.socket) -> None:
    """Low latency for small messages, and a peer that falls silent noticed within
    `peer_timeout_s()`: whether the connection is idle (keepalive probes from half the
    timeout on, then one a second or so) or has data waiting for an acknowledgement
    (TCP_USER_TIMEOUT), the kernel fails it once the peer has said nothing for that long."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    timeout = peer_timeout_s()
    if hasattr(socket, "TCP_KEEPIDLE"):
        idle = max(1, int(timeout / 2))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL,
                        max(1, int((timeout - idle) / _KEEPALIVE_PROBES)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        # A tenth early: the kernel acts on the first timer tick (a probe, a retransmission)
        # after this deadline, which would otherwise land just past the timeout.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout * 900))


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`, or raise PeerClosedError if the peer goes away first."""
    received = 0
    total = len(view)
    while received < total:
        n = sock.recv_into(view[received:], total - received)
        if n == 0:
            raise PeerClosedError("connection closed by peer")
        received += n


def frame(data: bytes) -> bytes:
    """`data` as one frame: its length (8 bytes, big-endian), then the bytes themselves. Every
    connection of a run, and the rank factory's pipes, carry messages framed so."""
    return _LENGTH.pack(len(data)) + data


class FrameBuffer:
    """Frames out of a stream read in pieces of any size (a pipe, or a socket read as it
    becomes readable): feed it what arrived, get back the frames now complete. `limit`: the
    largest frame accepted (AuthenticationError past it), for a peer not yet authenticated.

    >>> buffer = FrameBuffer()
    >>> whole = frame(b"hello") + frame(b"")
    >>> buffer.feed(whole[:7]), buffer.feed(whole[7:])
    ([], [b'hello', b''])
    """

    def __init__(self, limit: int | None = None):
        self._buffer = bytearray()
        self.limit = limit

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        frames = []
        start = 0
        while len(self._buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer, start)
            if self.limit is not None and length > self.limit:
                raise AuthenticationError(f"frame of {length} bytes refused (limit {self.limit})")
            if len(self._buffer) - start < _LENGTH.size + length:
                break
            frames.append(bytes(self._buffer[start + _LENGTH.size:start + _LENGTH.size + length]))
            start += _LENGTH.size + length
        del self._buffer[:start]
        return frames


def _send_frame(sock: socket.socket, data: bytes) -> None:
    header = _LENGTH.pack(len(data))
    if len(data) < 65536:
        sock.sendall(header + data)  # one segment: small control messages stay one round of latency
    else:
        sock.sendall(header)
        sock.sendall(data)  # no copy of a large payload just to prepend eight bytes


def _recv_frame(sock: socket.socket, limit: int | None = None) -> bytes:
    header = bytearray(_LENGTH.size)
    recv_exactly(sock, memoryview(header))
    (length,) = _LENGTH.unpack(header)
    if limit is not None and length > limit:
        raise AuthenticationError(f"handshake frame of {length} bytes refused (limit {limit})")
    if length <= _PREALLOCATED_FRAME_BYTES:
        body = bytearray(length)
        recv_exactly(sock, memoryview(body))
        return bytes(body)
    # A large frame's memory grows with the bytes that arrive: a header announcing more than
    # will ever come (a bug, or garbage) must not make this process zero gigabytes first.
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(length - len(body), _PREALLOCATED_FRAME_BYTES))
        if not chunk:
            raise PeerClosedError("connection closed by peer")
        body += chunk
    return bytes(body)


def _proof(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + b"|".join(parts), hashlib.sha256).digest()


class ServerHandshake:
    """The server's side of the handshake in two steps, for a server that serves many
    connections from one thread (`driver/control.py`): send `hello()`, then hand the
    client's answer frame to `answer`, which returns the purpose it proved and the proof
    frame to send back, or raises AuthenticationError."""

    def __init__(self, secret: bytes, purposes: set[str]):
        self._secret, self._purposes = secret, purposes
        self._nonce = os.urandom(_NONCE_BYTES)

    def hello(self) -> bytes:
        return frame(self._nonce)

    def answer(self, answer: bytes) -> tuple[str, bytes]:
        nonce_c, proof, purpose = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:64], answer[64:]
        if purpose.decode(errors="replace") not in self._purposes or not hmac.compare_digest(
            proof, _proof(self._secret, b"client", self._nonce, nonce_c, purpose)
        ):
            raise AuthenticationError("peer did not prove the run's secret")
        return purpose.decode(), frame(_proof(self._secret, b"server", nonce_c, self._nonce, purpose))


HANDSHAKE_FRAME_LIMIT = _HANDSHAKE_FRAME_LIMIT


def _handshake_as_server(sock: socket.socket, secret: bytes, purposes: set[str]) -> str:
    handshake = ServerHandshake(secret, purposes)
    sock.sendall(handshake.hello())
    purpose, proof = handshake.answer(_recv_frame(sock, limit=_HANDSHAKE_FRAME_LIMIT))
    sock.sendall(proof)
    return purpose


def _handshake_as_client(sock: socket.socket, secret: bytes, purpose: str) -> str:
    nonce_s = _recv_frame(sock, limit=_HANDSHAKE_FRAME_LIMIT)
    if len(nonce_s) != _NONCE_BYTES:
        raise AuthenticationError("server sent a malformed hello")
    nonce_c = os.urandom(_NONCE_BYTES)
    tag = purpose.encode()
    _send_frame(sock, nonce_c + _proof(secret, b"client", nonce_s, nonce_c, tag) + tag)
    proof = _recv_frame(sock, limit=_HANDSHAKE_FRAME_LIMIT)
    if not hmac.compare_digest(proof, _proof(secret, b"server", nonce_c, nonce_s, tag)):
        raise AuthenticationError("server did not prove the run's secret")
    return purpose


class Channel:
    """An authenticated connection carrying pickled messages; `send` is safe from many threads."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, purposes: set[str],
               timeout: float) -> tuple["Channel", str]:
        """Run the server side of the handshake on an accepted socket (closing it on failure).

        Returns the channel and the purpose the client proved, one of `purposes`.
        """
        return cls._authenticate(sock, timeout, lambda: _handshake_as_server(sock, secret, purposes))

    @classmethod
    def connect(
        cls, address: tuple[str, int], secret: bytes, purpose: str, timeout: float
    ) -> "Channel":
        """Connect to `address` and run the client side of the handshake.

        Retries refused connections until `timeout` (the peer may still be starting).
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except (ConnectionRefusedError, socket.timeout):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)  # the listener is still starting: retry, bounded by the deadline
        channel, _ = cls._authenticate(
            sock, deadline - time.monotonic(), lambda: _handshake_as_client(sock, secret, purpose)
        )
        return channel

    @classmethod
    def _authenticate(cls, sock: socket.socket, timeout: float, handshake) -> tuple["Channel", str]:
        tune_socket(sock)
        sock.settimeout(max(0.1, timeout))
        try:
            purpose = handshake()
        except (OSError, AuthenticationError):
            sock.close()
            raise
        sock.settimeout(None)
        return cls(sock), purpose

    def send(self, message: object) -> None:
        self.send_pickled(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_pickled(self, data: bytes) -> None:
        """Send a message pickled once for many channels (the same Start to every rank)."""
        with self._send_lock:
            _send_frame(self.sock, data)

    def recv(self) -> object:
        return pickle.loads(_recv_frame(self.sock))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
