"""Horovod's process sets: collectives over a subset of the ranks.

    >>> evens = hvd.add_process_set([0, 2])             # every rank calls it, member or not
    >>> if evens.included():
    ...     hvd.allreduce(tensor, process_set=evens)     # over ranks 0 and 2 only
    >>> hvd.remove_process_set(evens)                   # every rank again

A process set is a ring of its own, formed when it is added (`process_set_rings.py`).
This module knows the sets and which one an operation runs over; operations on different
sets run independently.

As in Horovod, ranks in arguments stay global (`broadcast(t, root_rank=2, process_set=evens)`),
and `evens.rank()` is a rank's position within its set, the order of an allgather's results.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Callable, Iterator, Sequence

from ..runtime import context
from ..runtime.context import Runtime


class ProcessSet:
    """A set of ranks that collectives may run over. `process_set_id` is set once it is
    added (`hvd.add_process_set`, or `hvd.init(process_sets=[...])`), and None again after
    it is removed."""

    def __init__(self, ranks: Sequence[int]):
        if isinstance(ranks, (str, bytes)) or not all(isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of ranks (ints), not {ranks!r}")
        self._ranks = sorted(ranks)
        self.process_set_id: int | None = None
        self._runtime: Runtime | None = None  # this rank's ring over the set, if a member

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    def size(self) -> int | None:
        """How many ranks the set has, or None before it is added."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's position in the set (0 for its lowest rank), or None if it is not a
        member or the set is not added."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(context.current("ProcessSet.rank").world.rank)

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return context.current("ProcessSet.included").world.rank in self.ranks

    def check_added(self, api: str) -> None:
        if added_sets(api).get(self.process_set_id) is not self:
            raise ValueError(f"{api}: {self} is not added (or was removed); call "
                             "hvd.add_process_set on every rank first")

    def runtime(self, api: str) -> Runtime:
        """The ring to run `api` over: refused unless the set is added and has this rank."""
        self.check_added(api)
        if self._runtime is None:
            raise ValueError(f"{api}: rank {context.current(api).world.rank} is not in {self}; "
                             "only its members may run collectives over it")
        return self._runtime

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _EveryRank(ProcessSet):
    """`hvd.global_process_set`: every rank of the run, over the ring `init()` formed."""

    def __init__(self):
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        return list(range(context.current("global_process_set").world.size))

    def included(self) -> bool:
        return True

    def check_added(self, api: str) -> None:
        """Always there (also before `init()`: a DistributedOptimizer may be built first)."""

    def runtime(self, api: str) -> Runtime:
        return context.current(api)


global_process_set = _EveryRank()

# The sets added since the run's ring was formed: ids count up from 1 on every rank alike.
_added: dict[int, ProcessSet] = {}
_added_under: list = [None]  # the global Runtime they were added under (init() starts afresh)


def added_sets(api: str) -> dict[int, ProcessSet]:
    """The sets added under the current ring, by id (`api`: what asks, for its error)."""
    everyone = context.current(api)
    if _added_under[0] is not everyone:
        for process_set in _added.values():
            process_set.process_set_id, process_set._runtime = None, None
        _added.clear()
        _added_under[0] = everyone
    return _added


# ---- which set an operation runs over ----------------------------------------------------
# A public operation with `process_set=` makes that set active for its duration: the
# operations it calls on the way (allgather_object's allgathers, a sparse allreduce's)
# and the handles it submits run over the same ring. Autograd's backward runs later and
# enters the set its forward saved.

_active: contextvars.ContextVar[ProcessSet] = contextvars.ContextVar(
    "ddl_magic_process_set", default=global_process_set)


def active() -> ProcessSet:
    return _active.get()


def active_runtime(api: str) -> Runtime:
    """The ring that `api` runs over: the active process set's."""
    return _active.get().runtime(api)


@contextlib.contextmanager
def entered(process_set: ProcessSet) -> Iterator[None]:
    token = _active.set(process_set)
    try:
        yield
    finally:
        _active.reset(token)


def on_process_set(function: Callable) -> Callable:
    """Run `function` over its `process_set` argument (by keyword or position): that set is
    checked, then active while it runs. Left out, the active set stays (the global one at
    the top level)."""
    position = list(inspect.signature(function).parameters).index("process_set")
    api = function.__name__

    @functools.wraps(function)
    def over_process_set(*args, **kwargs):
        process_set = args[position] if len(args) > position else kwargs.get("process_set")
        if process_set is None or process_set is _active.get():
            return function(*args, **kwargs)
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"{api}: process_set must be a ProcessSet (hvd.global_process_set "
                            f"or one from hvd.add_process_set), not {type(process_set).__name__}")
        process_set.runtime(api)  # refused here, on the caller's thread, if it cannot run
        with entered(process_set):
            return function(*args, **kwargs)

    return over_process_set
