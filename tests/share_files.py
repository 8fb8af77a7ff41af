"""Which share files (`data/share_file.py`: unlinked as they are created) the processes on this
machine still hold: what a run leaves on disk, though no folder lists it."""

from __future__ import annotations

import os
import time


def held_share_files(folder) -> list[str]:
    """`pid: path` of every share file in `folder` that some process still holds open."""
    held = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(os.path.join(str(folder), "ddl_magic-share-")):
                    held.append(f"{pid}: {target}")
        except OSError:
            continue
    return held


def none_held_within(folder, timeout_s: float) -> list[str]:
    """[] once no process holds a share file in `folder` (processes that were told to end take
    a moment), or what is still held after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (held := held_share_files(folder)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held
