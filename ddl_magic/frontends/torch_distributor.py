"""`TorchDistributor`: pyspark's TorchDistributor, ported by changing one import.

    from ddl_magic import TorchDistributor      # was: from pyspark.ml.torch.distributor import ...

    def train(learning_rate):
        import torch.distributed as dist
        dist.init_process_group("gloo")         # or "ddl": ddl_magic's runtime underneath
        ...
        return model.state_dict()

    state = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(train, 1e-3)
    TorchDistributor(num_processes=4, local_mode=False, use_gpu=False).run("train.py", "--epochs", "3")

As pyspark's: `local_mode=True` runs the processes on this machine, `local_mode=False` as Spark
barrier tasks; every process finds torchrun's environment (`RANK`, `MASTER_ADDR`, ...); a
function's return value comes back from rank 0, a script's run returns None; a script takes
string arguments and no keyword arguments.

Where ddl_magic differs, on purpose: local mode needs no SparkSession; ranks start from a warm
process instead of `torchrun` (a tenth of the time); each rank's output shows live and
separately in the notebook; a failing rank stops the others at once and raises
`RankFailedError` with its traceback (pyspark raises `RuntimeError` naming the command);
`use_gpu=True` pins each rank to the GPU of its local rank and checks that there are enough
before starting.

One keyword of ours, which pyspark's constructor does not have: `max_restarts=K`, torchrun's
`--max-restarts`. When a rank fails, every rank is stopped and the whole group starts again,
at most K times, each rank's `TORCHELASTIC_RESTART_COUNT` saying which restart it is, so code
that resumes from its own checkpoint goes on::

    TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, max_restarts=3).run(train)
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .data_options import datasets_among, shares_for_run
from .options import make_display, make_launcher
from ..driver.capture import capture_function
from ..driver.job import Job, JobOptions
from ..driver.run_options import OptionError, check_options
from ..driver.run_result import RunResult
from ..wire.tasks import ScriptTask


class TorchDistributor:
    """Runs a torch.distributed function or script on `num_processes` ranks."""

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 *, max_restarts: int = 0):
        try:
            check_options(num_processes, max_restarts=max_restarts)
        except OptionError as refused:
            if refused.option != "np":
                raise
            raise ValueError(f"TorchDistributor(num_processes={num_processes!r}): num_processes "
                             "must be a positive integer") from None
        self.num_processes = num_processes
        self.max_restarts = max_restarts
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self.last_run: RunResult | None = None

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run `train_object(*args, **kwargs)` (or the script `train_object` with `args`) on
        every rank; return rank 0's return value (None for a script)."""
        if not isinstance(train_object, (str, os.PathLike)) and not callable(train_object):
            raise TypeError("TorchDistributor.run needs a function or the path of a Python "
                            f"script, got {type(train_object).__name__}")
        with shares_for_run(datasets_among(kwargs), self.num_processes,
                            not self.local_mode) as data:
            if isinstance(train_object, (str, os.PathLike)):
                task = self._script_task(os.fspath(train_object), args,
                                         {k: v for k, v in kwargs.items() if k not in data.shares})
                task.shares.update(data.shares)  # ddl_magic.data.share(name) in the script
                title = os.path.basename(task.path)
            else:
                task = capture_function(train_object, {**kwargs, **data.shares}, args)
                title = getattr(train_object, "__name__", "train")
            options = JobOptions(display=make_display, use_gpu=self.use_gpu,
                                 max_restarts=self.max_restarts, title=(
                f"TorchDistributor(num_processes={self.num_processes}, "
                f"local_mode={self.local_mode}): {title}"))
            launcher = make_launcher(spark=not self.local_mode, data=data)
            self.last_run = Job(task, self.num_processes, launcher, options).run()
        return self.last_run.result

    def _script_task(self, path: str, args: tuple, kwargs: dict) -> ScriptTask:
        if kwargs:
            raise ValueError("a script takes command-line arguments only: pass them as strings, "
                             f"e.g. run({path!r}, '--epochs', '3'), not as keywords "
                             f"({', '.join(kwargs)})")
        if self.local_mode and not os.path.isfile(path):
            raise FileNotFoundError(f"script {path!r} not found (working directory: {os.getcwd()})")
        # On Spark the executors open the path: it must be readable there, as with pyspark.
        return ScriptTask(os.path.abspath(path) if self.local_mode else path,
                          [str(arg) for arg in args])
