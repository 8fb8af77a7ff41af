"""What an elastic run's driver decides at a reset: pure functions and one gathering record,
the clock passed in, tested without processes (`elastic.py` applies the decisions).

A reset, as the driver sees it, top to bottom:

1. **Gather** (`ResetRound`). It starts when a rank of the current world is lost (its
   process ended, its connection closed, it raised) or asks for the next world (its
   collective raised `HorovodInternalError`). Every member of the world that ended then
   either asks or is lost. One that has done neither after the ask timeout (twice the peer
   timeout: a survivor waiting on a stopped peer hears of it after one) is hung: the driver
   kills it and counts it lost. A reset that loses every member fails the run: the commits
   were in their memory.
2. **Limit.** A run that was already reset `reset_limit` times fails instead.
3. **Choose** (`choose_next_world`). The survivors keep their order, so the new rank 0 is
   the oldest survivor (the lowest rank of the oldest generation: every world lists its
   survivors first, its replacements last), whose state is the latest commit. Replacements
   fill the slots of lost ranks, up to `max_np`, except on a host whose ranks failed
   `blacklist_after` times. Survivors above `max_np` are retired. Where a replacement must
   wait for room (Spark), the world forms without it; once it is ready the driver announces
   a host update, and the ranks re-form the world with it at their next commit.
4. **Wait** when fewer than `min_np` ranks can form the world: at most `wait_s`, then the
   run fails with a message saying how many it had and needed (`too_few_ranks`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ElasticBounds:
    """An elastic run's limits, fixed at its start."""

    min_np: int
    max_np: int
    reset_limit: int  # resets a run may have; the next failure ends it
    wait_s: float  # for min_np ranks, before the run fails
    blacklist_after: int  # failures of ranks on one host before no rank is started there


# A host whose ranks failed this many times gets no replacement rank: on a machine where ranks
# keep dying (out of memory, a bad GPU) a fresh one would die too. Horovod blacklists at the
# first failure; one lost rank on spot capacity is common enough to forgive twice.


@dataclass
class ResetRound:
    """One reset's gathering: which members of the world `generation` asked for the next
    world (with their commit counts) and which were lost (with why)."""

    generation: int
    members: tuple[int, ...]  # the slots of the world that ended, in its rank order
    started_at: float
    ask_timeout_s: float
    asked: dict[int, int] = field(default_factory=dict)  # slot -> its state's commits
    lost: dict[int, str] = field(default_factory=dict)  # slot -> why, for the run view

    def ask(self, slot: int, commits: int) -> None:
        if slot in self.members and slot not in self.lost:
            self.asked[slot] = commits

    def lose(self, slot: int, reason: str) -> None:
        if slot in self.members and slot not in self.lost:
            self.asked.pop(slot, None)
            self.lost[slot] = reason

    def tell_better(self, slot: int, reason: str) -> None:
        """A lost member's reason, better told: its exit status, which came after its closed
        connection had lost it."""
        if slot in self.lost:
            self.lost[slot] = reason

    @property
    def complete(self) -> bool:
        """Every member asked or was lost."""
        return len(self.asked) + len(self.lost) == len(self.members)

    def hung(self, now: float) -> list[int]:
        """The members that have neither asked nor been lost within the ask timeout.

        >>> round = ResetRound(0, (0, 1, 2), started_at=0.0, ask_timeout_s=10.0)
        >>> round.lose(2, "killed by SIGKILL"); round.ask(0, commits=5)
        >>> round.hung(now=5.0), round.hung(now=11.0)
        ([], [1])
        """
        if now - self.started_at < self.ask_timeout_s:
            return []
        return [slot for slot in self.members if slot not in self.asked and slot not in self.lost]

    @property
    def survivors(self) -> list[int]:
        """The members that asked, in the old world's rank order (oldest first)."""
        return [slot for slot in self.members if slot in self.asked]

    def left(self) -> list[tuple[int, str]]:
        """(rank in the world that ended, why) of every lost member."""
        return [(rank, self.lost[slot]) for rank, slot in enumerate(self.members)
                if slot in self.lost]


