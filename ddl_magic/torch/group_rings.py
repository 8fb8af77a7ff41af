"""Which ring a torch.distributed process group on the `ddl` backend runs over.

    dist.init_process_group("ddl")
    pair = dist.new_group([0, 1])                   # every rank calls it, in the same order
    mesh = init_device_mesh("cpu", (2, 2))          # a new_group per row and per column

A group over every rank runs over the run's own ring. Any other group forms a ring of its own
over its members, as a Horovod process set does (`context.connect_subset`): shared memory
within a host, TCP across hosts, hierarchical where every host has as many members. A pair of
members that `send`/`recv` to each other forms a ring of two the first time they do.

torch creates a group on its members only: every rank calls `new_group(ranks)` in the same
order (torch names a group by how many were created before it, so the names agree), and the
backend's creator runs on the members. The members then find each other through the group's
store, the one thing they share that the other ranks need not join: each writes the port its
ring listener got and the ranks it was asked for, and reads every other member's. What is read
is JSON of ints, never unpickled, and every connection then proves the run's secret, as at
`init()`.

Why every wait ends: a member waits for the others' entries at most `DDL_MAGIC_TIMEOUT`, then
names the members that never created the group; the ring then forms under the same deadline.
Members that were asked for different ranks (a group created otherwise on some ranks) see each
other's entries and refuse, naming both.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from ..runtime import context
from ..runtime.context import Runtime
from ..runtime.errors import CollectiveTimeoutError
from ..runtime.settings import Settings

ADVICE = ("every rank of the run calls new_group with the same ranks, in the same order, "
          "members or not (torch numbers groups by how many were created before)")


def ring_for_group(members: Sequence[int], store: dist.Store, group_name: str) -> Runtime | None:
    """The ring the group of `members` (run ranks, in the group's order) runs over on this
    rank: None for the run's own ring (every rank, in order), else a ring formed with the
    other members now."""
    run = context.init()
    members = tuple(members)
    if members == tuple(range(run.world.size)):
        return None
    return _ring_over(members, store, f"group {group_name!r} (ranks {list(members)})",
                      "ddl_ring")


def ring_for_pair(members: tuple[int, int], store: dist.Store, group_name: str) -> Runtime:
    """A ring of the two run ranks `members` (sender and receiver, lower first), for
    point-to-point over group `group_name`: both call this on their first `send`/`recv` to
    each other, each at a point of its own (a pair's entries wait in the store meanwhile)."""
    return _ring_over(members, store,
                      f"the pair of ranks {list(members)} of group {group_name!r} (send/recv)",
                      f"ddl_pair/{members[0]}-{members[1]}")


def _ring_over(members: tuple[int, ...], store: dist.Store, what: str, prefix: str) -> Runtime:
    run = context.init()
    rank = run.world.rank
    timeout_s = Settings.from_environment().timeout_s
    listener = context.subset_listener()
    try:
        ports = _exchanged_ports(members, rank, listener.getsockname()[1], store, what, prefix,
                                 timeout_s)
    except BaseException:
        listener.close()
        raise
    return context.connect_subset(members, ports, listener)


def _exchanged_ports(members: tuple[int, ...], rank: int, port: int, store: dist.Store,
                     what: str, prefix: str, timeout_s: float) -> dict[int, int]:
    """Every member's ring port, read from the store once each has written its entry."""
    store.set(f"{prefix}/{rank}", json.dumps({"ranks": list(members), "port": port}))
    others = [member for member in members if member != rank]
    try:
        store.wait([f"{prefix}/{member}" for member in others], timedelta(seconds=timeout_s))
    except dist.DistNetworkError as exc:
        raise RuntimeError(
            f"torch.distributed: torch's store (which rank 0 holds) went away while rank {rank} "
            f"waited for ranks {others} to create {what}: rank 0 ended or failed first. "
            f"Otherwise, {ADVICE}") from exc
    except dist.DistStoreError:
        missing = [member for member in others if not store.check([f"{prefix}/{member}"])]
        raise CollectiveTimeoutError(
            f"torch.distributed: rank {rank} waited {timeout_s:.0f} s (DDL_MAGIC_TIMEOUT) for "
            f"ranks {missing} to create {what}, and they did not: {ADVICE}") from None
    ports = {rank: port}
    for member in others:
        entry = json.loads(store.get(f"{prefix}/{member}"))
        if entry["ranks"] != list(members):
            raise ValueError(
                f"torch.distributed: rank {rank} created {what}, but rank {member} created it "
                f"over ranks {entry['ranks']}: {ADVICE}")
        ports[member] = int(entry["port"])
    return ports
