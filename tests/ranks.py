"""Running a test function on real ranks (local processes) and getting every rank's return value."""

from __future__ import annotations

from ddl_magic.job import Job, JobOptions
from ddl_magic.launch.local import LocalLauncher
from ddl_magic.tasks import FunctionTask


def run_on_ranks(function, np: int, timeout_s: float = 90, env: dict | None = None, **kwargs) -> list:
    """`function(**kwargs)` on `np` local ranks; the list of their return values, in rank order."""
    options = JobOptions(timeout_s=timeout_s, return_all=True, hide_output=True, env=env or {})
    return Job(FunctionTask(function, kwargs), np, LocalLauncher(), options).run().results
