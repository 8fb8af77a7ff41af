"""Each run keeps its logs (and its timeline, by default) in a folder of its own under
``<tmp>/ddl_magic-runs``, named by its id (`new_run_id`: a one-shot run's, or a pool's,
whose cells keep theirs inside it); without pruning, an afternoon of cells left hundreds
there. Before a run makes its folder, the oldest are removed so that the newest
``DDL_MAGIC_KEEP_RUNS`` (default 50) remain, counting the new one. A folder is never removed
while its run (or pool) goes on, in this notebook or another: the run holds a lock on it
(`RunFolder.release` lets it go); nor one written to in the last ten minutes (a run of an
older ddl_magic, which holds no lock).

Example::

    folder = new_run_folder(new_run_id())     # the oldest pruned first
    ...
    folder.release()                          # the run ended: the folder may go, in its turn
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time
import uuid

KEEP_RUNS_VARIABLE = "DDL_MAGIC_KEEP_RUNS"
DEFAULT_KEEP_RUNS = 50
RECENT_S = 600.0
POOL_PREFIX = "pool-"
# Only folders named as runs are: a run's id, or a pool's. Ids start with the time, so the
# time sorts them by age.
_RUN_FOLDER = re.compile(rf"(?:{POOL_PREFIX})?(\d{{8}}-\d{{6}}-[0-9a-f]{{6}})")
_IN_USE = ".in-use"  # the lock file a running run holds


def new_run_id(pool: bool = False) -> str:
    """A new run's id: its start time and a random tail, '20261127-130102-4a9ede' (a pool's
    starts with 'pool-')."""
    return (POOL_PREFIX if pool else "") + time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


class RunFolder(str):
    """A run's folder (a path: a `str`), held against pruning until `release`."""

    _lock: int | None = None

    def release(self) -> None:
        """The run is over: from now on its folder may be pruned like any other."""
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)


def new_run_folder(run_id: str) -> RunFolder:
    """A new folder for the run `run_id` under ``<tmp>/ddl_magic-runs``, made once the oldest
    were pruned, and held for the run. Not "ddl_magic/...": a folder of that name in the
    working directory would shadow the package for ranks started there."""
    path = os.path.join(tempfile.gettempdir(), "ddl_magic-runs", run_id)
    prune_run_folders(os.path.dirname(path))
    os.makedirs(path, exist_ok=True)
    folder = RunFolder(path)
    folder._lock = os.open(os.path.join(path, _IN_USE), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC)
    fcntl.flock(folder._lock, fcntl.LOCK_SH)
    return folder


def runs_to_keep() -> int:
    """How many run folders to keep, from ``DDL_MAGIC_KEEP_RUNS``; a bad value is refused."""
    value = os.environ.get(KEEP_RUNS_VARIABLE, "").strip()
    if not value:
        return DEFAULT_KEEP_RUNS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{KEEP_RUNS_VARIABLE}={value!r}: set it to how many runs' log folders to "
                         f"keep, a whole number of at least 1 (default {DEFAULT_KEEP_RUNS})")
    return int(value)


def prune_run_folders(runs_dir: str, now: float | None = None) -> list[str]:
    """Remove the oldest run folders in ``runs_dir`` so that, with the run about to start,
    ``runs_to_keep()`` remain; returns the paths removed."""
    keep = runs_to_keep()
    try:
        runs = sorted((started.group(1), name) for name in os.listdir(runs_dir)
                      if (started := _RUN_FOLDER.fullmatch(name)))
    except FileNotFoundError:
        return []
    now = time.time() if now is None else now
    removed = []
    for started, name in runs[:max(len(runs) - (keep - 1), 0)]:
        if now - _started_at(started) < RECENT_S:
            break  # this run and every later one began in the last minutes: none is due
        path = os.path.join(runs_dir, name)
        try:
            if now - _last_written(path) < RECENT_S or _held(path):
                continue
            shutil.rmtree(path)
        except OSError:
            continue  # another kernel removed it, or is still writing there: leave it
        removed.append(path)
    return removed


def _started_at(started: str) -> float:
    """When a run began, from its id's local time ("20260101-120000-…"), to the second."""
    return time.mktime(time.strptime(started[:15], "%Y%m%d-%H%M%S"))


def _held(folder: str) -> bool:
    """Whether a run (of any process) still holds `folder`."""
    try:
        lock = os.open(os.path.join(folder, _IN_USE), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(lock)


def _last_written(folder: str) -> float:
    """The newest modification time of the folder or a file in it."""
    with os.scandir(folder) as entries:
        return max([os.stat(folder).st_mtime, *(entry.stat().st_mtime for entry in entries)])
