"""A rank's share of a Spark DataFrame, handed from its barrier task to the rank process.

When a run trains on a DataFrame (`TorchEstimator.fit`), the barrier stage runs over the
DataFrame itself, repartitioned into one partition per rank. Each task starts its rank and,
while the rank imports torch, writes the Arrow batches Spark gives it to a file on its
executor's local disk (`write_shard`); the rank memory-maps that file (`read_shard`) once a
pipe from the task says it is complete. The rows go from the
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
READY_FD_VARIABLE = "DDL_MAGIC_SHARD_READY_FD"  # a pipe that says when the shard is complete
READY = b"ready"


def new_shard_path() -> str:
    """A path for a shard in a new private folder on this executor's local disk.

    The folder goes under Spark's local directories when the executor has them (Spark cleans
    those up even after a crash), else the system's temporary directory.
    """
    local_dirs = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")
    directory = tempfile.mkdtemp(prefix="ddl_magic-shard-", dir=local_dirs[0] or None)
    return os.path.join(directory, "shard.arrow")


def write_shard(batches: Iterable[pyarrow.RecordBatch], path: str, ready_fd: int) -> None:
    """Write `batches` (a partition's, as ``mapInArrow`` yields them) to `path`, then say so
    on `ready_fd`. The rank may start meanwhile: `read_shard` waits for the word.

    An empty partition gives a file of no batches and no columns. If writing fails, no word
    is said: the rank's `read_shard` raises when the caller closes `ready_fd`.
    """
    writer = None
    for batch in batches:
        if writer is None:
            writer = pyarrow.ipc.new_file(path, batch.schema)
        writer.write_batch(batch)
    if writer is None:
        writer = pyarrow.ipc.new_file(path, pyarrow.schema([]))
    writer.close()
    os.write(ready_fd, READY)


def remove_shard(path: str) -> None:
    """Delete a shard, with its folder."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def read_shard() -> pyarrow.Table:
    """This rank's share of the DataFrame its run trains on, memory-mapped (no copy); it can
    be read once, as the file is removed once mapped.

    Waits until the rank's task has written all of it. Raises RuntimeError in a rank that was
    not started over a DataFrame, or whose task could not write its share.
    """
    path = os.environ.get(SHARD_VARIABLE)
    if not path:
        raise RuntimeError(
            "this rank has no share of a DataFrame: only runs started over one "
            "(TorchEstimator.fit) have it")
    ready_fd = os.environ.get(READY_FD_VARIABLE)
    if ready_fd is not None:
        with os.fdopen(int(ready_fd), "rb") as ready:
            if ready.read(len(READY)) != READY:  # the task closed the pipe without the word
                raise RuntimeError(f"this rank's Spark task could not write its rows to {path}")
        del os.environ[READY_FD_VARIABLE]  # read once: the pipe is closed now
    # The table's buffers point into the mapping and keep it open while they live, so the
    # file can go at once: nothing is left on disk even if the task is killed later.
    table = pyarrow.ipc.open_file(pyarrow.memory_map(path)).read_all()
    os.remove(path)
    return table
