"""What the driver asks of a launcher: the one contract between a run (or pool) and what
starts its ranks.

A run never knows whether its ranks are local processes (`launch/local.py`) or Spark tasks
(`launch/spark.py`): `Job`, `Pool` and an elastic run's policy call these, and only these.
A launcher reports on the run's event queue (`driver/events.py`) what it sees of the
processes it started: their output (where it forwards it), their state, their exit.

    launcher.check(np)                            # before anything is created: refuse at once
    launcher.start(np, address, secret, events)   # the ranks connect to the control server
    launcher.replace(slot) / launcher.kill(slot)  # an elastic run's lost rank, or a hung one
    launcher.stop(finished)                       # every path out of a run comes here, once
"""

from __future__ import annotations

import queue
from typing import Protocol, runtime_checkable


@runtime_checkable
class Launcher(Protocol):
    """Starts the ranks of one run (or pool) and stops them all on request."""

    where: str  # where the ranks run, in words for messages: "local processes"
    elastic_where: str  # the same for an elastic run's ranks, which may live differently
    bind_host: str  # where the control server listens for the ranks
    advertised_host: str  # the address the ranks connect to
    # The launcher reads each rank's output and reports its exit after all of it, so a
    # rank's last words come before its end.
    forwards_output: bool
    # An elastic run's replacement may wait for room (a Spark slot): the world forms without
    # it, and it joins at the ranks' next commit.
    replacements_join_later: bool
    # Each rank can run in a memory cgroup of its own (`--memory-per-rank`): local ranks,
    # not a Spark task's, which has its executor's memory.
    caps_memory: bool

    def describe_lost(self, host: str, ranks: list[int]) -> str:
        """Why `ranks` of `host` vanished together, where the launcher can tell."""

    def check(self, np: int) -> None:
        """Refuse, before anything starts, a run of `np` ranks that cannot start."""

    def check_elastic(self, np: int, max_np: int) -> None:
        """Refuse an elastic run this launcher cannot keep going."""

    def check_gpus(self, np: int) -> None:
        """Refuse a GPU run whose ranks would find no GPU of their own."""

    def start(self, np: int, control_address: tuple[str, int], secret: bytes,
              events: queue.Queue, elastic: bool = False) -> None:
        """Start `np` ranks, which connect to `control_address` and prove `secret`; report
        what is seen of them on `events`. `elastic`: each must be replaceable on its own."""

    def replace(self, slot: int) -> bool:
        """Start a new rank in the slot of a lost one. True: the lost process's exit is
        still to be reported, before anything of the new one."""

    def kill(self, slot: int) -> None:
        """End the rank in `slot` now (stopped, unreachable or hung)."""

    def stop(self, finished: bool = False) -> None:
        """Stop every rank this launcher started; what is left after a grace is killed.
        `finished`: every rank reported its result and is ending on its own: it may."""

    def renewed(self) -> Launcher:
        """A launcher like this one for a fresh start (a pool's restart), after `stop`."""
