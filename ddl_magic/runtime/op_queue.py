"""The background thread between the user's code and the ring.

The user's thread only appends an `Entry` and gets a `Handle` back (`allreduce_async`).
One background thread per rank forwards new requests to rank 0, receives the agreed cycle
of responses (see `negotiation.py`) and runs them with the `CollectiveRunner`, completing
handles as it goes. Rank 0's background thread additionally runs the `Coordinator`.

The thread sleeps in `select` on its sockets and a wake-up socket, so it costs nothing
while idle and reacts immediately when a request arrives.
"""

from __future__ import annotations

import _thread
import collections
import select
import socket
import sys
import threading
import time

import torch

from ..protocol import PeerClosedError
from .collectives import CollectiveRunner, Entry
from .errors import CollectiveMismatchError, HorovodInternalError, PeerLostError
from .negotiation import Coordinator, Cycle, Request, RequestCache, Response
from .shared_memory import HostGroup
from .timeline import recorder
from .transport import RingTransport


class Handle:
    """An in-flight collective; `hvd.synchronize(handle)` waits for it and returns its output."""

    __slots__ = ("name", "_queue", "_pending", "_output", "_error")

    def __init__(self, name: str, queue: "OpQueue"):
        self.name = name
        self._queue = queue
        # Held until the collective completes: a bare lock is the cheapest thing to wait on,
        # and a burst of a thousand async calls creates a thousand of them.
        self._pending = _thread.allocate_lock()
        self._pending.acquire()
        self._output: torch.Tensor | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return not self._pending.locked()

    def wait(self) -> torch.Tensor:
        if self._pending.locked():
            self._queue.note_waiting(self.name)
            with self._pending:
                pass
        if self._error is not None:
            # Raised afresh here: the background thread's frames would only confuse the user.
            raise self._error.with_traceback(None)
        return self._output

    def _complete(self, output: torch.Tensor | None = None, error: BaseException | None = None):
        self._output, self._error = output, error
        self._pending.release()


