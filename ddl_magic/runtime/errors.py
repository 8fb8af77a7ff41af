"""Errors the runtime raises on a rank, each saying what happened and where."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective could not complete (Horovod's name, so ported `except` clauses still match)."""


class PeerLostError(HorovodInternalError):
    """A peer stopped answering: its process died, its host vanished, or it timed out."""

    def __init__(self, rank: int, host: str, what: str):
        super().__init__(f"lost rank {rank} on {host}: {what}")
        self.rank = rank
        self.host = host


class CollectiveMismatchError(HorovodInternalError):
    """Ranks asked for the same tensor name with different shapes, dtypes or operations."""


class CollectiveTimeoutError(HorovodInternalError):
    """A collective waited `DDL_MAGIC_TIMEOUT` for ranks that are alive but never submitted it."""


class CollectiveRefusedError(RuntimeError):
    """A collective was called where it cannot complete: a pool cell run on some ranks only
    (`%%horovod --ranks`), where the other ranks never join it."""


class CollectiveAbortedError(HorovodInternalError):
    """The collective was aborted from outside: a pool's cell was stopped (another rank
    failed, the user interrupted it, it timed out). The message says which."""


class NotInitializedError(ValueError):
    """The API was used before `init()`."""

    def __init__(self, what: str):
        super().__init__(
            f"ddl_magic.torch.{what}() was called before init(): call hvd.init() first "
            "(import ddl_magic.torch as hvd; hvd.init())"
        )
