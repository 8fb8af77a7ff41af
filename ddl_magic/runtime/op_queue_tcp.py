"""Negotiation over TCP: the op queue of ranks that do not all share one host.

Every rank runs the same cycles in lockstep (`lockstep.py`): a bitwise allreduce of what
each has pending over the hypercube's links (`planes/hypercube.py`), and, only when the
response cache cannot answer, a trip up and down a binomial tree to rank 0's Coordinator.
This module is the thread and the sockets around that pure logic.

Which thread touches what: one background thread per rank runs every cycle and executes
what the cycle agreed on (with the `CollectiveRunner`), so only it touches the negotiator,
`_pending` and the links. The user's threads only queue entries and waits under `_lock`
(the base class's) and wake it through a socketpair.

The thread sleeps in `poll` on the wake-up socket and on its hypercube links, so it costs
nothing while idle: a message on a link means a partner began a cycle, which this rank then
joins; otherwise it begins one when its negotiator says so (`next_cycle_at`).

Why every wait ends: inside a cycle each receive has the op timeout as its deadline, and a
partner that never answers is named (`PeerLostError`). A collective that some ranks submit
and others never do goes to rank 0's Coordinator, which reports the stall and times it out
after `DDL_MAGIC_TIMEOUT` on every rank at once. A rank whose cycle fails tells its partners
why (`HypercubeLinks.flood_abort`), and they tell theirs, so every rank fails with the same
reason. A rank that shuts down tells its partners the same way, and leaves without waiting
for anyone (a partner may be gone already): every rank's queue then refuses further work
and names it.
"""

from __future__ import annotations

import select
import socket
import sys
import time

from .collectives import CollectiveRunner
from .counters import NegotiationCounters
from .errors import CollectiveTimeoutError, HorovodInternalError, PeerLostError
from .lockstep import CycleOutcome, LockstepNegotiator
from .op_queue import Handle, OpQueue
from .planes.hypercube import PeerAborted
from .planes.tcp import RingTransport
from .timeline import recorder


class TcpOpQueue(OpQueue):
    """Negotiates in lockstep cycles over the hypercube, on a background thread."""

    def __init__(self, runner: CollectiveRunner, transport: RingTransport, fusion_threshold: int,
                 cycle_time_s: float, stall_time_s: float):
        super().__init__(runner, transport.world)
        self.transport = transport
        self._links = transport.hypercube
        self._woken = False
        self._fused_queued = False  # under _lock: some work was fused by its caller
        self._aborted = False
        self._wake_receiver, self._wake_sender = socket.socketpair()
        self._negotiator = LockstepNegotiator(transport.members, transport.position,
                                              self.world.run_ranks, fusion_threshold,
                                              cycle_time_s, stall_time_s, transport.op_timeout)
        self.counters = NegotiationCounters(rendezvous=transport.rendezvous.summary())
        # The coordination links served the rendezvous; negotiation runs over the hypercube,
        # so rank 0 gives back its N - 1 sockets.
        for channel in transport.coordination.values():
            channel.close()
        transport.coordination.clear()
        self._thread.start()

    # ---- the user's side --------------------------------------------------------------

    def wait_for(self, handle: Handle) -> None:
        """Say that a thread waits (no reason to hold it back for fusion), then sleep until
        `handle` completes."""
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

    def abort(self, error: BaseException) -> None:
        self._aborted = True  # its partners are aborted too: nothing to tell them
        super().abort(error)

    def _wake(self) -> None:
        with self._lock:
            if self._woken:
                return  # one byte in the socket is enough to wake the thread
            self._woken = True
        self._wake_sender.send(b"\0")

    def _queued_locked(self, fused: bool) -> None:
        self._fused_queued |= fused

    def _taken_locked(self) -> None:
        self._woken = False

    # ---- the background thread ----------------------------------------------------------

    def _take_incoming(self):
        self._wake_receiver.recv(4096)
        with self._lock:
            fused, self._fused_queued = self._fused_queued, False
        entries, waited, closing = super()._take_incoming()
        self._negotiator.add([entry.request for entry in entries], time.monotonic(),
                             urgent=fused or bool(waited))
        return entries, waited, closing

    def _negotiate(self) -> None:
        try:
            self._cycles()
        except PeerAborted as exc:  # pass it on: every rank learns the first reason
            self._links.flood_abort(str(exc))
            raise HorovodInternalError(str(exc)) from None
        except BaseException as exc:
            if not self._aborted:
                self._links.flood_abort(str(exc) if isinstance(exc, HorovodInternalError)
                                        else f"rank {self.world.run_ranks[self.world.rank]}: {exc!r}")
            raise

    def _cycles(self) -> None:
        negotiator, links = self._negotiator, self._links
        # poll, not select: at a thousand ranks, descriptors pass select's limit of 1024
        watched = select.poll()
        for sock in (self._wake_receiver, *links.readable()):
            watched.register(sock, select.POLLIN)
        wake = self._wake_receiver.fileno()
        while True:
            at = negotiator.next_cycle_at()
            timeout_ms = None if at is None else max(0.0, at - time.monotonic()) * 1000
            readable = {fd for fd, _ in watched.poll(timeout_ms)}
            if wake in readable and self._take_incoming()[2]:
                if self.world.size > 1:  # the partners learn it, and tell theirs
                    links.flood_abort(str(PeerLostError(
                        self.world.run_ranks[self.world.rank],
                        self.world.peers[self.world.rank].host, "it has shut down")))
                return
            now = time.monotonic()
            partner_began = bool(readable - {wake})
            at = negotiator.next_cycle_at()
            if not (partner_began or (at is not None and at <= now)):
                continue
            outcome = self._cycle(now)
            for warning in outcome.warnings:
                print(f"ddl_magic warning: {warning}", file=sys.stderr, flush=True)
            if outcome.timed_out is not None:
                raise CollectiveTimeoutError(outcome.timed_out)
            self._execute(outcome.cycle)

    def _cycle(self, now: float) -> CycleOutcome:
        started_ns = time.monotonic_ns()
        outcome = self._links.run(self._negotiator.cycle(now))
        ended_ns = time.monotonic_ns()
        count = self._links.count
        self.counters.record(count, outcome.coordinated, (ended_ns - started_ns) / 1e9)
        if recorder.enabled:
            recorder.record("negotiation_cycle",
                            "coordinated" if outcome.coordinated else "cached", started_ns,
                            ended_ns, {"messages_sent": count.messages_sent,
                                       "messages_received": count.messages_received,
                                       "bytes_sent": count.bytes_sent,
                                       "bytes_received": count.bytes_received,
                                       "rounds": count.rounds,
                                       "responses": len(outcome.cycle.responses)})
        return outcome
