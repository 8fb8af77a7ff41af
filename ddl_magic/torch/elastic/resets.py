"""`hvd.elastic.run`: the training function runs again after every reset, from the state it
had at the last commit.

Two exceptions end an attempt, as in Horovod:

- `HorovodInternalError`: a collective failed (a rank died, a host vanished, a peer timed
  out). Some ranks may have applied a step that others did not: the state goes back to
  the last commit. `CollectiveMismatchError`, a subclass, is the exception: ranks that
  asked for different collectives have a bug that a reset would only repeat, so it ends
  the run as any other error does.
- `HostsUpdatedInterrupt`: the driver announced a host change, raised by `commit()` or
  `check_host_updates()` on every rank at the same point. Nothing is rolled back, and when
  ranks only left, the state is not even synced again.

A reset then reads top to bottom: restore the commit (after a failure), re-form the world
(`rendezvous.reform_world`: leave the ring, ask the driver, join the next one), run the
reset callbacks, sync the state from the new rank 0, run the function again. A failure
while re-forming or syncing (a second rank lost during the reset) starts the next reset.

Resets are bounded on the rank as well as by the driver: after `DDL_MAGIC_ELASTIC_RESET_LIMIT`
resets (default 10) within one call of the function, the next failure ends the run with
`ElasticRunFailed`. Horovod leaves its `--reset-limit` unlimited by default; a bounded one
here means a failure that repeats at every attempt cannot restart forever.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ...wire import elastic_settings
from ...runtime.errors import CollectiveMismatchError, HorovodInternalError
from .exceptions import ElasticRunFailed, HostsUpdatedInterrupt
from .notices import notices
from .rendezvous import ResetReason, WorldPlan, reform_world
from .state import State


Result = TypeVar("Result")
ReformWorld = Callable[[ResetReason, str, int], WorldPlan]


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Run `func(state, ...)` until it returns, re-forming the world and running it again
    after every reset. `state` is synced from rank 0 before the first run.

    No collective may run between `hvd.init()` and the call of the decorated function: a
    rank that joins after a reset starts there, while the others wait in the state's sync.

    >>> @hvd.elastic.run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs):
    ...         for state.batch in range(state.batch, batches_per_epoch):
    ...             step()
    ...             state.commit()
    ...         state.batch = 0
    >>> train(hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0))
    """
    return run_fn(func, reform_world)


def run_fn(func: Callable[..., Result], reform: ReformWorld,
           reset_limit: int | None = None) -> Callable[..., Result]:
    """`run` with the world re-formed by `reform(reason, error, commits)` (tests pass their own)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Result:
        limit = elastic_settings.reset_limit() if reset_limit is None else reset_limit
        notices.register(state)
        try:
            return _run_with_resets(func, state, args, kwargs, reform, limit)
        finally:
            notices.remove(state)

    return wrapper


def _run_with_resets(func: Callable[..., Result], state: State, args: tuple, kwargs: dict,
                     reform: ReformWorld, limit: int) -> Result:
    resets = 0
    pending: tuple[ResetReason, str] | None = None  # the reset to do before the next attempt
    skip_sync = False
    while True:
        try:
            if pending is not None:
                plan = reform(*pending, state.commit_count)
                pending = None
                state.on_reset(plan.formed_at)
                _say(f"reset {resets}: now rank {plan.rank} of {len(plan.peers) or 1} "
                     f"(world {plan.generation})")
            if not skip_sync:
                state.sync()
            return func(state, *args, **kwargs)
        except CollectiveMismatchError:
            raise
        except HorovodInternalError as error:
            state.restore()
            skip_sync = False
            pending, cause = (ResetReason.FAILURE, f"{type(error).__name__}: {error}"), error
        except HostsUpdatedInterrupt as interrupt:
            skip_sync = interrupt.skip_sync
            pending, cause = (ResetReason.HOSTS_UPDATED, str(interrupt)), interrupt
        if resets == limit:
            raise ElasticRunFailed(
                f"the run was reset {resets} times and would need another ({pending[1]}): "
                "it makes no progress. Raise DDL_MAGIC_ELASTIC_RESET_LIMIT if the failures "
                "are expected (many preemptions), or fix what fails") from cause
        resets += 1
        _say(f"reset {resets} after {pending[1]}"
             + ("; restored the last commit" if pending[0] is ResetReason.FAILURE else ""))


def _say(line: str) -> None:
    """One line per reset step in the rank's output (the driver's run view shows resets too)."""
    print(f"[elastic] {line}", file=sys.stderr, flush=True)
