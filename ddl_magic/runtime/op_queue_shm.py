"""Negotiation without a round trip, for ranks that all share one host: lockstep cycles.

Every rank keeps a replica of rank 0's `Coordinator` (see `negotiation.py`). A *cycle* is one
exchange through shared memory in which every rank publishes what it has submitted since
the previous cycle (a request seen before travels as its cache id). Each rank then feeds
every rank's submissions, in rank order, to its replica and takes the cycle's responses from
it: identical inputs, identical decisions. So the ranks agree on which collectives run, in
which order and fused how, with no message to rank 0 and back, and the thread that runs a
cycle is one that wants it:

1. a user thread that waits on a handle (`synchronize`, `optimizer.step()`) runs cycles
   itself until its handle completes, rather than waking a background thread and sleeping;
2. the background thread runs a cycle when work was submitted, nobody waits for it, and no
   more has been submitted for `cycle_time` (communication then overlaps the user's
   computation, and a burst of submissions fuses into one cycle instead of being cut into
   many by a thread that competes with the submitting one for the GIL) — at once for work
   its caller fused itself (DDP's buckets through the `ddl` backend) — and whenever a
   neighbour has started one: every rank takes part in every cycle. Moving data through
   shared memory is work for a core, so the overlap pays only where each rank has a core
   to spare for it (`has_core_to_spare`); where it has none, the background thread leaves
   the work to the user's own wait, which fuses it with what follows (a training step's
   first gradient bucket and its last), and runs it only when nobody has waited for
   `_MAX_WINDOWS` cycle times;
3. a rank that starts a cycle rings the doorbells of the neighbours that have not and wait
   for one (they have requests outstanding: asleep, in all likelihood), so they join at once;
   a neighbour that waits for nothing is busy computing, and its own thread comes when its
   user next submits and waits. It is rung only after a slice: woken early, its background
   thread would only announce that it has nothing, taking the core from its user, after
   which both ranks would sleep and be woken once more. (SyncBatchNorm's synthetic ResNet at
   np 2 spent 5-6 ms a step that way, between the last rank's arrival at a layer's allreduce
   and its end, against 2.2 ms since: `benchmarks/sync_batch_norm.py`.)
4. the cycle's round carries data: each rank attaches the data of what it has pending when
   that makes one allreduce that fits, and when the cycle runs exactly that first, it runs
   from there, without a round of its own (a training step's allreduce costs one round,
   not two), and the decision itself comes from a memo when every rank announced the same
   cached requests (`Coordinator.agree`).

Which thread may touch what: `_progress` is held by whichever thread runs a cycle, and only
its holder touches the replica, the request cache, `_pending` and the shared-memory group's
rounds. `_lock` (the base class's) guards what submitting threads share with it.

Why every wait ends: inside a cycle a rank waits for neighbours that are alive and joining
(their background thread is woken by the doorbell), bounded by the op timeout; an idle rank
sleeps on its doorbell for at most a slice, then checks that its neighbours still exist and
whether a collective it waits for has waited the op timeout for ranks that never submit it
(`Coordinator.expired`: then its handles fail, after the stall report). A rank that calls
`shutdown()` runs one last cycle saying so, after which every rank's queue refuses further
work and names it, instead of waiting for a partner that will not come.
"""

from __future__ import annotations

import functools
import pickle
import sys
import threading
import time

from .collectives import CollectiveRunner
from .errors import CollectiveTimeoutError, HorovodInternalError
from .negotiation import Coordinator
from .op_queue import Handle, OpQueue
from .planes.shared_memory import MESSAGE_ROOM, SLEEP_SLICE_S, HostGroup

_MAX_WINDOWS = 10


def has_core_to_spare(ranks_on_host: int, cores: int, compute_threads: int) -> bool:
    """Can every rank on the host run its background thread on a core that its computation
    (`compute_threads` torch threads each) leaves idle? Without one, a collective overlapping
    the user's computation takes its core from it, and costs more than running after it: the
    MNIST MLP's step at np 2 on 2 cores took 3.39 ms with its first bucket overlapping
    backward and 3.24 ms without (benchmarks/train_step.py).

    >>> has_core_to_spare(2, 2, 1), has_core_to_spare(2, 4, 1), has_core_to_spare(4, 16, 4)
    (False, True, False)
    """
    return cores >= ranks_on_host * (compute_threads + 1)


