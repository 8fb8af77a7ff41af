"""What negotiating collectives has cost this rank: `hvd.negotiation_counters()`.

    >>> hvd.negotiation_counters()["cached"]["messages_received_per_cycle"]   # doctest: +SKIP
    3.0

Over TCP every rank negotiates in lockstep cycles (`runtime/lockstep.py`); each cycle is
counted as "cached" (the steady state: a bitwise allreduce over the hypercube, no message to
rank 0) or "coordinated" (through rank 0's Coordinator), with the messages, bytes and rounds
of latency it cost this rank (`runtime/counters.py`). Ranks that all share one host
negotiate through shared memory, sending no messages: there it returns None.
"""

from __future__ import annotations

from .process_sets import ProcessSet, global_process_set


def negotiation_counters(process_set: ProcessSet = global_process_set) -> dict | None:
    """This rank's negotiation counters over `process_set`'s ring (the global one by default):
    cycles, cycles that went through rank 0, and per kind of cycle the messages and bytes
    sent and received, rounds on the critical path and seconds, per cycle; and under
    "rendezvous" the connections this rank opened and accepted to form the ring, and their
    frames. None where the ring negotiates through shared memory.

    Example (two ranks over TCP, after a few steps of the same named gradients)::

        >>> counters = hvd.negotiation_counters()                    # doctest: +SKIP
        >>> counters["coordinated_cycles"], counters["cached"]["rounds_per_cycle"]
        (1, 1.0)
    """
    counters = process_set.runtime("negotiation_counters").queue.counters
    return None if counters is None else counters.summary()
