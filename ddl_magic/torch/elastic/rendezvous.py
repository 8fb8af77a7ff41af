"""Re-forming the world after a reset: what a rank asks the driver, and what it gets back.

Every rank that resets runs `reform_world`, top to bottom:

1. leave the old ring (`hvd.shutdown()`): its collectives end, its connections close, and
   the peers still waiting in one see this rank go at once;
2. ask the run's `ElasticRendezvous` for the next world, with a `ResetRequest` (which world
   ended, this rank's number in it, why);
3. join the `WorldPlan` it answers: the rank's bootstrap takes the plan's rank and peer
   table, and `hvd.init()` connects the new ring (the ring listener, the secret and the
   driver link stay: they belong to the process, not to one world).

The rendezvous is the driver's side of the reset and is installed by whatever started the
rank (`install`). A rank that nobody installed one for uses `SameWorld`: the same ranks at
the same addresses, which is all that a reset needs when every rank is still alive (a
`HorovodInternalError` that user code raised, a collective that timed out) and all that a
world of one ever needs.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Protocol

from ...runtime import context
from ...runtime.world import Peer
from .. import lifecycle
from .exceptions import RankRetired


class ResetReason(enum.Enum):
    """Why a rank asks for a new world."""

    FAILURE = "failure"  # a collective failed (HorovodInternalError): the state was rolled back
    HOSTS_UPDATED = "hosts_updated"  # the driver announced a host change: nothing rolled back


@dataclass(frozen=True)
class ResetRequest:
    """What a resetting rank tells the driver. The driver knows the rest from the rank's
    registration: its host, its ring listener's address, how long it has been in the run."""

    generation: int  # the world that ended: 0 is the world the run was launched with
    rank: int  # this rank's number in that world
    reason: ResetReason
    error: str  # what ended it, for the run view: "PeerLostError: lost rank 2 on ..."
    commits: int  # how many commits this rank has made: the run view's "resumed from commit n"


@dataclass(frozen=True)
class WorldPlan:
    """The next world, as the driver formed it, seen from one rank.

    `peers[r]` is rank r's host and ring listener; `rank` is this rank's number, or None
    when the driver left this rank out (then `reform_world` raises `RankRetired`).
    `formed_at`: when the driver formed it (its clock): host-update notices stamped earlier
    are taken into account by this world (`State.on_reset`).
    """

    generation: int  # later than every request's that led to it
    rank: int | None
    peers: tuple[Peer, ...]
    formed_at: float = 0.0


class ElasticRendezvous(Protocol):
    """The driver's side of a reset, as one call a rank makes (from its main thread).

    `next_world` blocks until the driver has formed the next world and answers this rank's
    place in it. Every rank of the ended world that is still alive asks, each once per
    reset; the driver answers them all with one peer table. An implementation must return
    within a bounded time: the driver's wait for `min_np` ranks plus a margin; it raises
    `ElasticRunFailed` with the driver's reason when the run cannot go on.
    """

    def next_world(self, request: ResetRequest) -> WorldPlan:
        ...


class SameWorld:
    """A rendezvous without a driver: the next world is the one that ended, renumbered as
    it was (every rank must still be alive to connect it again)."""

    def next_world(self, request: ResetRequest) -> WorldPlan:
        bootstrap = context.bootstrap
        peers = () if bootstrap is None else tuple(bootstrap.peers)
        return WorldPlan(request.generation + 1, request.rank, peers)


_rendezvous: ElasticRendezvous = SameWorld()
_generation = 0


def install(rendezvous: ElasticRendezvous, generation: int = 0) -> None:
    """Make `rendezvous` this process's way to its next world; `generation` is the world the
    rank starts in (a replacement joins a run whose world has already been re-formed).

    The worker of a rank launched elastic calls this before the user's code runs.
    """
    global _rendezvous, _generation
    _rendezvous, _generation = rendezvous, generation


def current_generation() -> int:
    """The world this rank is in: 0 until its first reset."""
    return _generation


def reform_world(reason: ResetReason, error: str, commits: int) -> WorldPlan:
    """Leave the current ring, ask the rendezvous for the next world, and connect it."""
    global _generation
    bootstrap = context.bootstrap
    request = ResetRequest(_generation, 0 if bootstrap is None else bootstrap.rank, reason,
                           error, commits)
    lifecycle.shutdown()
    plan = _rendezvous.next_world(request)
    if plan.rank is None:
        raise RankRetired(f"the driver left rank {request.rank} out of world {plan.generation} "
                          f"({len(plan.peers)} ranks): its part in the run is over")
    _join(plan)
    _generation = plan.generation
    return plan


def _join(plan: WorldPlan) -> None:
    """Connect this process to `plan`'s ring as its rank `plan.rank`."""
    bootstrap = context.bootstrap
    if bootstrap is None:
        if plan.peers:
            raise ValueError(f"world {plan.generation} has {len(plan.peers)} ranks, but this "
                             "process was not launched as a rank: it has no ring listener")
    else:
        # What init() forms the ring from: the rank and peer table change with the world,
        # the listener, secret and driver link are the process's own.
        context.bootstrap = dataclasses.replace(bootstrap, rank=plan.rank,
                                                peers=list(plan.peers))
    lifecycle.init()
