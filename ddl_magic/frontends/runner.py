"""`HorovodRunner`: run a function on N ranks, as Databricks' HorovodRunner does.

    from ddl_magic import HorovodRunner

    def train(lr):
        import ddl_magic.torch as hvd
        hvd.init()
        ...
        return model.state_dict()

    state = HorovodRunner(np=-2).run(train, lr=0.01)   # np < 0: -np local processes
    state = HorovodRunner(np=4).run(train, lr=0.01)    # np > 0: 4 Spark barrier tasks

`main`'s return value comes back from rank 0. The `%%horovod` magic uses the same machinery.
"""

from __future__ import annotations

from typing import Any, Callable

from .data_options import datasets_among, shares_for_run
from .options import make_display, make_launcher
from ..driver.capture import capture_function
from ..driver.job import Job, JobOptions
from ..driver.run_options import check_options
from ..driver.run_result import RunResult
from ..driver.tracking import check_setting


class HorovodRunner:
    """Runs a function on `np` ranks: `np < 0` local processes, `np > 0` Spark barrier tasks.

    `driver_log_verbosity="all"` shows every rank's output in the notebook (the default);
    `"log_callback_only"` shows only failures and the summary. `timeline=PATH` records every
    rank's timeline to PATH. `use_gpu=True` pins each rank to the GPU of its local_rank
    (checked before anything starts). `mlflow=True` (or an experiment name) tracks each run
    in MLflow, `False` never; by default runs are tracked while an MLflow run is active.

    `min_np` and/or `max_np` make the run elastic (Horovod's `horovodrun --min-np/--max-np`):
    a lost rank resets the world instead of failing the run, and `main`'s
    `@hvd.elastic.run` function goes on from the last `state.commit()` while `min_np` ranks
    are left; lost ranks are replaced, up to `np` (on Spark a replacement joins once its
    task has a slot, `README.md`'s "Elastic runs on Spark"). `last_run.resets` lists the resets.

        HorovodRunner(np=-4, min_np=2).run(train)

    `max_restarts=K` is torchrun's `--max-restarts`, for plain torch.distributed code: when a
    rank fails, every rank is stopped and the whole group starts again, at most K times, with
    `TORCHELASTIC_RESTART_COUNT` set for code that resumes from its own checkpoint;
    `last_run.restarts` lists the restarts. Not with `min_np`/`max_np`.

    `memory_per_rank='2GiB'` caps each local rank's memory (a memory cgroup per rank): a rank
    over it is killed by the OOM killer and named out of memory, as on a machine that small.
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all", timeline: str | None = None,
                 timeout: float | None = None, env: dict[str, str] | None = None,
                 use_gpu: bool = False, mlflow: bool | str | None = None,
                 min_np: int | None = None, max_np: int | None = None, max_restarts: int = 0,
                 memory_per_rank: str | None = None):
        if not isinstance(np, int) or isinstance(np, bool) or np == 0:
            raise ValueError(
                f"HorovodRunner(np={np!r}): np must be a non-zero integer: np=-2 runs 2 local "
                "processes on this machine, np=4 runs 4 Spark barrier tasks")
        if driver_log_verbosity not in ("all", "log_callback_only"):
            raise ValueError("driver_log_verbosity must be 'all' or 'log_callback_only'")
        check_setting(mlflow)
        check_options(abs(np), min_np=min_np, max_np=max_np, max_restarts=max_restarts)
        self.num_processor = np
        self._options = JobOptions(display=make_display, timeout_s=timeout, timeline_path=timeline, env=dict(env or {}),
                                   hide_output=driver_log_verbosity != "all", use_gpu=use_gpu,
                                   title=f"HorovodRunner(np={np})", mlflow=mlflow,
                                   min_np=min_np, max_np=max_np, max_restarts=max_restarts,
                                   memory_per_rank=memory_per_rank)
        self.last_run: RunResult | None = None

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """Run `main(**kwargs)` on every rank and return rank 0's return value.

        A keyword whose value is a Spark or pandas DataFrame, or `ddl_magic.data.Data(...)`
        (a path, or chosen columns), reaches `main` on each rank as that rank's share of it,
        a `ddl_magic.data.Share`: `run(main, train=df)`, then in `main`,
        `for batch in train.loader(batch_size=256): ...`.
        """
        if not callable(main):
            raise TypeError(f"HorovodRunner.run needs a function, got {type(main).__name__}")
        on_spark = self.num_processor > 0
        with shares_for_run(datasets_among(kwargs), abs(self.num_processor), on_spark,
                            quiet=self._options.hide_output) as data:
            payload = capture_function(main, {**kwargs, **data.shares})
            launcher = make_launcher(spark=on_spark, data=data)
            job = Job(payload, abs(self.num_processor), launcher, self._options)
            self.last_run = job.run()
        return self.last_run.result
