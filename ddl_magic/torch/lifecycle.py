"""Joining and leaving the run's ring: Horovod's `init`, `shutdown` and `is_initialized`."""

from __future__ import annotations

from ..runtime import context
from .process_set_rings import add_listed


def init(comm=None, process_sets=None) -> None:
    """Join the run's ring (or become a world of one outside a launcher). Safe to call twice.

    `process_sets` (a list of `hvd.ProcessSet`) are added right away, as with
    `hvd.add_process_set`; "dynamic" (Horovod's switch for adding them later) changes
    nothing, since they can always be added later. Horovod's `comm` (an MPI communicator)
    is refused: ddl_magic does not use MPI.
    """
    if comm is not None:
        raise NotImplementedError(
            "init(comm=...): ddl_magic starts its ranks itself and does not use MPI; call "
            "hvd.init() and launch with %%horovod, HorovodRunner or ddlrun")
    context.init()
    add_listed(process_sets)


def shutdown() -> None:
    """Leave the ring; collectives raise until the next `init()`."""
    context.shutdown()


def is_initialized() -> bool:
    return context.is_initialized()
