"""Negotiation through rank 0 over TCP: the op queue of ranks that do not share one host.

One background thread per rank forwards new requests to rank 0, receives the agreed cycle
of responses (see `negotiation.py`) and runs them with the `CollectiveRunner`, completing
handles as it goes. Rank 0's background thread additionally runs the `Coordinator`.

The thread sleeps in `select` on its sockets and a wake-up socket, so it costs nothing
while idle and reacts immediately when a request arrives.

A collective that some ranks submit and others never do fails after the op timeout
(`DDL_MAGIC_TIMEOUT`): rank 0's coordinator reports the stall, then tells every rank why
(`CollectiveTimedOut`) and fails its own queue. A rank whose oldest collective got no word
from rank 0 for longer than that (rank 0 stuck in native code, unable to coordinate) fails
it by itself.
"""

from __future__ import annotations

import select
import socket
import sys
import time

from ..wire.messages import Abort, Bye, CollectiveTimedOut, CycleToRun, Submit
from ..wire.channel import PeerClosedError
from .collectives import CollectiveRunner
from .errors import CollectiveTimeoutError, HorovodInternalError, PeerLostError
from .negotiation import Coordinator
from .op_queue import Handle, OpQueue
from .planes.tcp import RingTransport


class TcpOpQueue(OpQueue):
    """Negotiates on a background thread, through rank 0's `Coordinator`."""

    def __init__(self, runner: CollectiveRunner, transport: RingTransport, fusion_threshold: int,
                 cycle_time_s: float, stall_time_s: float):
        super().__init__(runner, transport.world)
        self.transport = transport
        self._woken = False
        self._wake_receiver, self._wake_sender = socket.socketpair()
        self._coordinator = (
            Coordinator(self.world.run_ranks, fusion_threshold, cycle_time_s, stall_time_s,
                        transport.op_timeout)
            if self.world.rank == 0 else None
        )
        self._thread.start()

    # ---- the user's side --------------------------------------------------------------

    def wait_for(self, handle: Handle) -> None:
        """Tell rank 0 not to hold `handle` back for fusion, then sleep until it completes."""
        with self._lock:
            self._incoming.append(handle.name)
        self._wake()
        with handle._pending:
            pass

    def close(self) -> None:
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout=self.transport.op_timeout)
        if not self._thread.is_alive():  # what it left pending now has nobody to run it
            self._fail(HorovodInternalError(
                "this rank has shut down (hvd.shutdown(), or its function returned): a "
                "collective still pending will not run"))
        self._runner.close()
        self._wake_receiver.close()
        self._wake_sender.close()

    def _wake(self) -> None:
        with self._lock:
            if self._woken:
                return  # one byte in the socket is enough to wake the thread
            self._woken = True
        self._wake_sender.send(b"\0")

    def _taken_locked(self) -> None:
        self._woken = False

    # ---- the background thread ----------------------------------------------------------

    def _negotiate(self) -> None:
        if self._coordinator is not None:
            self._coordinate()
        else:
            self._follow()

    def _take_incoming(self):
        self._wake_receiver.recv(4096)
        return super()._take_incoming()

    def _follow(self) -> None:
        """Ranks other than 0: forward requests to rank 0, run the cycles it sends back."""
        channel = self.transport.coordination[0]
        while True:
            readable, _, _ = select.select([self._wake_receiver, channel.sock], [], [],
                                           self._until_coordinator_overdue())
            if not readable:
                raise CollectiveTimeoutError(
                    f"rank {self.world.run_ranks[0]}, which coordinates collectives, has not "
                    f"answered for {self._coordinator_deadline_s:g} s about the collectives "
                    f"this rank waits for ({', '.join(map(repr, self._pending))}): it is alive "
                    "but has not run Python code for that long (a native call holding its GIL)")
            if self._wake_receiver in readable:
                entries, waited, closing = self._take_incoming()
                if entries or waited:
                    self._send_to_rank_0(channel, Submit([self._cache.encode(e.request)
                                                          for e in entries], waited))
                if closing:
                    self._send_to_rank_0(channel, Bye())
                    return
            if channel.sock in readable:
                match self._recv(channel, 0):
                    case Abort(reason):
                        raise HorovodInternalError(reason)
                    case CollectiveTimedOut(reason):
                        raise CollectiveTimeoutError(reason)
                    case CycleToRun(cycle):
                        self._cache.update(cycle.cache_updates)
                        self._execute(cycle)

    @property
    def _coordinator_deadline_s(self) -> float:
        # Later than rank 0's own judgement (the op timeout), which names the absent ranks.
        return self.transport.op_timeout * 1.2 + 2.0

    def _until_coordinator_overdue(self) -> float | None:
        """Seconds until rank 0 is overdue with an answer to this rank's oldest collective."""
        if not self._pending:
            return None
        oldest_ns = min(entry.submitted_ns for entry in self._pending.values())
        waited_s = (time.monotonic_ns() - oldest_ns) / 1e9
        return max(0.0, self._coordinator_deadline_s - waited_s)

    def _send_to_rank_0(self, channel, message) -> None:
        try:
            channel.send(message)
        except OSError as exc:
            # Rank 0 closed the connection, most likely after saying why (its own shutdown,
            # an abort): that message is still ours to read, and a better reason than EPIPE.
            try:
                channel.sock.settimeout(1.0)
                last = channel.recv()
                if isinstance(last, Abort):
                    raise HorovodInternalError(last.reason) from exc
            except (OSError, PeerClosedError, EOFError):
                pass
            raise PeerLostError(self.world.run_ranks[0], self.world.peers[0].host,
                                "connection lost") from exc

    def _coordinate(self) -> None:
        """Rank 0: collect every rank's requests, decide cycles, send them out and run them."""
        followers = dict(self.transport.coordination)  # rank -> channel
        try:
            self._coordinate_followers(followers)
        except BaseException as exc:  # every rank must learn why, or its handles would wait forever
            reason = str(exc) if isinstance(exc, HorovodInternalError) else f"rank 0: {exc}"
            for channel in followers.values():
                try:
                    channel.send(Abort(reason))
                except OSError:
                    pass
            raise

    def _coordinate_followers(self, followers: dict) -> None:
        coordinator = self._coordinator
        by_socket = {channel.sock: rank for rank, channel in followers.items()}
        while True:
            deadline = coordinator.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._wake_receiver, *by_socket], [], [], timeout)
            now = time.monotonic()
            for sock in readable:
                if sock is self._wake_receiver:
                    entries, waited, closing = self._take_incoming()
                    coordinator.submit(0, [e.request for e in entries], now)
                    coordinator.note_waited(waited)
                    if closing:
                        for channel in followers.values():
                            channel.send(Abort("rank 0 has shut down"))
                        return
                    continue
                rank = by_socket[sock]
                match self._recv(followers[rank], rank):
                    case Bye():
                        raise PeerLostError(self.world.run_ranks[rank],
                                            self.world.peers[rank].host, "it has shut down")
                    case Submit(requests, waited):
                        coordinator.submit(rank, requests, now)
                        coordinator.note_waited(waited)
            for warning in coordinator.stall_warnings(now):
                print(f"ddl_magic warning: {warning}", file=sys.stderr, flush=True)
            if expired := coordinator.expired(now):
                reason = next(iter(expired.values()))
                for channel in followers.values():
                    channel.send(CollectiveTimedOut(reason))
                raise CollectiveTimeoutError(reason)
            cycle = coordinator.take_cycle(now)
            if cycle is not None:
                for channel in followers.values():
                    channel.send(CycleToRun(cycle))
                self._execute(cycle)

    def _recv(self, channel, rank: int):
        try:
            return channel.recv()
        except (OSError, PeerClosedError, EOFError) as exc:
            raise PeerLostError(self.world.run_ranks[rank], self.world.peers[rank].host,
                                "connection lost") from exc
