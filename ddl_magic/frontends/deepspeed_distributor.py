"""`DeepspeedTorchDistributor`: pyspark's DeepSpeed distributor, ported by changing one import.

    from ddl_magic import DeepspeedTorchDistributor   # was: from pyspark.ml.deepspeed... import

    def train(learning_rate):
        import deepspeed
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
        ...

    DeepspeedTorchDistributor(numGpus=4, nnodes=1, localMode=True, useGpu=False).run(train, 1e-3)
    DeepspeedTorchDistributor(numGpus=2, nnodes=2, localMode=False, useGpu=False,
                              deepspeedConfig={"zero_optimization": {"stage": 3}, ...}
                              ).run("train.py", "--epochs", "3")

As pyspark's: `numGpus * nnodes` processes, on this machine (`localMode=True`) or as Spark
barrier tasks; a script gets its arguments followed by `--deepspeed --deepspeed_config PATH`
(a dict `deepspeedConfig` is written to a JSON file), as DeepSpeed's argument parser expects;
a function gets its own arguments (not the config, as in pyspark) and returns rank 0's value.

Where ddl_magic differs: every rank's process group is formed on the `ddl` backend before the
user's code runs, so `deepspeed.initialize` takes it and ZeRO's collectives run on ddl_magic's
planes (`rank/deepspeed_rank.py`); `useGpu=False` sets `DS_ACCELERATOR=cpu` (DeepSpeed's CPU
accelerator) on every rank; and what `TorchDistributor` does differently from pyspark's holds
here too (a warm start, live output per rank, fail-fast with the failing rank's traceback).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

from ..driver.capture import capture_function
from ..driver.job import Job, JobOptions
from ..rank.deepspeed_rank import run_under_deepspeed
from ..wire.tasks import FunctionTask
from .options import make_display, make_launcher
from .torch_distributor import TorchDistributor


class DeepspeedTorchDistributor(TorchDistributor):
    """Runs DeepSpeed training (a function or a script) on `numGpus * nnodes` ranks."""

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True,
                 useGpu: bool = True, deepspeedConfig: str | dict | None = None):
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DeepspeedTorchDistributor({name}={value!r}): {name} must be a "
                                 "positive integer")
        if deepspeedConfig is not None and not isinstance(deepspeedConfig, (str, dict)):
            raise TypeError("DeepspeedTorchDistributor(deepspeedConfig=...) takes a dict of "
                            "DeepSpeed settings or the path of a JSON file, not "
                            f"{type(deepspeedConfig).__name__}")
        if isinstance(deepspeedConfig, str) and localMode:
            if not os.path.isfile(deepspeedConfig):
                raise FileNotFoundError(f"deepspeedConfig {deepspeedConfig!r} not found (working "
                                        f"directory: {os.getcwd()})")
            deepspeedConfig = os.path.abspath(deepspeedConfig)
        super().__init__(num_processes=numGpus * nnodes, local_mode=localMode, use_gpu=useGpu)
        self.deepspeed_config = deepspeedConfig

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run `train_object(*args, **kwargs)` (or the script `train_object` with `args`, then
        `--deepspeed --deepspeed_config PATH`) on every rank; return rank 0's return value
        (None for a script)."""
        if isinstance(train_object, (str, os.PathLike)):
            task = self._script_task(os.fspath(train_object), args, kwargs)
            title = os.path.basename(task.path)
        elif callable(train_object):
            capture_function(train_object, kwargs, args)  # names what cannot be sent, first
            task = FunctionTask(train_object, kwargs, args)
            title = getattr(train_object, "__name__", "train")
        else:
            raise TypeError("DeepspeedTorchDistributor.run needs a function or the path of a "
                            f"Python script, got {type(train_object).__name__}")
        if self.local_mode and importlib.util.find_spec("deepspeed") is None:
            raise ImportError("DeepspeedTorchDistributor needs DeepSpeed: pip install "
                              "'ddl_magic[deepspeed]'")
        options = JobOptions(display=make_display, use_gpu=self.use_gpu,
                             env={} if self.use_gpu else {"DS_ACCELERATOR": "cpu"},
                             title=f"DeepspeedTorchDistributor(np={self.num_processes}, "
                                   f"localMode={self.local_mode}): {title}")
        wrapped = capture_function(run_under_deepspeed, {
            "task": task, "config": self.deepspeed_config, "use_gpu": self.use_gpu})
        self.last_run = Job(wrapped, self.num_processes, make_launcher(spark=not self.local_mode),
                            options).run()
        return self.last_run.result
