"""Horovod's process sets, as far as ddl_magic has them: the global one.

Horovod runs a collective over a subset of the ranks when it is given `process_set=`. Every
collective of ddl_magic runs over all ranks, so a call that names the global process set
(or none) runs as usual, and one that names any other set is refused with an error that
says so, rather than silently run over every rank:

    >>> hvd.allreduce(tensor, process_set=hvd.global_process_set)    # fine
    >>> hvd.allreduce(tensor, process_set=hvd.ProcessSet([0, 1]))    # NotImplementedError
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Sequence

from ..runtime import context


class ProcessSet:
    """A set of ranks that collectives may run over (`ranks=None`: every rank of the run)."""

    def __init__(self, ranks: Sequence[int] | None = None):
        self.ranks = None if ranks is None else sorted(int(rank) for rank in ranks)

    def size(self) -> int:
        return len(self._members())

    def rank(self) -> int:
        """This rank's index in the set."""
        return self._members().index(context.current("ProcessSet.rank").world.rank)

    def included(self) -> bool:
        return context.current("ProcessSet.included").world.rank in self._members()

    def _members(self) -> list[int]:
        world = context.current("ProcessSet").world
        return list(range(world.size)) if self.ranks is None else self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set: ProcessSet | None, api: str) -> None:
    """Refuse a process set other than every rank of the run."""
    if process_set is None:
        return
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{api}: process_set must be hvd.global_process_set (or left out), "
                        f"not {type(process_set).__name__}")
    if process_set.ranks is None:  # the set of every rank, however many there are
        return
    if process_set.ranks != list(range(context.current(api).world.size)):
        raise NotImplementedError(
            f"{api}: ddl_magic runs every collective over all ranks and has no process set "
            f"{process_set.ranks}; leave process_set out, or use torch.distributed with "
            "dist.new_group(ranks, backend='gloo') for collectives over a subset")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Horovod's dynamic process sets: only the set of every rank exists in ddl_magic."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    check_process_set(process_set, "add_process_set")
    return global_process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """The global process set cannot be removed (Horovod returns False for it too)."""
    check_process_set(process_set, "remove_process_set")
    return False


def on_global_process_set(function: Callable) -> Callable:
    """Check the `process_set` argument of `function` (by keyword or position) on every call."""
    position = list(inspect.signature(function).parameters).index("process_set")
    api = function.__name__

    @functools.wraps(function)
    def checked(*args, **kwargs):
        process_set = args[position] if len(args) > position else kwargs.get("process_set")
        if process_set is not None:
            check_process_set(process_set, api)
        return function(*args, **kwargs)

    return checked
