"""Between the user's code and the transports: submitted collectives, their handles, and
running what the ranks agreed on.

The user's thread only appends an `Entry` and gets a `Handle` back (`allreduce_async`).
How the ranks then agree on which collectives run, in which order (see `negotiation.py`),
depends on where they are:

- `op_queue_shm.SharedMemoryOpQueue`: every rank on one host. Each rank decides for itself,
  from every rank's requests exchanged through shared memory, on whichever thread needs it;
- `op_queue_tcp.TcpOpQueue`: anywhere else. A background thread per rank runs lockstep
  cycles with the others over TCP (`lockstep.py`): a bitwise allreduce of the response
  cache decides the steady state, rank 0's Coordinator the rest.

Either way `OpQueue._execute` runs each agreed response with the `CollectiveRunner` and
completes the handles.
"""

from __future__ import annotations

import _thread
import collections
import threading
import time

import torch

from .collectives import CollectiveRunner, Entry
from .counters import NegotiationCounters
from .errors import CollectiveMismatchError, HorovodInternalError
from .negotiation import Cycle, Request, RequestCache, Response
from .timeline import recorder
from .world import World


class Handle:
    """An in-flight collective; `hvd.synchronize(handle)` waits for it and returns its output."""

    __slots__ = ("name", "_queue", "_pending", "_output", "_error", "_on_done")

    def __init__(self, name: str, queue: "OpQueue", on_done=None):
        self.name = name
        self._queue = queue
        # Called with the handle once it completes, on the completing thread (the
        # torch.distributed backend resolves a torch Future there).
        self._on_done = on_done
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
            self._queue.wait_for(self)
        if self._error is not None:
            # Raised afresh here: the background thread's frames would only confuse the user.
            raise self._error.with_traceback(None)
        return self._output

    def _complete(self, output: torch.Tensor | None = None, error: BaseException | None = None):
        """Called once the queue has forgotten the name (`OpQueue._forget`): when `done()`
        turns True, the name is free again."""
        self._output, self._error = output, error
        self._pending.release()
        if self._on_done is not None:
            self._on_done(self)


