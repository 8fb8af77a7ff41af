"""An elastic run, watched: a lost rank resets the world instead of ending the run.

The rank's side of a reset is `torch/elastic/` (its design note says what this side owes
it); the decisions are `elastic_plan.py`'s. `Elastic` is the failure policy of the run's
watcher (`watcher.FailurePolicy`) for runs started with `min_np`/`max_np`, and only for
those: a run without them fails fast (`failure_policies.py`). The driver's one watch loop
(`watch_loop.py`) carries out what it decides.

Slots. The run view and the run's record have one row per *slot*: the run's `np` slots, each
held by one process at a time. The process in a slot is addressed by the slot's number (its
events, its control channel, its log), while its rank changes from world to world: a
replacement takes the slot of a rank that was lost and joins the next world as one of its
last ranks. `RunResult.resets` says, for each reset, which ranks left and joined and which
slot holds each rank of the new world.

The phases of a reset, a branch per phase (`Phase`) in `Elastic.decide`, each wait bounded:

    RUNNING ── a member lost, or one asks ──► GATHERING  (every member asks or is lost; hung
                                                          after 2 peer timeouts + 1 s: killed)
    GATHERING ── all in ──► WAITING when below min_np (at most DDL_MAGIC_ELASTIC_TIMEOUT,
                                                       then the run fails)
                       └──► STARTING  replacements forked from the rank factory, until each
                                      registered (REPLACEMENT_START_S at most)
    STARTING ── all registered ──► RUNNING  every member sent its place in the new world

Replacements that join later. A local replacement is a fork, ready in a moment, so the world
waits for it. A Spark replacement is a task that waits for a free slot, which may not come
until a lost host returns: its launcher says `replacements_join_later`, and the world forms
at once without it (WAITING while that is below min_np). Once it registers, the driver sends
the world's ranks a host-update notice (`HostsUpdated`); at their next `commit()` they raise
`HostsUpdatedInterrupt` and ask for the next world, which it joins, nothing rolled back.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import Counter

from .attribution import describe_exit
from .elastic_plan import (ElasticBounds, ResetRound, WorldChoice,
                           blacklisted_hosts, choose_next_world, over_reset_limit, too_few_ranks)
from .events import (FailureKind, ProcessExited, RankFailed, RankFinished, RankStarted,
                     ResetAsked, WorldReset)
from .launcher import Launcher
from .records import RankStatus
from .run_status import RunStatus
from .watch_loop import KEEP_WATCHING, Decision, Failed, Finished
from .watcher import RunWatcher
from ..wire.channel import peer_timeout_s
from ..wire.elastic_settings import REPLACEMENT_START_S
from ..wire.messages import HostsUpdated, NextWorld, RunCannotGoOn

# The timeline's row for resets, written by the driver (a lane the ranks never record, so
# not in `timeline/lanes.py`'s table: its row comes after theirs).
RESET_LANE = "elastic reset"


def ask_timeout_s() -> float:
    """How long a reset waits for every live rank to ask for the next world: a survivor
    waiting on a peer that stopped (not died) hears of it after the peer timeout, so twice
    that, and a second for its message."""
    return 2 * peer_timeout_s() + 1.0


class ElasticRunError(RuntimeError):
    """An elastic run could not go on: too few ranks after the wait, or too many resets."""


class Phase(enum.Enum):
    """Where the run is in its resets (the module doc draws the transitions)."""

    RUNNING = "running"
    GATHERING = "gathering"  # every member of the world that ended asks or is lost
    WAITING = "waiting"  # fewer than min_np ranks: waiting, bounded, for more
    STARTING = "starting"  # replacements started, not all registered yet


class Elastic:
    """The failure policy of an elastic run: a lost rank starts a reset (the module doc)."""

    def __init__(self, watcher: RunWatcher, launcher: Launcher, bounds: ElasticBounds):
        self.watcher = watcher
        self.record = watcher.record
        self._launcher = launcher
        self._bounds = bounds
        self._phase = Phase.RUNNING
        self._generation = 0
        self._world: list[int] = list(range(self.record.np))  # slots, in rank order
        self._round: ResetRound | None = None
        self._choice: WorldChoice | None = None
        self._phase_since = 0.0
        self._starting: set[int] = set()  # replacements not registered yet
        # Registered replacements waiting for the next world (launchers whose replacements
        # join later), in the order they came.
        self._join_later = launcher.replacements_join_later
        self._ready: list[int] = []
        self._exit_pending: set[int] = set()  # slots whose lost process's exit is still queued
        self._vanished: set[int] = set()  # lost by a closed connection, exit status not known yet
        # Those whose world re-formed before their exit status came: slot -> (the reset,
        # where in its `left`), to tell the record better when it comes.
        self._reset_before_exit: dict[int, tuple[int, int]] = {}
        self._host_failures: Counter = Counter()
        self._failures_taken = 0
        self.record.resets = []

    def take(self, event: object) -> bool:
        if isinstance(event, ResetAsked):
            self._asked(event)
            return True
        if isinstance(event, RankStarted) and self.record.ranks[event.rank].ended:
            self._restart_record(event.rank)
            self._starting.discard(event.rank)  # registered: it waits for its place
            if self._join_later:
                self._ready.append(event.rank)
                if self._phase is Phase.RUNNING:
                    self._announce_joiners()
        if isinstance(event, RankFinished) and event.rank not in self._world:
            self.record.ranks[event.rank].apply(event)  # retired: its part is over
            return True
        if isinstance(event, RankFinished) and self._round is not None:
            # It returned before it saw the world end: it left the ring, and will not ask.
            self._round.lose(event.rank, "it had returned before the reset")
        if isinstance(event, ProcessExited):
            if event.rank in self._reset_before_exit:
                # the lost process's exit, come after its world re-formed (before anything of
                # its replacement: that one's registration forgets it)
                self._tell_reset_better(*self._reset_before_exit.pop(event.rank),
                                        event.out_of_memory or describe_exit(event.returncode))
            elif ((event.rank in self._starting or event.rank in self._ready)
                    and event.rank not in self._exit_pending):
                # the replacement died before it was part of a world
                self._starting.discard(event.rank)
                if event.rank in self._ready:
                    self._ready.remove(event.rank)
                self._host_failures[self._slot_host(event.rank)] += 1
            elif self._round is not None and event.rank in self._vanished:
                # a lost process's exit status says more than its closed connection
                self._round.tell_better(event.rank, event.out_of_memory
                                        or describe_exit(event.returncode))
            self._exit_pending.discard(event.rank)
            self._vanished.discard(event.rank)
        return False

    def decide(self, now: float) -> Decision:
        try:
            self._take_failures()
            self._advance(now)
        except ElasticRunError as error:
            return Failed(error)
        if self._phase is not Phase.RUNNING or not all(
                slot in self.watcher.results for slot in self._world):
            return KEEP_WATCHING
        for slot in [*self._ready, *self._starting]:  # their tasks end with the run's
            record = self.record.ranks[slot]
            record.status, record.reason = RankStatus.STOPPED, "the run ended before it joined"
        return Finished([self.watcher.results[slot] for slot in self._world])

    # ---- the phases ------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        if self._phase is Phase.GATHERING:
            for slot in self._round.hung(now):
                self._launcher.kill(slot)
                self._round.lose(slot, f"hung: it did not reach the reset within "
                                       f"{self._round.ask_timeout_s:g} s")
            if self._round.complete:
                self._choose(now)
        if self._phase is Phase.WAITING:
            self._choose(now)
        if self._phase is Phase.STARTING:
            if self._join_later:
                self._form_world()  # the replacements started join at a later reset
            else:
                if self._starting and now - self._phase_since > REPLACEMENT_START_S:
                    for slot in self._starting:
                        self._launcher.kill(slot)
                    self._starting.clear()
                if not self._starting:
                    self._form_world()

    def _choose(self, now: float) -> None:
        """The round is in: fail at the reset limit, wait below min_np, or start replacements."""
        if (why := over_reset_limit(len(self.record.resets), self._bounds)) is not None:
            self._fail(why)
        survivors = self._round.survivors
        if not survivors:
            self._fail(f"every rank of world {self._generation} was lost at once "
                       f"({'; '.join(f'rank {rank}: {why}' for rank, why in self._round.left())})"
                       ": the commits lived in their memory. Start the run again")
        free = [slot for slot in range(self.record.np) if slot not in survivors
                and slot not in self._starting and slot not in self._ready]
        choice = choose_next_world(survivors, self._ready, free,
                                   {s: self._slot_host(s) for s in free}, self._host_failures,
                                   self._bounds, self._join_later)
        if self._join_later or not choice.short_by:
            self._start_replacements(choice.start)
        if choice.short_by:
            if self._phase is not Phase.WAITING:
                self._phase, self._phase_since = Phase.WAITING, now
                self._say(f"{len(choice.members)} rank(s) can go on, min_np is "
                          f"{self._bounds.min_np}: waiting up to {self._bounds.wait_s:g} s")
            elif now - self._phase_since >= self._bounds.wait_s:
                self._fail(too_few_ranks(len(choice.members), self._bounds, self._bounds.wait_s,
                                         blacklisted_hosts(self._host_failures, self._bounds)))
            return
        self._choice = choice
        self._phase, self._phase_since = Phase.STARTING, now

    def _start_replacements(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            self._starting.add(slot)
            self.watcher.server.expect_again(slot)
            # True: the lost process's exit is queued, and comes before anything of the new one
            if self._launcher.replace(slot) and self.record.ranks[slot].exit_code is None:
                self._exit_pending.add(slot)

    def _form_world(self) -> None:
        """Send every member its place in the next world; replacements that did not come are
        left out (the run fails if that leaves fewer than min_np)."""
        round_, choice = self._round, self._choice
        members = [slot for slot in choice.members if not self.record.ranks[slot].ended
                   and (slot in choice.newcomers or slot not in round_.lost)]
        if len(members) < self._bounds.min_np:
            self._fail(too_few_ranks(len(members), self._bounds, 0.0,
                                     blacklisted_hosts(self._host_failures, self._bounds)))
        generation, formed_at, server = self._generation + 1, time.time(), self.watcher.server
        peers = [(rank, *server.registration(slot)) for rank, slot in enumerate(members)]
        for rank, slot in enumerate(members):
            if slot in choice.newcomers:
                server.start_joined(slot, peers, rank, generation)
            else:
                server.send(slot, NextWorld(generation, rank, peers, formed_at))
        for slot in choice.retired:
            server.send(slot, NextWorld(generation, None, peers, formed_at))
        left = round_.left()
        reset = WorldReset(generation, tuple(rank for rank, _ in left),
                           tuple(reason for _, reason in left),
                           tuple(rank for rank, slot in enumerate(members)
                                 if slot in choice.newcomers),
                           len(members), round_.asked.get(members[0], 0), tuple(members),
                           time.time())
        self.record.resets.append(reset)
        for position, (rank, _) in enumerate(left):
            if round_.members[rank] in self._vanished:
                self._reset_before_exit[round_.members[rank]] = (len(self.record.resets) - 1,
                                                                 position)
        self._say(reset.describe())
        self.watcher.display.handle(reset)
        # the reset, from its first sign to the new world, on each member's row
        self.watcher.mark_span(RESET_LANE, reset.describe(), round_.started_at * 1e6, members)
        self._generation, self._world = generation, members
        self._ready = [slot for slot in self._ready if slot not in members]
        self._phase, self._round, self._choice = Phase.RUNNING, None, None

    # ---- what starts and feeds a reset ---------------------------------------------------

    def _asked(self, event: ResetAsked) -> None:
        if event.generation != self._generation or event.slot not in self._world:
            return  # a world that was already re-formed
        self._start_round()
        self._round.ask(event.slot, event.commits)

    def _announce_joiners(self) -> None:
        """Replacements are ready (a Spark task got a slot): the ranks re-form the world with
        them at their next commit (the module doc)."""
        self._say(f"replacement rank(s) in slot(s) {', '.join(map(str, self._ready))} ready: "
                  "they join at the ranks' next commit")
        notice = HostsUpdated(time.time(), added=True, removed=False)
        for slot in self._world:
            self.watcher.server.send(slot, notice)

    def _take_failures(self) -> None:
        """A failure of a member is a lost rank (fail-fast would end the run on it)."""
        failures = self.watcher.failures
        for failure in failures[self._failures_taken:]:
            self._lose(failure)
        self._failures_taken = len(failures)

    def _lose(self, failure: RankFailed) -> None:
        slot = failure.rank
        if slot not in self._world or (self._round is not None and slot in self._round.lost):
            return
        self._start_round()
        exit_code = self.record.ranks[slot].exit_code
        if failure.kind is FailureKind.VANISHED and exit_code is None:
            self._vanished.add(slot)
        self._round.lose(slot, _why_lost(failure, exit_code,
                                         self.record.ranks[slot].out_of_memory))
        if failure.kind in (FailureKind.STOPPED, FailureKind.UNREACHABLE):
            # Its process may live on: the survivors' collectives end when it is gone.
            self._launcher.kill(slot)
        self._host_failures[self._slot_host(slot)] += 1

    def _start_round(self) -> None:
        if self._round is None:
            self._round = ResetRound(self._generation, tuple(self._world), time.monotonic(),
                                     ask_timeout_s())
            self._phase = Phase.GATHERING
            for slot in self._world:
                if slot in self.watcher.results:
                    self._round.lose(slot, "it had returned before the reset")

    # ---- helpers ---------------------------------------------------------------------------

    def _tell_reset_better(self, index: int, position: int, reason: str) -> None:
        """A lost rank's exit status came after its reset was made: the run's record of the
        reset says it, and so do the logs."""
        reset = self.record.resets[index]
        reasons = (*reset.reasons[:position], reason, *reset.reasons[position + 1:])
        self.record.resets[index] = dataclasses.replace(reset, reasons=reasons)
        self._say(f"reset {reset.generation}: rank {reset.left[position]} left ({reason}), as "
                  "its exit status, come after the reset, says")

    def _restart_record(self, slot: int) -> None:
        """A replacement holds the slot now: its row starts over, its log goes on."""
        self._reset_before_exit.pop(slot, None)  # whatever exits now is the new one
        record = self.record.ranks[slot]
        record.status, record.reason, record.failure = RankStatus.STARTING, "", None
        record.ended_at, record.exit_code = None, None
        self.watcher.results.pop(slot, None)
        self.watcher.log(slot, f"---- ddl_magic: a replacement rank starts in this slot "
                               f"(world {self._generation + 1}) ----")

    def _slot_host(self, slot: int) -> str:
        return self.record.ranks[slot].host

    def _say(self, line: str) -> None:
        for slot in range(self.record.np):
            self.watcher.log(slot, f"---- ddl_magic elastic: {line} ----")

    def _fail(self, why: str) -> None:
        """The run cannot go on: every waiting rank hears why, and the run fails with it."""
        for slot in self._world:
            self.watcher.server.send(slot, RunCannotGoOn(why))
        self.record.status = RunStatus.FAILED
        self.record.error = why
        raise ElasticRunError(why)


def _why_lost(failure: RankFailed, exit_code: int | None, out_of_memory: str) -> str:
    """The reason a reset shows for a lost rank: its exit status (or the OOM killer's doing)
    where its connection closed first, the exception's last line where it raised."""
    if failure.kind is FailureKind.VANISHED and exit_code is not None:
        return out_of_memory or describe_exit(exit_code)
    last_line = next((line for line in reversed(failure.traceback.splitlines()) if line.strip()),
                     "")
    if failure.kind is FailureKind.RAISED and last_line:
        return last_line.strip()
    return failure.reason