class OpQueue:
    """Accepts requests from any thread; negotiates and executes them on a background thread."""

    def __init__(self, transport: RingTransport, host_group: HostGroup | None,
                 fusion_threshold: int, cycle_time_s: float, stall_time_s: float):
        self.transport = transport
        self.world = transport.world
        self._runner = CollectiveRunner(transport, host_group)
        self._lock = threading.Lock()
        self._incoming: collections.deque = collections.deque()  # Entry, or a waited-on name
        self._woken = False
        self._wake_receiver, self._wake_sender = socket.socketpair()
        self._pending: dict[str, Entry] = {}  # submitted, not yet executed (background thread only)
        self._cache = RequestCache()
        self._failure: BaseException | None = None
        self._closing = False
        self._coordinator = (
            Coordinator(self.world.size, fusion_threshold, cycle_time_s, stall_time_s)
            if self.world.rank == 0 else None
        )
        self._thread = threading.Thread(target=self._run, name="ddl-op-queue", daemon=True)
        self._thread.start()

    # ---- the user's side --------------------------------------------------------------

    def submit(self, request: Request, tensor: torch.Tensor | None,
               output: torch.Tensor | None) -> Handle:
        handle = Handle(request.name, self)
        if self.world.size == 1:
            return self._run_alone(Entry(request, tensor, output, handle))
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._incoming.append(Entry(request, tensor, output, handle))
        self._wake()
        return handle

    def _run_alone(self, entry: Entry) -> Handle:
        """A world of one has nothing to agree on: run at once, on the caller's thread."""
        request = entry.request
        if request.kind == "join":
            entry.output = torch.tensor(0)
        first_dims = (request.shape[0] if request.shape else 1,)
        self._runner.run(Response(request.kind, (request.name,), first_dims=first_dims), [entry])
        entry.handle._complete(output=entry.output)
        return entry.handle

    def note_waiting(self, name: str) -> None:
        """The user's thread is about to block on `name`: tell rank 0 not to hold it back."""
        with self._lock:
            self._incoming.append(name)
        self._wake()

    def close(self) -> None:
        """Stop the background thread (after the cycle it is running) and close the sockets."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout=self.transport.op_timeout)
        self._runner.close()
        self._wake_receiver.close()
        self._wake_sender.close()

    def _wake(self) -> None:
        with self._lock:
            if self._woken:
                return  # one byte in the socket is enough to wake the thread
            self._woken = True
        self._wake_sender.send(b"\0")

    # ---- the background thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._coordinator is not None:
                self._coordinate()
            else:
                self._follow()
        except BaseException as exc:  # every pending handle must learn why, or it would hang
            self._fail(exc if isinstance(exc, HorovodInternalError)
                       else HorovodInternalError(f"ddl_magic background thread failed: {exc!r}"))

    def _follow(self) -> None:
        """Ranks other than 0: forward requests to rank 0, run the cycles it sends back."""
        channel = self.transport.coordination[0]
        while True:
            readable, _, _ = select.select([self._wake_receiver, channel.sock], [], [])
            if self._wake_receiver in readable:
                entries, waited, closing = self._take_incoming()
                if entries or waited:
                    channel.send(("submit", [self._cache.encode(e.request) for e in entries], waited))
                if closing:
                    channel.send(("bye",))
                    return
            if channel.sock in readable:
                message = self._recv(channel, 0)
                if message[0] == "abort":
                    raise HorovodInternalError(message[1])
                self._cache.update(message[1].cache_updates)
                self._execute(message[1])

    def _coordinate(self) -> None:
        """Rank 0: collect every rank's requests, decide cycles, send them out and run them."""
        followers = dict(self.transport.coordination)  # rank -> channel
        try:
            self._coordinate_followers(followers)
        except BaseException as exc:  # every rank must learn why, or its handles would wait forever
            reason = str(exc) if isinstance(exc, HorovodInternalError) else f"rank 0: {exc}"
            for channel in followers.values():
                try:
                    channel.send(("abort", reason))
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
                            channel.send(("abort", "rank 0 has shut down"))
                        return
                    continue
                rank = by_socket[sock]
                message = self._recv(followers[rank], rank)
                if message[0] == "bye":
                    raise PeerLostError(rank, self.world.peers[rank].host, "it has shut down")
                _, requests, waited = message
                coordinator.submit(rank, requests, now)
                coordinator.note_waited(waited)
            for warning in coordinator.stall_warnings(now):
                print(f"ddl_magic warning: {warning}", file=sys.stderr, flush=True)
            cycle = coordinator.take_cycle(now)
            if cycle is not None:
                for channel in followers.values():
                    channel.send(("cycle", cycle))
                self._execute(cycle)

    def _take_incoming(self) -> tuple[list[Entry], list[str], bool]:
        self._wake_receiver.recv(4096)
        with self._lock:
            self._woken = False
            items = list(self._incoming)
            self._incoming.clear()
            closing = self._closing
        entries = []
        for entry in (item for item in items if isinstance(item, Entry)):
            name = entry.request.name
            if name in self._pending:  # refused here, so the first one still completes
                entry.handle._complete(error=HorovodInternalError(
                    f"tensor {name!r} was submitted again before its previous collective "
                    "completed: give concurrent collectives distinct names"))
                continue
            self._pending[name] = entry
            entries.append(entry)
        waited = [item for item in items if isinstance(item, str) and item in self._pending]
        return entries, waited, closing

    def _recv(self, channel, rank: int):
        try:
            return channel.recv()
        except (OSError, PeerClosedError, EOFError) as exc:
            raise PeerLostError(rank, self.world.peers[rank].host, "connection lost") from exc

    def _execute(self, cycle: Cycle) -> None:
        for response in cycle.responses:
            entries = [self._pending.pop(name, None) for name in response.names]
            if None in entries:  # this rank has joined: it takes part with zeros
                entries = [entry or _zeros_entry(request)
                           for entry, request in zip(entries, response.for_joined_ranks)]
            if recorder.enabled:
                recorder.record("negotiate", _label(response), min(e.submitted_ns for e in entries),
                                time.monotonic_ns())
            if response.error is not None:
                error = CollectiveMismatchError(response.error)
                for entry in entries:
                    entry.handle._complete(error=error)
                continue
            if response.kind == "join":
                entries[0].output = torch.tensor(response.last_joined_rank)
            self._runner.run(response, entries)
            for entry in entries:
                entry.handle._complete(output=entry.output)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._failure = error
            leftover = [item for item in self._incoming if isinstance(item, Entry)]
            self._incoming.clear()
        for entry in [*self._pending.values(), *leftover]:
            entry.handle._complete(error=error)
        self._pending.clear()


def _zeros_entry(request: Request) -> Entry:
    zeros = torch.zeros(request.shape, dtype=request.dtype)
    return Entry(request, zeros, zeros, _DISCARDED)


class _Discarded:
    """The handle of a joined rank's zero contribution: nobody waits for it."""

    def _complete(self, output=None, error=None) -> None:
        pass


_DISCARDED = _Discarded()


def _label(response: Response) -> str:
    return response.names[0] if len(response.names) == 1 else f"{len(response.names)} tensors"
