"""Which failure caused the others: a pure function of the failures the driver heard, what
it knows of each rank, and when it stopped the run. Tested without processes, as
`runtime/negotiation.py` is; the run's watcher (`watcher.py`) applies the verdict, once
`failures_settled` says the failures of that moment, and the failed ranks' last words, are in.

The rules, in order:

1. A lost connection (VANISHED, UNREACHABLE) of a rank whose process reported an exit status
   is that death (DIED: a dead process's connection drops first, its exit status says more).
2. A rank that exited with the driver's abort code, or whose connection ended after the
   driver stopped the run (and that no peer had reported lost before), was stopped by the
   driver: not a failure.
3. The rest are ordered by kind (`events.ROOT_CAUSE_ORDER`: ranks that died, then ranks that
   vanished, became unreachable or were stopped, then ranks that raised, then ranks that
   only lost a peer), and within a kind by when they happened: the first is the cause.
4. When the cause is a rank that vanished, the ranks of its host that vanished too were lost
   with it (also those that vanished after the stop with no exit status: whatever would
   report it went with them); when it is a host that stopped answering, every rank there is
   lost. The verdict names the host.
5. Where rule 2 would leave no failure at all (every rank that failed ended after the stop),
   the first of them is the cause after all: a failed run names a rank.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Callable

from .events import ROOT_CAUSE_ORDER, FailureKind, RankFailed, describe_ranks
from ..wire.channel import ABORTED_EXIT_CODE


# After a first failure, how long to wait for the other ranks' reports before choosing
# which failure to show: a rank that died and the neighbour that noticed it arrive together.
FAILURE_SETTLE_S = 0.3
# Where the launcher forwards the ranks' output (local ranks), a failed rank's exit is
# reported after everything it wrote: wait that long at most for its last words.
LAST_WORDS_TIMEOUT_S = 3.0
# Where ranks only lost a peer, how long to wait for the failure that caused it (`await_cause`):
# a lost rank's own failure may wait for its exit status up to `LAST_WORDS_TIMEOUT_S` after its
# connection dropped, which is about when its peers lost it; a host cut off is judged silent
# about when its peers' ring connections time out.
CAUSE_TIMEOUT_S = LAST_WORDS_TIMEOUT_S + 1.0


@dataclass(frozen=True)
class RankFacts:
    """What attribution reads of one rank."""

    host: str
    exit_code: int | None  # as its process ended, where known
    done: bool  # it reported its result
    out_of_memory: str = ""  # why, where the OOM killer killed it (the launcher's word)


@dataclass
class Attribution:
    """How the run failed: the `failures` to show, the cause first; the ranks the driver
    stopped (no failure of theirs); and every failed rank's reason (applied after `stopped`)."""

    failures: list[RankFailed]
    stopped: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)

    @property
    def cause(self) -> RankFailed:
        return self.failures[0]


def attribute(failures: list[RankFailed], ranks: list[RankFacts], aborted_at_ns: int | None,
              describe_lost: Callable[[str, list[int]], str],
              peer_timeout_s: float) -> Attribution:
    """The verdict on `failures` (in the order they came), given every rank's state and when
    the driver stopped the run (None: it had not)."""

    def ended_after_abort(failure: RankFailed) -> bool:
        return (aborted_at_ns is not None and failure.at_ns is not None
                and failure.at_ns > aborted_at_ns)

    verdict = Attribution(failures=[])
    vanished_later, stopped_failures = [], []
    lost_early = {f.lost_rank for f in failures  # lost, as a peer saw it before the stop
                  if f.kind is FailureKind.LOST_PEER and not ended_after_abort(f)}
    for failure in failures:
        rank = ranks[failure.rank]
        if not failure.host and rank.host:  # Spark's reports name the task, not the host
            failure = dataclasses.replace(failure, host=rank.host)
        if failure.kind in (FailureKind.VANISHED, FailureKind.UNREACHABLE):
            # (a timeout is never our doing: a rank we stop closes its connection)
            if rank.exit_code is not None and rank.exit_code != ABORTED_EXIT_CODE:
                failure = dataclasses.replace(failure, kind=FailureKind.DIED,
                                              reason=rank.out_of_memory or describe_exit(rank.exit_code),
                                              exit_code=rank.exit_code)
            elif rank.exit_code == ABORTED_EXIT_CODE or (
                    failure.kind is FailureKind.VANISHED and ended_after_abort(failure)
                    and failure.rank not in lost_early):
                verdict.stopped.append(failure.rank)
                if rank.exit_code is None:  # ... unless nothing is left to report its exit
                    vanished_later.append(failure)
                stopped_failures.append(failure)
                continue
        verdict.failures.append(failure)
    if not verdict.failures and stopped_failures:  # rule 5
        first = stopped_failures[0]
        verdict.failures.append(first)
        verdict.stopped.remove(first.rank)
        if first in vanished_later:
            vanished_later.remove(first)
    verdict.failures.sort(key=lambda f: (ROOT_CAUSE_ORDER[f.kind], f.at_ns or 0))
    _name_a_lost_host(verdict, vanished_later, ranks, describe_lost, peer_timeout_s)
    verdict.failed.update((f.rank, f.reason) for f in verdict.failures)
    return verdict