class SharedMemoryOpQueue(OpQueue):
    """Negotiates in lockstep cycles through the host's shared memory, on any thread."""

    def __init__(self, runner: CollectiveRunner, group: HostGroup, fusion_threshold: int,
                 cycle_time_s: float, stall_time_s: float, op_timeout: float,
                 overlap: bool = True):
        super().__init__(runner, group.world)
        self._group = group
        self._cycle_time_s = cycle_time_s
        self._overlap = overlap  # runs submitted work early, beside the user's computation
        self._op_timeout = op_timeout
        self._progress = threading.Lock()
        self._replica = Coordinator(self.world.run_ranks, fusion_threshold, cycle_time_s,
                                    stall_time_s, op_timeout)
        # Under _lock: when the oldest and the newest unannounced submissions were queued.
        self._first_unannounced: float | None = None
        self._last_unannounced = 0.0
        self._doorbell_rung = False  # under _lock: the background thread was told about it
        self._fused_queued = False  # under _lock: some unannounced work needs no fusion window
        self._stopped = False
        self._thread.start()

    # ---- the user's side --------------------------------------------------------------

    def wait_for(self, handle: Handle) -> None:
        """Run cycles on this thread until `handle` completes; sleep when there is nothing to run."""
        while handle._pending.locked():
            doorbell = self._group.own.doorbell  # read before deciding to sleep: no lost wake-up
            with self._progress:
                if not handle._pending.locked() or self._failure is not None:
                    break
                if self._cycle_wanted(now_or_never=True):
                    self._cycle()
                    continue
            self._idle(doorbell, SLEEP_SLICE_S)
        if self._work_left():
            self._group.own.ring()  # ours is done: the background thread takes over the rest
        with handle._pending:  # completed by _fail when the queue failed meanwhile
            pass

    def close(self) -> None:
        with self._progress:
            if self._failure is None:
                with self._lock:
                    self._closing = True
                self._cycle()  # tells every neighbour; fails this queue too, with "shut down"
            self._stopped = True
        self._group.own.ring()
        self._thread.join(timeout=self._op_timeout)
        self._runner.close()

    def _queued_locked(self, fused: bool) -> None:
        self._last_unannounced = time.monotonic()
        if self._first_unannounced is None:
            self._first_unannounced = self._last_unannounced
        self._fused_queued |= fused

    def _wake_needed_locked(self, fused: bool) -> bool:
        if self._doorbell_rung and not fused:
            return False  # the background thread already knows there is work
        self._doorbell_rung = True  # (fused work is due now: wake it even if it sleeps till later)
        return True

    def _wake(self) -> None:
        self._group.own.ring()

    def _taken_locked(self) -> None:
        self._first_unannounced = None
        self._fused_queued = False
        self._doorbell_rung = False

    # ---- the background thread ----------------------------------------------------------

    def _negotiate(self) -> None:
        while True:
            doorbell = self._group.own.doorbell
            timeout = SLEEP_SLICE_S
            if self._progress.acquire(blocking=False):
                try:
                    if self._stopped or self._failure is not None:
                        return
                    if self._cycle_wanted(now_or_never=False):
                        self._cycle()
                        continue
                    timeout = self._until_cycle_due()
                    try:
                        self._group.check_neighbours()
                    except HorovodInternalError as exc:
                        self._fail(exc)  # under _progress, like every touch of _pending
                        return
                    self._warn_about_stalls()
                    if self._fail_expired():
                        return
                finally:
                    self._progress.release()
            self._idle(doorbell, timeout)

    # ---- cycles ---------------------------------------------------------------------------

    def _cycle_wanted(self, now_or_never: bool) -> bool:
        """Must this rank run a cycle now? (`now_or_never`: a waiting user does not wait for
        the fusion window.)

        A neighbour that started a cycle is joined at once, unless this rank's user is in the
        middle of a burst of submissions: then joining waits until the burst goes quiet, so
        the burst travels in one cycle and no cycle competes with it for the GIL (the
        neighbour is waiting for exactly this rank's requests anyway).
        """
        with self._lock:
            queued = self._first_unannounced is not None
            closing = self._closing
        if now_or_never and (queued or closing):
            return True
        if queued:
            return self._until_cycle_due() == 0.0
        return closing or self._group.neighbour_started_a_round()

    def _until_cycle_due(self) -> float:
        """Seconds until the background thread should run a cycle for unannounced work: a
        cycle time after the last submission, and at most `_MAX_WINDOWS` cycle times after the
        first (a steady trickle of submissions, with computation between them, must not hold
        everything back) once the submitting thread pauses for a tenth of a cycle time. A
        burst submitted back to back is not cut: a cycle in the middle would take the GIL
        from it, and its ranks would announce different parts of it. Without `_overlap`, only
        the latest: the user's wait comes first."""
        with self._lock:
            first, last, fused = self._first_unannounced, self._last_unannounced, self._fused_queued
        if first is None:
            return SLEEP_SLICE_S
        if fused:
            return 0.0
        latest = first + _MAX_WINDOWS * self._cycle_time_s
        due = min(last + self._cycle_time_s, max(latest, last + self._cycle_time_s / 10)) \
            if self._overlap else latest
        return max(0.0, due - time.monotonic())

    def _cycle(self) -> None:
        """One lockstep cycle: exchange submissions, decide like everyone else, run the result.

        Each rank also attaches the data of everything it has pending, when that makes one
        allreduce that fits (`CollectiveRunner.attachable`), and says which names it carries.
        If the cycle then runs exactly those names first, and every rank attached them, the
        allreduce reduces the attached data without a round of its own.
        """
        try:
            entries, _, closing = self._take_incoming()
            announced = [self._cache.encode(e.request) for e in entries]
            carried = list(self._pending.values())  # older pending entries first, then these
            nbytes = self._runner.attachable(carried)
            offer = None
            if nbytes:
                offer = announced if len(carried) == len(entries) else \
                    [self._cache.encode(e.request) for e in carried]
            mine = pickle.dumps((announced, closing, offer), protocol=pickle.HIGHEST_PROTOCOL)
            attach = None
            if offer is not None and len(mine) <= MESSAGE_ROOM:
                attach = functools.partial(self._runner.attach, carried, nbytes=nbytes)
            elif offer is not None:  # no room after the message: say so, attach nothing
                mine = pickle.dumps((announced, closing, None), protocol=pickle.HIGHEST_PROTOCOL)
            asleep = self._replica.ranks_waiting()  # their threads wait for this round: ring them now
            everyone = [pickle.loads(message)
                        for message in self._group.exchange(mine, attach, asleep)]
            gone = [rank for rank, (_, rank_closing, _) in enumerate(everyone) if rank_closing]
            if gone:
                raise HorovodInternalError(
                    f"rank {gone[0]} has shut down (hvd.shutdown(), or its function returned): "
                    "no more collectives can run in this job")
            cycle = self._replica.agree([requests for requests, _, _ in everyone], time.monotonic())
            if cycle is not None:
                self._cache.update(cycle.cache_updates)
                self._execute(cycle, first_attached=self._all_attached(cycle, everyone))
        except BaseException as exc:  # every pending handle must learn why, on every thread
            self._fail(exc if isinstance(exc, HorovodInternalError)
                       else HorovodInternalError(f"ddl_magic negotiation failed: {exc!r}"))

    def _all_attached(self, cycle, everyone) -> bool:
        """Did every rank attach the data of the cycle's first response, and nothing else?
        (Every rank sees the same messages and decisions, so all answer alike.)"""
        first = cycle.responses[0]
        offer = everyone[0][2]
        if (first.kind != "allreduce" or first.error is not None or first.for_joined_ranks
                or offer is None or len(offer) != len(first.names)):
            return False
        # The same requests encode alike on every rank (the caches update alike), so equal
        # offers carry equal data layouts.
        return (all(theirs == offer for _, _, theirs in everyone[1:])
                and tuple(map(self._replica.name_of, offer)) == first.names)

    def _work_left(self) -> bool:
        with self._lock:
            queued = self._first_unannounced is not None
        return queued or self._group.neighbour_started_a_round()

    def _idle(self, doorbell: int, timeout: float) -> None:
        """Sleep until the doorbell rings or `timeout` passes (never longer than a slice)."""
        if timeout > 0:
            self._group.sleep_on_doorbell(doorbell, timeout)

    def _warn_about_stalls(self) -> None:
        """Report the stalls this rank is the first to wait on (every rank's replica knows
        them all; this way each is reported once, by a rank whose thread is free to)."""
        for warning in self._replica.stall_warnings(time.monotonic(), reporter=self.world.rank):
            print(f"ddl_magic warning: {warning}", file=sys.stderr, flush=True)

    def _fail_expired(self) -> bool:
        """Fail this rank's collectives if one has waited the op timeout for ranks that never
        submitted it (the run then fails, naming them)."""
        expired = self._replica.expired(time.monotonic())
        mine = [reason for name, reason in expired.items() if name in self._pending]
        if not mine:
            return False
        self._fail(CollectiveTimeoutError(mine[0]))
        return True