class OpQueue:
    """Accepts requests from any thread; a subclass negotiates them, `_execute` runs them.

    `_lock` guards what the user's threads and the negotiating thread share: `_incoming`,
    `_failure`, `_closing`. `_pending` (submitted, not yet executed) and the request cache
    belong to whichever thread negotiates, one at a time.
    """

    def __init__(self, runner: CollectiveRunner, world: World):
        self.world = world
        self._runner = runner
        self._lock = threading.Lock()
        self._incoming: collections.deque = collections.deque()  # Entry, or a waited-on name
        self._in_flight: set[str] = set()  # names submitted and not yet completed
        self._pending: dict[str, Entry] = {}
        self._cache = RequestCache()
        self._failure: BaseException | None = None
        self._closing = False
        # Set while a pool runs a cell on some ranks only: every collective is refused, with
        # this error, since the other ranks would never join it (`rank/cells.py`).
        self.refusal: BaseException | None = None
        # What negotiating has cost this rank (`counters.py`), where it takes messages: over TCP.
        self.counters: NegotiationCounters | None = None
        self._thread = threading.Thread(target=self._run, name="ddl-op-queue", daemon=True)

    # ---- the user's side --------------------------------------------------------------

    def submit(self, request: Request, tensor: torch.Tensor | None,
               output: torch.Tensor | None, wait_follows: bool = False,
               on_done=None, fused: bool = False) -> Handle:
        """Queue one collective. `wait_follows` says the caller will wait for it at once (as
        `optimizer.step()` does for the last gradients): then nothing needs to be woken up to
        start it early, which spares a thread switch per step. `fused` says the caller has
        fused its tensors itself (DDP's buckets): waiting for more to fuse with would only
        delay it. `on_done(handle)` is called once it completes, on whichever thread
        completes it."""
        entry = Entry(request, tensor, output, Handle(request.name, self, on_done))
        alone = self.world.size == 1
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self.refusal is not None:
                raise self.refusal.with_traceback(None)
            if request.name in self._in_flight:
                raise ValueError(
                    f"a collective named {request.name!r} is already in flight on this rank: "
                    "give concurrent collectives distinct names, or synchronize the first one "
                    "before submitting the next")
            self._in_flight.add(request.name)
            if not alone:
                self._incoming.append(entry)
                self._queued_locked(fused)
                wake = not wait_follows and self._wake_needed_locked(fused)
        if alone:
            return self._run_alone(entry)
        if wake:
            self._wake()
        return entry.handle

    def _run_alone(self, entry: Entry) -> Handle:
        """A world of one has nothing to agree on: run at once, on the caller's thread."""
        request = entry.request
        if request.kind == "join":
            entry.output = torch.tensor(0)
        first_dims = (request.shape[0] if request.shape else 1,)
        try:
            self._runner.run(Response(request.kind, (request.name,), first_dims=first_dims), [entry])
        finally:
            self._forget((request.name,))  # also when raised to the caller: nothing is left in flight
        entry.handle._complete(output=entry.output)
        return entry.handle

    def wait_for(self, handle: Handle) -> None:
        """Return once `handle` has completed (successfully or not)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop negotiating (after the cycle in progress) and release the transports."""
        raise NotImplementedError

    def abort(self, error: BaseException) -> None:
        """Fail every collective of this queue with `error` now, from any thread, and end the
        waits of the transports under it (a pool's cell was stopped). The queue is then
        unusable: the pool forms a fresh ring, after `close`."""
        self._fail(error)
        self._runner.plane.abort(str(error))
        self._wake()

    @property
    def is_clean(self) -> bool:
        """Can the next cell's collectives run here: nothing failed, nothing in flight?"""
        with self._lock:
            return self._failure is None and not self._in_flight and not self._closing

    # ---- what subclasses build on ------------------------------------------------------------

    def _queued_locked(self, fused: bool) -> None:
        """Called with `_lock` held after an entry was queued (`fused`: see `submit`)."""

    def _wake_needed_locked(self, fused: bool) -> bool:
        """Called with `_lock` held: must `_wake` be called for what was just queued?"""
        return True

    def _taken_locked(self) -> None:
        """Called with `_lock` held when the negotiating thread takes what was queued."""

    def _wake(self) -> None:
        """Make sure the negotiating side will look at what was just queued."""

    def _run(self) -> None:
        try:
            self._negotiate()
        except BaseException as exc:  # every pending handle must learn why, or it would hang
            self._fail(exc if isinstance(exc, HorovodInternalError)
                       else HorovodInternalError(f"ddl_magic background thread failed: {exc!r}"))

    def _negotiate(self) -> None:
        """The background thread's loop."""
        raise NotImplementedError

    def _take_incoming(self) -> tuple[list[Entry], list[str], bool]:
        """What was submitted (and waited on) since the last call, and whether we are closing."""
        with self._lock:
            items = list(self._incoming)
            self._incoming.clear()
            closing = self._closing
            self._taken_locked()
        entries = [item for item in items if isinstance(item, Entry)]
        self._pending.update((entry.request.name, entry) for entry in entries)
        waited = [item for item in items if isinstance(item, str) and item in self._pending]
        return entries, waited, closing

    def _execute(self, cycle: Cycle, first_attached: bool = False) -> None:
        """Run the cycle's responses in order. `first_attached`: every rank attached the first
        one's data to the negotiation round that agreed on it (`op_queue_shm.py`)."""
        for index, response in enumerate(cycle.responses):
            entries = [self._pending.pop(name, None) for name in response.names]
            if None in entries:  # this rank has joined: it takes part with zeros
                entries = [entry or _zeros_entry(request)
                           for entry, request in zip(entries, response.for_joined_ranks)]
            if recorder.enabled:
                recorder.record("negotiate", _label(response), min(e.submitted_ns for e in entries),
                                time.monotonic_ns())
            if response.error is not None:
                error = CollectiveMismatchError(response.error)
                self._forget(response.names)
                for entry in entries:
                    entry.handle._complete(error=error)
                continue
            if response.kind == "join":
                entries[0].output = torch.tensor(response.last_joined_rank)
            try:
                if first_attached and index == 0:
                    self._runner.run_attached(entries)
                else:
                    self._runner.run(response, entries)
            except BaseException:
                # `_fail` completes what is pending: these too, or their callers wait for ever.
                self._pending.update((entry.request.name, entry) for entry in entries)
                raise
            self._forget(response.names)
            for entry in entries:
                entry.handle._complete(output=entry.output)

    def _forget(self, names) -> None:
        """The names are free for new collectives again (their handles complete next)."""
        with self._lock:
            self._in_flight.difference_update(names)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
            leftover = [item for item in self._incoming if isinstance(item, Entry)]
            self._incoming.clear()
        failed = [*self._pending.values(), *leftover]
        self._pending.clear()
        self._forget([entry.request.name for entry in failed])
        for entry in failed:
            entry.handle._complete(error=error)


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