def failures_settled(failures: list[RankFailed], ranks: list[RankFacts], since_first_s: float,
                     exits_follow_output: bool, await_cause: bool = False) -> bool:
    """Have the failures of this moment all come in, `since_first_s` seconds after the first,
    and the failed ranks' last words? (None are coming from a host that stopped answering, or
    from a stopped process.) `exits_follow_output`: the launcher reports a rank's exit after
    everything it wrote. `await_cause`: while every failure is only a lost peer, wait (at
    most `CAUSE_TIMEOUT_S`) for the failure that caused them. A pool's ranks outlive a
    failed cell, so no exit of theirs marks the moment settled; and the ring's own timeout
    can end a collective just before the driver judges the peer's host silent.

    Example:
        >>> died = RankFailed(1, "host-a", FailureKind.VANISHED, "", "connection lost", at_ns=0)
        >>> alive, dead = RankFacts("host-a", None, False), RankFacts("host-a", -9, False)
        >>> failures_settled([died], [alive, alive], 0.5, exits_follow_output=True)
        False
        >>> failures_settled([died], [alive, dead], 0.5, exits_follow_output=True)
        True
    """
    if since_first_s < FAILURE_SETTLE_S:
        return False
    if await_cause and since_first_s < CAUSE_TIMEOUT_S and all(
            f.kind is FailureKind.LOST_PEER for f in failures):
        return False
    return (not exits_follow_output or since_first_s >= LAST_WORDS_TIMEOUT_S
            or all(ranks[f.rank].exit_code is not None for f in failures
                   if f.kind not in (FailureKind.UNREACHABLE, FailureKind.STOPPED)))


def _name_a_lost_host(verdict: Attribution, vanished_later: list[RankFailed],
                      ranks: list[RankFacts], describe_lost: Callable[[str, list[int]], str],
                      peer_timeout_s: float) -> None:
    """Rule 4: when the cause lost a whole host, every failure of a rank there says so."""
    first = verdict.failures[0]
    if not first.host or first.kind not in (FailureKind.VANISHED, FailureKind.UNREACHABLE):
        return
    if first.kind is FailureKind.VANISHED:
        lost = [f for f in [*verdict.failures, *vanished_later]
                if f.kind is FailureKind.VANISHED and f.host == first.host]
        on_host = sorted({f.rank for f in lost})
        reason = describe_lost(first.host, on_host)
    else:
        lost = [f for f in verdict.failures
                if f.host == first.host and f.kind is FailureKind.UNREACHABLE]
        on_host = [index for index, rank in enumerate(ranks)
                   if rank.host == first.host and not rank.done]
        reason = (f"its host {first.host} stopped answering (no reply within "
                  f"{peer_timeout_s:g} s), with {describe_ranks(on_host)}: the network to "
                  "that host is down, or the host is")
    verdict.failed.update((rank, reason) for rank in on_host)
    named = [dataclasses.replace(f, reason=reason) for f in lost]
    verdict.failures = named + [f for f in verdict.failures if f not in lost]


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL', for messages."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