@dataclass(frozen=True)
class WorldChoice:
    """The next world: `members` in its rank order (survivors, then `newcomers`, the
    processes that join it from outside), the slots to `start` a new rank in, the survivors
    `retired` from the run, and how many ranks it lacks to reach `min_np` (0: it can form)."""

    members: tuple[int, ...]
    newcomers: tuple[int, ...]
    start: tuple[int, ...]
    retired: tuple[int, ...]
    short_by: int


def choose_next_world(survivors: list[int], ready: list[int], free_slots: list[int],
                      slot_hosts: dict[int, str], host_failures: Counter, bounds: ElasticBounds,
                      join_later: bool = False) -> WorldChoice:
    """The next world from the survivors (oldest first), the replacements that are `ready`
    (started earlier, registered, waiting for a world) and the slots a new replacement may
    start in (`slot_hosts`: the host each slot's rank ran on).

    Where replacements `join_later` (a Spark task waits for a free slot, which may take until
    a host comes back), the world forms without the ones it starts: they join at a later
    reset, once ready. Otherwise (a local fork takes a moment) they are members at once.

    >>> bounds = ElasticBounds(min_np=2, max_np=4, reset_limit=10, wait_s=60, blacklist_after=3)
    >>> hosts = {slot: "a" for slot in range(4)}
    >>> choose_next_world([0, 1, 3], [], [2], hosts, Counter(a=1), bounds)
    WorldChoice(members=(0, 1, 3, 2), newcomers=(2,), start=(2,), retired=(), short_by=0)
    >>> choose_next_world([0, 1], [], [2, 3], hosts, Counter(), bounds, join_later=True)
    WorldChoice(members=(0, 1), newcomers=(), start=(2, 3), retired=(), short_by=0)
    >>> choose_next_world([0, 1], [2], [3], hosts, Counter(), bounds, join_later=True).members
    (0, 1, 2)
    >>> choose_next_world([1], [], [0, 2, 3], hosts, Counter(a=3), bounds).short_by
    1
    """
    kept, retired = survivors[:bounds.max_np], survivors[bounds.max_np:]
    joining = ready[:bounds.max_np - len(kept)]
    room = bounds.max_np - len(kept) - len(joining)
    start = [slot for slot in free_slots
             if host_failures[slot_hosts.get(slot, "")] < bounds.blacklist_after][:room]
    newcomers = (*joining, *([] if join_later else start))
    members = (*kept, *newcomers)
    return WorldChoice(members, newcomers, tuple(start), tuple(retired),
                       max(0, bounds.min_np - len(members)))


def over_reset_limit(resets_done: int, bounds: ElasticBounds) -> str | None:
    """Why the run may not be reset again, or None while it may."""
    if resets_done < bounds.reset_limit:
        return None
    return (f"the run was reset {resets_done} times, its limit (DDL_MAGIC_ELASTIC_RESET_LIMIT="
            f"{bounds.reset_limit}), and lost a rank again: it makes no progress. Fix what "
            "fails (see the ranks' failures above), or raise the limit if the losses are "
            "expected (many preemptions)")


def too_few_ranks(have: int, bounds: ElasticBounds, waited_s: float,
                  blacklisted: list[str]) -> str:
    """The failure of a run that stayed below `min_np` for its whole wait."""
    why = (f"; no rank is started on {', '.join(blacklisted)} any more: its ranks failed "
           f"{bounds.blacklist_after} times" if blacklisted else "")
    return (f"the elastic run has {have} rank{'s' if have != 1 else ''} left and needs at least "
            f"{bounds.min_np} (min_np); none came back within {waited_s:g} s "
            f"(DDL_MAGIC_ELASTIC_TIMEOUT){why}. Start the run again, or lower min_np")


def blacklisted_hosts(host_failures: Counter, bounds: ElasticBounds) -> list[str]:
    return sorted(host for host, failures in host_failures.items()
                  if failures >= bounds.blacklist_after)
