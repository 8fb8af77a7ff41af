"""What a rank of `DeepspeedTorchDistributor` does before the user's DeepSpeed code runs.

DeepSpeed's `initialize` (and `init_distributed`) takes a process group that is already
formed, whichever backend it has: forming it here on `ddl` puts DeepSpeed's collectives, the
sub-groups of its ZeRO stages included, on ddl_magic's planes instead of gloo (or oneCCL,
which DeepSpeed's CPU accelerator asks for first). On the CPU (`DS_ACCELERATOR=cpu`, set by
the distributor), DeepSpeed's own shared-memory allreduce op, which it compiles with a C++
compiler on its first start (minutes on a small machine) and uses only for inference, is left
out: `inference_all_reduce` then goes through the process group too.

A script gets `--deepspeed --deepspeed_config PATH` after its own arguments, as pyspark's
distributor passes them; a config given as a dict is written to a file on the rank's own
host, so that a Spark executor on another machine reads it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from ..wire.tasks import ScriptTask

SHARED_MEMORY_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME


def run_under_deepspeed(task: Any, config: dict | str | None, use_gpu: bool) -> Any:
    """Form the `ddl` process group as DeepSpeed would, then run `task` (a function or a
    script task, which gets the config's arguments); its result is the rank's."""
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise ImportError(
            f"DeepspeedTorchDistributor needs DeepSpeed on every rank ({exc}): pip install "
            "'ddl_magic[deepspeed]' on the driver and, on Spark, on the executors") from None
    import torch.distributed as dist

    if not use_gpu:
        deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP] = False
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="ddl", auto_mpi_discovery=False)
    if not isinstance(task, ScriptTask):
        return task.run()
    with tempfile.TemporaryDirectory(prefix="deepspeed-config-") as folder:
        task.args = [*task.args, "--deepspeed", *_config_arguments(config, folder)]
        return task.run()


def _config_arguments(config: dict | str | None, folder: str) -> list[str]:
    if not config:
        return []
    if isinstance(config, dict):
        path = os.path.join(folder, "deepspeed_config.json")
        with open(path, "w", encoding="utf-8") as file:
            json.dump(config, file)
        return ["--deepspeed_config", path]
    return ["--deepspeed_config", config]
