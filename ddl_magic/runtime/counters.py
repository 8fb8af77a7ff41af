"""What negotiation costs one rank, cycle by cycle: always on (a few additions per cycle).

Each cycle of the lockstep negotiation (`lockstep.py`) is one schedule over the hypercube;
`HypercubeLinks` counts what it sent and received and the rounds of latency on its critical
path (`hypercube.ScheduleCount`), and the op queue adds that here. `hvd.negotiation_counters()`
returns `summary()`; with the timeline on, each cycle is also an event of the
"negotiation_cycle" lane carrying its counts.

    >>> from ddl_magic.runtime.planes.hypercube import ScheduleCount
    >>> counters = NegotiationCounters()
    >>> counters.record(ScheduleCount(3, 3, 96, 96, 3), coordinated=False, seconds=0.001)
    >>> counters.record(ScheduleCount(4, 5, 120, 900, 9), coordinated=True, seconds=0.004)
    >>> summary = counters.summary()
    >>> summary["cycles"], summary["coordinated_cycles"], summary["max_rounds"]
    (2, 1, 9)
    >>> summary["cached"]["messages_received_per_cycle"], summary["cached"]["rounds_per_cycle"]
    (3.0, 3.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .planes.hypercube import ScheduleCount


@dataclass
class _Totals:
    cycles: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    seconds: float = 0.0

    def add(self, count: ScheduleCount, seconds: float) -> None:
        self.cycles += 1
        self.messages_sent += count.messages_sent
        self.messages_received += count.messages_received
        self.bytes_sent += count.bytes_sent
        self.bytes_received += count.bytes_received
        self.rounds += count.rounds
        self.seconds += seconds

    def per_cycle(self) -> dict:
        cycles = max(self.cycles, 1)
        return {"cycles": self.cycles,
                "messages_sent_per_cycle": self.messages_sent / cycles,
                "messages_received_per_cycle": self.messages_received / cycles,
                "bytes_sent_per_cycle": self.bytes_sent / cycles,
                "bytes_received_per_cycle": self.bytes_received / cycles,
                "rounds_per_cycle": self.rounds / cycles,
                "seconds_per_cycle": self.seconds / cycles}


@dataclass
class NegotiationCounters:
    """One rank's negotiation cycles, cached (the steady state) and coordinated (through rank
    0's Coordinator) counted apart, and the connections its ring's rendezvous took."""

    cached: _Totals = field(default_factory=_Totals)
    coordinated: _Totals = field(default_factory=_Totals)
    max_rounds: int = 0
    last: ScheduleCount = field(default_factory=ScheduleCount)
    # What forming the ring cost this rank (`tcp.RendezvousCount.summary`), once per ring.
    rendezvous: dict = field(default_factory=dict)

    def record(self, count: ScheduleCount, coordinated: bool, seconds: float) -> None:
        (self.coordinated if coordinated else self.cached).add(count, seconds)
        self.max_rounds = max(self.max_rounds, count.rounds)
        self.last = count

    def summary(self) -> dict:
        """Totals and per-cycle means, as plain numbers."""
        return {"cycles": self.cached.cycles + self.coordinated.cycles,
                "coordinated_cycles": self.coordinated.cycles,
                "max_rounds": self.max_rounds,
                "cached": self.cached.per_cycle(),
                "coordinated": self.coordinated.per_cycle(),
                "rendezvous": dict(self.rendezvous)}
