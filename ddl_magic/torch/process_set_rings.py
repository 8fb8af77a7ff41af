"""Forming and closing a process set's ring (the sets themselves: `process_sets.py`).

    >>> evens = hvd.add_process_set([0, 2])             # every rank calls it, member or not
    >>> hvd.remove_process_set(evens)                   # every rank again

Its members open a listener, every rank learns their ports through one gather over the
run's ring (`rendezvous.gather`, which also checks that every rank added the same set),
and the members connect as `init()` connects all ranks, with shared memory where they
share a host.
"""

from __future__ import annotations

from typing import Sequence

from ..runtime import context, rendezvous
from .process_sets import ProcessSet, added_sets, global_process_set


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Form a process set over `process_set`'s ranks (a ProcessSet or a list of ranks) and
    return it. Every rank of the run calls this, in the same order, with the same ranks.

    Every rank's ranks are gathered before anything is checked, so a refusal (ranks that
    differ between ranks, a duplicate set) is raised on every rank alike, and the run goes on.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    run = context.current("add_process_set")  # gathered over its ring, whatever set is active
    everyone = run.world
    registry = added_sets("add_process_set")
    ranks = process_set.ranks
    set_id = max(registry, default=0) + 1
    listener = context.subset_listener() if everyone.rank in ranks else None
    try:
        offers = rendezvous.gather((ranks, listener and listener.getsockname()[1]),
                                   rendezvous.over_op_queue(run.queue, f"add_process_set.{set_id}"))
        for other, (their_ranks, _) in enumerate(offers):
            if their_ranks != ranks:
                raise ValueError(f"add_process_set: every rank must add the same sets in the "
                                 f"same order; rank {everyone.rank} added {ranks} as set "
                                 f"{set_id}, rank {other} added {their_ranks}")
        if not ranks or not all(0 <= r < everyone.size for r in ranks) or len(set(ranks)) < len(ranks):
            raise ValueError(f"add_process_set: {ranks} must be distinct ranks of this run, "
                             f"0 to {everyone.size - 1}")
        if ranks == global_process_set.ranks or any(s.ranks == ranks for s in registry.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {process_set} (a set "
                             "of these ranks exists; use it)")
        if process_set.process_set_id is not None:
            raise ValueError(f"add_process_set: {process_set} is added already")
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        ports = {rank: port for rank, (_, port) in enumerate(offers) if port is not None}
        process_set._runtime = context.connect_subset(tuple(ranks), ports, listener)
    process_set.process_set_id = set_id
    registry[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Close a process set on every rank (each calls this); False if it was not added, or is
    the global one (which stays)."""
    registry = added_sets("remove_process_set")
    if process_set.process_set_id in (None, 0) or registry.get(
            process_set.process_set_id) is not process_set:
        return False
    del registry[process_set.process_set_id]
    runtime, process_set._runtime, process_set.process_set_id = process_set._runtime, None, None
    if runtime is not None:
        context.close_subset(runtime)
    return True


def add_listed(process_sets) -> None:
    """`hvd.init(process_sets=...)`: a list of sets to add now ("dynamic": add them later)."""
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, (str, bytes)):
        raise ValueError(f"init(process_sets={process_sets!r}): give a list of ProcessSet, or "
                         "'dynamic'")
    for process_set in process_sets:
        add_process_set(process_set)
