"""A Spark task writes its rank's shares of the run's datasets, beside the rank.

When a run is given Spark DataFrames (`launch/spark_shares.py`), its barrier stage runs
over them, one partition per rank. Each task creates one share file per dataset on its
executor's local disk (files with no name: `data/share_file.py`), starts its rank with their
descriptors, and from its first moment (while a cold worker's rank factory imports torch,
then while the rank builds its model) writes the rows Spark hands it into them, in a thread
of its own, then says on a pipe that they are complete (or why they are not). The
rank's `Share` maps its file when first used (`data/sources.py`). Rows go from the executors
to the ranks without passing through the driver, and nothing is left on disk once the rank
and its task are gone, however they end.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable

import pyarrow
import pyarrow.compute

from ..data.share_file import ShareWriter
from ..data.sources import SHARES_VARIABLE


class TaskShares:
    """The share files of one rank, written by its task. `plan`: what the driver said of the
    datasets (`ShareStage.plan`): their names, Arrow schemas and expected rows per rank."""

    def __init__(self, plan: dict, rank: int):
        self.names: list[str] = list(plan["names"])
        self.writers = [
            ShareWriter(pyarrow.ipc.read_schema(pyarrow.py_buffer(schema)),
                        expected_rows=expected, what=f"rank {rank}'s share of {name!r}")
            for name, schema, expected in zip(self.names, plan["schemas"], plan["expected_rows"])]
        self._stopped = threading.Event()

    @property
    def fds(self) -> tuple[int, ...]:
        return tuple(writer.fd for writer in self.writers)

    def environment(self, ready_fd: int) -> dict[str, str]:
        """What the rank's process needs to find its shares: add to its environment."""
        handed = {"fds": {name: writer.fd for name, writer in zip(self.names, self.writers)},
                  "ready_fd": ready_fd}
        return {SHARES_VARIABLE: json.dumps(handed)}

    def write(self, batches: Iterable[pyarrow.RecordBatch], ready_fd: int) -> None:
        """Write the partition's rows (`mapInArrow`'s batches of the keyed union) into the
        datasets' files, then tell the rank on `ready_fd`, and close it: `{"rows": {...}}`,
        or `{"error": why}` (the rank raises it when it reads the share). Returns early,
        between two batches, once `stop()` was called."""
        try:
            for batch in batches:
                if self._stopped.is_set():
                    raise RuntimeError("the rank ended before its shares were written")
                self._route(batch)
            said = {"rows": {name: writer.finish().rows
                             for name, writer in zip(self.names, self.writers)}}
        except Exception as exc:  # the rank says it, naming this task's host and the dataset
            said = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(ready_fd, "wb") as ready:
            ready.write(json.dumps(said).encode())

    def stop(self) -> None:
        """Have `write` (in another thread) stop at its next batch: the rank is gone."""
        self._stopped.set()

    def close(self) -> None:
        """Close what the task still holds of the files (their descriptors went to the rank,
        which closed them here once it started: `spark_task.run_rank`)."""
        for writer in self.writers:
            writer.close_sink()

    def _route(self, batch: pyarrow.RecordBatch) -> None:
        datasets = batch.column(1)  # launch/spark_shares.py's DATASET_COLUMN
        for index, writer in enumerate(self.writers):
            rows = batch if len(self.writers) == 1 else batch.filter(
                pyarrow.compute.equal(datasets, index))
            if rows.num_rows == 0:
                continue
            fields = rows.column(2 + index).flatten()
            writer.write(pyarrow.RecordBatch.from_arrays(fields, names=writer.schema.names))
