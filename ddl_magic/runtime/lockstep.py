"""Negotiation in lockstep over the hypercube: one rank's side of each cycle, so that in a
training loop's steady state rank 0 handles ⌈log2 N⌉ messages per cycle, not 2(N - 1).

Horovod's first design had every rank send rank 0 its requests each cycle and rank 0 answer
every rank: 2(N - 1) messages through one process per cycle, which Horovod measured as its
bottleneck at scale and replaced with a response cache (PRs #902, #1305). This is that
design, over this runtime's own links.

The steady state. Every rank keeps the same `ResponseCache` (`response_cache.py`): the
requests rank 0's `Coordinator` has answered, by cache id. A cycle, on every rank at once:

1. Each rank sets a bit for every request it has pending that the cache knows, and the
   flag COORDINATE if it has a request the cache cannot settle (below).
2. Recursive doubling (`planes/recursive_doubling.py`) ANDs the bits and ORs the flags
   across all ranks: ⌈log2 N⌉ rounds (two more when N is not a power of two), one vector of
   ⌈cached/64⌉ words sent and received per round, whatever N is.
3. The requests whose bit every rank set run now, in cache-id order and fused alike on
   every rank (`negotiation.fuse`). Nothing else is sent: that is the whole cycle.

The uncached path, only when some rank set COORDINATE:

4. Every rank sends its other pending requests (cache ids where it has them) up the
   binomial tree (`planes/binomial_tree.py`) to rank 0; rank 0's Coordinator decides as it
   always has (readiness, mismatched requests, joins, stall reports, timeouts, new cache
   ids), and its `Decision` comes back down the tree: ⌈log2 N⌉ rounds each way, rank 0
   receiving and sending ⌈log2 N⌉ messages, though the bytes it receives grow with N.

What sets COORDINATE, and so how often step 4 runs in a training loop: a request the cache
does not hold (every name on the first step, a new name, a changed shape or dtype, every
allgather, whose shapes vary, a join, an unnamed collective such as `hvd.barrier()`, whose
name is never seen again), a cached request that has waited on its rank half
the stall time for the others (rank 0 then reports the stall and times it out, as
before), and rank 0 holding names that some ranks submitted and others not yet. A loop that
allreduces the same named tensors step after step takes step 4 on its first step only; a
name that comes with several shapes in turn (the `ddl` backend's names, counted modulo a
window, under DDP's buckets) once per shape, since the cache holds each request it has seen.
The price: ranks that submit one name with two shapes the cache both holds wait half the
stall time before rank 0 names the mismatch, where a shape new to the cache goes to it at once.

When a rank begins a cycle: once `cycle_time` has passed since it submitted something new
(at once if a thread waits for it or it was fused by its caller), when a request of its
waits half the stall time, when rank 0's Coordinator has a deadline (a stall report, a
timeout), and whenever a partner's message arrives: that partner began the cycle, and
every rank takes part in every cycle. Each link carries the messages of every cycle in the
same order on both ends, so no cycle needs a number.

This module is pure: no threads, no sockets, the clock passed in. Its cycles are schedules
(`planes/hypercube.py`) that `op_queue_tcp.py` runs over sockets and `benchmarks/scale.py`
runs for 1024 simulated ranks in one process.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field

from ..wire.messages import Announcement, Decision
from .negotiation import Coordinator, Cycle, Request, Response, fuse
from .planes.binomial_tree import broadcast, gather
from .planes.hypercube import Schedule
from .planes.recursive_doubling import recursive_doubling
from .response_cache import ControlVector, Flag, ResponseCache, VectorReducible

_UNCACHEABLE = ("join", "allgather")  # a join's answer names who joined last; shapes vary


@dataclass
class CycleOutcome:
    """What every rank agreed on in one cycle."""

    cycle: Cycle  # what to run now, in order
    coordinated: bool  # took the uncached path, through rank 0
    timed_out: str | None = None  # a collective some ranks never submitted timed out: why
    warnings: list[str] = field(default_factory=list)  # stall reports (rank 0's)


@dataclass
class _Pending:
    request: Request
    since: float
    announced: bool = False  # sent to rank 0: its Coordinator settles it from now on


class LockstepNegotiator:
    """One rank's side of the lockstep cycles: what it has pending, its cache, when it wants
    a cycle, and (at position 0) the Coordinator.

    `members` are the ring's world ranks in ring order; this rank is at `position`.
    """

    def __init__(self, members: tuple[int, ...], position: int, run_ranks: tuple[int, ...],
                 fusion_threshold: int, cycle_time_s: float, stall_time_s: float,
                 timeout_s: float = math.inf):
        self.members = members
        self.position = position
        self.size = len(members)
        self.rank = members[position]
        self.fusion_threshold = fusion_threshold
        self.cycle_time_s = cycle_time_s
        # A cached request that waited this long goes to rank 0, which reports the stall (at
        # the stall time, counted from its submission) and times it out.
        self.announce_after_s = min(stall_time_s, timeout_s) / 2
        self.cache = ResponseCache()
        self._pending: dict[str, _Pending] = {}
        self._new_since: float | None = None  # the oldest submission no cycle has seen yet
        self._urgent = False
        self.coordinator = (Coordinator(run_ranks, fusion_threshold, cycle_time_s, stall_time_s,
                                        timeout_s) if position == 0 else None)

    # ---- between cycles ---------------------------------------------------------------------

    def add(self, requests: list[Request], now: float, urgent: bool = False) -> None:
        """This rank submitted `requests`. `urgent`: someone waits (or its caller fused
        them): no need to wait `cycle_time` for more to fuse with."""
        for request in requests:
            self._pending[request.name] = _Pending(request, now)
        if requests and self._new_since is None:
            self._new_since = now
        self._urgent |= urgent

    def next_cycle_at(self) -> float | None:
        """When this rank wants a cycle (None: not until a partner begins one)."""
        deadlines = []
        if self._new_since is not None:
            deadlines.append(self._new_since + (0.0 if self._urgent else self.cycle_time_s))
        unannounced = [pending.since for pending in self._pending.values() if not pending.announced]
        if unannounced:
            deadlines.append(min(unannounced) + self.announce_after_s)
        if self.coordinator is not None and self.coordinator.has_outstanding:
            deadline = self.coordinator.next_deadline()
            if deadline is not None:
                deadlines.append(deadline)
        return min(deadlines) if deadlines else None

    @property
    def pending(self) -> list[str]:
        return list(self._pending)

    # ---- one cycle ----------------------------------------------------------------------------

    def cycle(self, now: float) -> Schedule:
        """This rank's side of one cycle, as a schedule returning the `CycleOutcome`."""
        self._new_since, self._urgent = None, False
        agreed = VectorReducible(self._vector(now), self.cache.words)
        yield from recursive_doubling(self.position, self.size, agreed)
        vector = agreed.vector
        cached = [self.cache.requests[cache_id] for cache_id in _bits(vector.hits)]
        for request in cached:
            del self._pending[request.name]
        outcome = CycleOutcome(
            Cycle(fuse([(Response(request.kind, (request.name,)), request) for request in cached],
                       self.fusion_threshold)),
            coordinated=bool(vector.flags & Flag.COORDINATE))
        if outcome.coordinated:
            decision = yield from self._coordinate(now, outcome)
            self.cache.update(decision.cycle.cache_updates)
            outcome.cycle.responses += decision.cycle.responses
            outcome.cycle.cache_updates = decision.cycle.cache_updates
            outcome.timed_out = decision.timed_out
            for response in decision.cycle.responses:
                for name in response.names:
                    self._pending.pop(name, None)
        return outcome

    def _vector(self, now: float) -> ControlVector:
        hits, flags = 0, Flag(0)
        for pending in self._pending.values():
            if pending.announced:
                continue
            cache_id = (None if pending.request.kind in _UNCACHEABLE
                        else self.cache.hit(pending.request))
            if cache_id is None or now - pending.since >= self.announce_after_s:
                flags |= Flag.COORDINATE
            else:
                hits |= 1 << cache_id
        if self.coordinator is not None and self.coordinator.has_outstanding:
            flags |= Flag.COORDINATE
        return ControlVector(hits, flags)

    def _coordinate(self, now: float, outcome: CycleOutcome) -> Schedule:
        """Step 4: every rank's remaining requests up the tree, rank 0's decision down."""
        mine = [pending for pending in self._pending.values() if not pending.announced]
        for pending in mine:
            pending.announced = True
        announcement = Announcement(self.rank, [self.cache.encode(p.request) for p in mine],
                                    [now - p.since for p in mine])
        gathered = yield from gather(self.position, self.size, _dumps(announcement))
        decided = None
        if self.coordinator is not None:
            decision = self._decide([pickle.loads(blob) for blob in gathered], now, outcome)
            decided = _dumps(decision)
        return pickle.loads((yield from broadcast(self.position, self.size, decided)))

    def _decide(self, announcements: list[Announcement], now: float,
                outcome: CycleOutcome) -> Decision:
        """Rank 0: feed every rank's announcement to the Coordinator and take its answer."""
        coordinator = self.coordinator
        for announcement in announcements:
            for item, waited_s in zip(announcement.requests, announcement.waited_s):
                coordinator.submit(announcement.rank, [item], now, since=now - waited_s)
        outcome.warnings = coordinator.stall_warnings(now)
        expired = coordinator.expired(now)
        if expired:
            return Decision(Cycle([]), timed_out=next(iter(expired.values())))
        return Decision(coordinator.take_cycle(now, flush=True) or Cycle([]))


def _bits(hits: int) -> list[int]:
    """The positions of the set bits, lowest first."""
    positions = []
    while hits:
        lowest = hits & -hits
        positions.append(lowest.bit_length() - 1)
        hits ^= lowest
    return positions


def _dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
