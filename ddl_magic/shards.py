"""A rank's share of a Spark DataFrame, handed from its barrier task to the rank process.

When a run trains on a DataFrame (`TorchEstimator.fit`), the barrier stage runs over the
DataFrame itself, repartitioned into one partition per rank. Each task writes the Arrow
batches Spark gives it to a file on its executor's local disk (`write_shard`) before it
starts its rank, and the rank memory-maps that file (`read_shard`). The rows go from the
executors to the ranks without passing through the driver, and a rank can read them once per
epoch without asking Spark again. The task deletes the file when its rank has ended.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable

import pyarrow

SHARD_VARIABLE = "DDL_MAGIC_SHARD"  # the path of this rank's shard, in the rank's environment


def write_shard(batches: Iterable[pyarrow.RecordBatch]) -> str:
    """Write `batches` (a partition's, as ``mapInArrow`` yields them) to a new local file.

    The file goes under Spark's local directories when the executor has them (Spark cleans
    those up even after a crash), else the system's temporary directory. An empty partition
    gives a file of no batches and no columns. Returns the file's path.
    """
    local_dirs = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")
    directory = tempfile.mkdtemp(prefix="ddl_magic-shard-", dir=local_dirs[0] or None)
    path = os.path.join(directory, "shard.arrow")
    writer = None
    try:
        for batch in batches:
            if writer is None:
                writer = pyarrow.ipc.new_file(path, batch.schema)
            writer.write_batch(batch)
        if writer is None:
            writer = pyarrow.ipc.new_file(path, pyarrow.schema([]))
    finally:
        if writer is not None:
            writer.close()
    return path


def remove_shard(path: str) -> None:
    """Delete a shard `write_shard` wrote, with its directory."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def read_shard() -> pyarrow.Table:
    """This rank's share of the DataFrame its run trains on, memory-mapped (no copy).

    Raises RuntimeError in a rank that was not started over a DataFrame.
    """
    path = os.environ.get(SHARD_VARIABLE)
    if not path:
        raise RuntimeError(
            "this rank has no share of a DataFrame: only runs started over one "
            "(TorchEstimator.fit) have it")
    # The table's buffers point into the mapping and keep it open while they live.
    return pyarrow.ipc.open_file(pyarrow.memory_map(path)).read_all()
