"""Horovod's process sets: collectives over a subset of the ranks.

    >>> evens = hvd.add_process_set([0, 2])             # every rank calls it, member or not
    >>> if evens.included():
    ...     hvd.allreduce(tensor, process_set=evens)     # over ranks 0 and 2 only
    >>> hvd.remove_process_set(evens)                   # every rank again

A process set is a ring of its own, formed when it is added: its members open a listener,
every rank learns their ports through one allgather over the run's ring (which also checks
that every rank added the same set), and the members connect as `init()` connects all ranks,
with shared memory where they share a host. Operations on different sets run independently.

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
        if _registry(api).get(self.process_set_id) is not self:
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


def _registry(api: str) -> dict[int, ProcessSet]:
    everyone = context.current(api)
    if _added_under[0] is not everyone:
        for process_set in _added.values():
            process_set.process_set_id, process_set._runtime = None, None
        _added.clear()
        _added_under[0] = everyone
    return _added


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Form a process set over `process_set`'s ranks (a ProcessSet or a list of ranks) and
    return it. Every rank of the run calls this, in the same order, with the same ranks.

    Every rank's ranks are gathered before anything is checked, so a refusal (ranks that
    differ between ranks, a duplicate set) is raised on every rank alike, and the run goes on.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    everyone = context.current("add_process_set").world
    registry = _registry("add_process_set")
    ranks = process_set.ranks
    set_id = max(registry, default=0) + 1
    listener = context.subset_listener() if everyone.rank in ranks else None
    try:
        offers = _every_ranks((ranks, listener and listener.getsockname()[1]),
                              f"add_process_set.{set_id}")
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


def _every_ranks(obj, name: str) -> list:
    """Every rank's `obj`, gathered over the run's ring whatever set is active."""
    from .functions import allgather_object  # it is built on the operations, which use this module

    with entered(global_process_set):
        return allgather_object(obj, name=name)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Close a process set on every rank (each calls this); False if it was not added, or is
    the global one (which stays)."""
    if process_set.process_set_id in (None, 0) or _registry("remove_process_set").get(
            process_set.process_set_id) is not process_set:
        return False
    del _added[process_set.process_set_id]
    runtime, process_set._runtime, process_set.process_set_id = process_set._runtime, None, None
    if runtime is not None:
        context.close_subset(runtime)
    return True


def add_at_init(process_sets) -> None:
    """`hvd.init(process_sets=...)`: a list of sets to add now ("dynamic": add them later)."""
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, (str, bytes)):
        raise ValueError(f"init(process_sets={process_sets!r}): give a list of ProcessSet, or "
                         "'dynamic'")
    for process_set in process_sets:
        add_process_set(process_set)


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
