"""`@distributed`: the decorator Databricks users know from `serverless_gpu` (and
`databricks.air`), on ddl_magic's ranks.

    from ddl_magic import distributed

    @distributed(np=2)                      # or gpus=2 / num_accelerators=2: a rank per GPU
    def train(lr):
        import ddl_magic.torch as hvd       # or torch.distributed: torchrun's environment is set
        hvd.init()
        ...
        return hvd.rank(), final_loss

    results = train.distributed(0.01)       # every rank's return value, in rank order
    train(0.01)                             # once, in this process, as without the decorator

`remote=True` runs the ranks as Spark barrier tasks on the active SparkSession instead of as
local processes. A failing rank stops the others and `.distributed` raises its
`RankFailedError`, traceback included. The same machinery as `HorovodRunner` runs it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .data_options import datasets_among, shares_for_run
from .options import make_display, make_launcher
from ..driver.capture import capture_function
from ..driver.job import Job, JobOptions
from ..driver.run_options import OptionError, check_options
from ..driver.run_result import RankFailedError, RunResult
from ..launch import spark_session


class DistributedFunction:
    """A function decorated with `@distributed`: call it to run it once, here; call its
    `.distributed(*args, **kwargs)` to run it on every rank.

        @distributed(np=2)
        def rank_and_size():
            import os
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

        rank_and_size.distributed()       # [(0, 2), (1, 2)]
        rank_and_size.last_run.ranks      # the last run's record (also of a failed one):
                                          # each rank's status, host and log
    """

    def __init__(self, function: Callable[..., Any], np: int, use_gpu: bool, remote: bool,
                 options: JobOptions, described_as: str):
        functools.update_wrapper(self, function)
        self.np = np
        self.use_gpu = use_gpu
        self.remote = remote
        self._options = options
        self._described_as = described_as  # "@distributed(gpus=2)", as the user wrote it
        self.last_run: RunResult | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def distributed(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run the function with these arguments on every rank; return the list of every
        rank's return value, rank 0's first. Raises `RankFailedError` if a rank fails."""
        if self.remote and spark_session() is None:
            raise RuntimeError(
                f"{self._described_as} runs the ranks as Spark barrier tasks on the active "
                "SparkSession, and there is none: create one first "
                "(SparkSession.builder.getOrCreate()), or drop remote=True to run the ranks "
                "as processes on this machine")
        if self.use_gpu and not self.remote:
            self._check_local_gpus()
        with shares_for_run(datasets_among(kwargs), self.np, self.remote,
                            quiet=self._options.hide_output) as data:
            launcher = make_launcher(spark=self.remote, data=data)
            payload = capture_function(self.__wrapped__, {**kwargs, **data.shares}, args)
            job = Job(payload, self.np, launcher, self._options)
            try:
                self.last_run = job.run()
            except RankFailedError as failure:
                self.last_run = failure.run  # which rank failed how, and every rank's logs
                raise
        return self.last_run.results

    def _check_local_gpus(self) -> None:
        """Said in the decorator's words; Spark's GPU check (its task resources) is the
        launcher's own."""
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < self.np:
            raise ValueError(
                f"{self._described_as} starts one rank per GPU, but torch sees "
                f"{count or 'no'} CUDA GPU{'s' if count != 1 else ''} on this machine: use "
                f"@distributed(np={self.np}) to run {self.np} ranks on the CPU"
                + (f", or gpus={count} or fewer" if count else ""))


def distributed(function: Callable[..., Any] | None = None, /, *, np: int | None = None,
                gpus: int | None = None, num_accelerators: int | None = None,
                remote: bool = False, gpu_type: str | None = None, timeout: float | None = None,
                env: dict[str, str] | None = None,
                timeline: str | None = None,
                max_restarts: int = 0, memory_per_rank: str | None = None) -> Callable[[Callable[..., Any]], DistributedFunction]:
    """Decorate a function so that `f.distributed(*args, **kwargs)` runs it on N ranks and
    returns every rank's return value, in rank order.

        @distributed(np=2)
        def train(lr):
            ...
        losses = train.distributed(lr=0.01)     # [rank 0's, rank 1's]

    - `np`: that many ranks, on the CPU. `gpus` (or its other name, `num_accelerators`): that
      many ranks, each pinned to the GPU of its local rank; refused before anything starts
      where there are too few GPUs.
    - `remote=False` (the default): processes on this machine. `remote=True`: Spark barrier
      tasks on the active SparkSession (classic or Connect); refused without one.
    - `timeout` (seconds) stops every rank of a run that takes longer; `env` sets variables
      on every rank; `timeline=PATH` records every rank's timeline ('' : with the run's logs).
    - `max_restarts=K` (torchrun's `--max-restarts`): when a rank fails, every rank is stopped
      and the whole group starts again, at most K times, `TORCHELASTIC_RESTART_COUNT` set on
      each rank for code that resumes from its own checkpoint.
    - `memory_per_rank='2GiB'` caps each local rank's memory, as `%%horovod --memory-per-rank`.
    - `gpu_type` (Databricks' choice of serverless GPU) is refused: the ranks run on the GPUs
      of this machine or of the Spark executors.
    """
    if function is not None:
        raise TypeError("@distributed needs the number of ranks: write @distributed(np=2), or "
                        "@distributed(gpus=2) for one rank per GPU")
    if gpu_type is not None:
        raise ValueError(f"gpu_type={gpu_type!r} chooses a Databricks serverless GPU; ddl_magic "
                         "runs the ranks on the GPUs of this machine (or of the Spark "
                         "executors, with remote=True): drop gpu_type")
    given = {name: value for name, value in
             (("np", np), ("gpus", gpus), ("num_accelerators", num_accelerators))
             if value is not None}
    if len(given) != 1:
        raise ValueError(
            "@distributed needs exactly one of np= (ranks on the CPU) and gpus= (or "
            "num_accelerators=: one rank per GPU), e.g. @distributed(np=2)"
            + (f"; got {', '.join(f'{name}={value!r}' for name, value in given.items())}"
               if given else ""))
    (name, count), = given.items()
    try:
        check_options(count, max_restarts=max_restarts)
    except OptionError as refused:
        if refused.option != "np":
            raise
        raise ValueError(f"@distributed({name}={count!r}): give a positive number of ranks, "
                         f"e.g. {name}=2") from None
    described_as = f"@distributed({name}={count}{', remote=True' if remote else ''})"
    use_gpu = name != "np"

    def decorate(function: Callable[..., Any]) -> DistributedFunction:
        if not callable(function):
            raise TypeError(f"{described_as} decorates a function, not a "
                            f"{type(function).__name__}")
        options = JobOptions(display=make_display, timeout_s=timeout, timeline_path=timeline, env=dict(env or {}),
                             use_gpu=use_gpu, return_all=True, max_restarts=max_restarts,
                             memory_per_rank=memory_per_rank,
                             title=f"{described_as}: {getattr(function, '__name__', 'function')}")
        return DistributedFunction(function, count, use_gpu, bool(remote), options,
                                   described_as)

    return decorate
