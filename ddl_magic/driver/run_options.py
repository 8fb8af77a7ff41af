"""What a run is asked to be (`JobOptions`), and the one check of it that every front-end
calls before anything starts (`check_options`).

`%%horovod`, `%horovod start`, `ddlrun`, `python -m ddl_magic`, `HorovodRunner`,
`@distributed` and `TorchDistributor` each spell the options their own way (`-np 4`,
`np=-4`, `num_processes=4`); they all hand the numbers to `check_options`, and say what it
refuses in their own error type (a magic's usage error, `ddlrun`'s exit status 2, a
`ValueError` from Python). `Job.run` and `Pool.start` call it too, so a run built directly
(tests, benchmarks, `TorchEstimator`) is held to the same rules.

Example::

    >>> check_options(4, min_np=2).min_np
    2
    >>> check_options(0)
    Traceback (most recent call last):
    ...
    ddl_magic.driver.run_options.OptionError: -np must be at least 1 (got 0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .display import DisplayFactory, text_display
from .elastic_plan import ElasticBounds
from ..wire.elastic_settings import blacklist_after, elastic_timeout_s, reset_limit


@dataclass
class JobOptions:
    timeout_s: float | None = None
    timeline_path: str | None = None
    return_all: bool = False
    env: dict[str, str] = field(default_factory=dict)
    hide_output: bool = False  # show only failures and the closing line, not what ranks print
    use_gpu: bool = False  # each rank pins the GPU of its local_rank
    title: str = ""
    # True or an experiment name: track the run in MLflow; False: never; None: when the
    # notebook has an active MLflow run (tracking.py)
    mlflow: bool | str | None = None
    # How the run shows itself: the front-end's choice (frontends/options.make_display)
    display: DisplayFactory = text_display
    # Either given: the run is elastic (`elastic.py`): a lost rank resets the world, which
    # keeps at least min_np ranks and at most max_np (each defaults to np). Neither: a lost
    # rank ends the run, as always.
    min_np: int | None = None
    max_np: int | None = None
    # Plain torch.distributed code's restarts, as torchrun's --max-restarts: a failed rank
    # stops the whole group, which starts again (at most this many times) with
    # TORCHELASTIC_RESTART_COUNT set, for code that resumes from its own checkpoint.
    max_restarts: int = 0
    # Each local rank in a memory cgroup capped at this size ('2GiB'): a rank over it is
    # killed by the OOM killer and named so, as on a machine that small (`rank/memory_cap.py`).
    memory_per_rank: str | None = None

    @property
    def elastic(self) -> bool:
        return self.min_np is not None or self.max_np is not None


class OptionError(ValueError):
    """An option no run can take; the message says what to write instead. `option` is the
    option's keyword (``"np"``, ``"min_np"``, ``"max_restarts"``), for a front-end that
    names it its own way."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


def check_options(np: int, *, min_np: int | None = None, max_np: int | None = None,
                  max_restarts: int = 0) -> ElasticBounds | None:
    """Refuse, before anything starts, a rank count, elastic bounds or restart count that no
    run can take (`OptionError`); the elastic run's bounds when `min_np` or `max_np` is
    given, else None. A pool takes the same rules (and no `max_np`: it keeps its `np`
    slots, `launcher.check_elastic`).

    >>> check_options(4, max_restarts=-1)
    Traceback (most recent call last):
    ...
    ddl_magic.driver.run_options.OptionError: max_restarts=-1: give how many times the whole group may be restarted after a rank fails, 0 or more (e.g. --max-restarts 3)
    """
    if not _is_count(np) or np < 1:
        raise OptionError(f"-np must be at least 1 (got {np})", "np")
    elastic = min_np is not None or max_np is not None
    if not _is_count(max_restarts) or max_restarts < 0:
        raise OptionError(f"max_restarts={max_restarts!r}: give how many times the whole group "
                          "may be restarted after a rank fails, 0 or more (e.g. --max-restarts "
                          "3)", "max_restarts")
    if max_restarts and elastic:
        raise OptionError(f"max_restarts={max_restarts} restarts the whole group, which resumes "
                          "from your own checkpoint (torchrun's --max-restarts, for plain "
                          "torch.distributed code); min_np/max_np keep the run going on the "
                          "ranks that are left (hvd.elastic.run): use one or the other",
                          "max_restarts")
    return elastic_bounds(np, min_np, max_np) if elastic else None


def elastic_bounds(np: int, min_np: int | None, max_np: int | None) -> ElasticBounds:
    """The bounds of a run of `np` ranks given `min_np` and/or `max_np`, checked, with the
    limits the environment sets (`wire/elastic_settings.py`, DDL_MAGIC_ELASTIC_BLACKLIST_AFTER)."""
    low = np if min_np is None else min_np
    high = np if max_np is None else max_np
    if not 1 <= low <= np <= high:
        raise OptionError(f"elastic run: need 1 <= min_np <= np <= max_np, got min_np={low}, "
                          f"np={np}, max_np={high}: e.g. -np 4 --min-np 2 --max-np 4",
                          "min_np" if not 1 <= low <= np else "max_np")
    return ElasticBounds(low, high, reset_limit(), elastic_timeout_s(), blacklist_after())


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
