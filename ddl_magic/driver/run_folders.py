"""Each run keeps its logs (and its timeline, by default) in a folder of its own under
``<tmp>/ddl_magic-runs``; without pruning, an afternoon of cells left hundreds there. Before
a run makes its folder, the oldest are removed so that the newest ``DDL_MAGIC_KEEP_RUNS``
(default 50) remain, counting the new one. A folder written to in the last ten minutes is
never removed: it may be a run going on in another notebook.

Example::

    log_dir = new_run_folder(run_id)     # the oldest pruned first
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

KEEP_RUNS_VARIABLE = "DDL_MAGIC_KEEP_RUNS"
DEFAULT_KEEP_RUNS = 50
RECENT_S = 600.0
# Only folders named as runs are (run ids start with the time, so names sort by age).
_RUN_FOLDER = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")


def new_run_folder(run_id: str) -> str:
    """A new folder for the run `run_id` under ``<tmp>/ddl_magic-runs``, made once the oldest
    were pruned. Not "ddl_magic/...": a folder of that name in the working directory would
    shadow the package for ranks started there."""
    folder = os.path.join(tempfile.gettempdir(), "ddl_magic-runs", run_id)
    prune_run_folders(os.path.dirname(folder))
    os.makedirs(folder, exist_ok=True)
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
        names = sorted(name for name in os.listdir(runs_dir) if _RUN_FOLDER.fullmatch(name))
    except FileNotFoundError:
        return []
    now = time.time() if now is None else now
    removed = []
    for name in names[:max(len(names) - (keep - 1), 0)]:
        path = os.path.join(runs_dir, name)
        try:
            if now - _last_written(path) < RECENT_S:
                continue
            shutil.rmtree(path)
        except OSError:
            continue  # another kernel removed it, or is still writing there: leave it
        removed.append(path)
    return removed


def _last_written(folder: str) -> float:
    """The newest modification time of the folder or a file in it."""
    with os.scandir(folder) as entries:
        return max([os.stat(folder).st_mtime, *(entry.stat().st_mtime for entry in entries)])
