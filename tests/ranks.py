"""Running a test function on real ranks (local processes) and getting every rank's return value."""

from __future__ import annotations

import pytest

from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.launch.local import LocalLauncher
from ddl_magic.wire.tasks import FunctionTask


CUDA_RUN_TIMEOUT_S = 220
"""A run on CUDA tensors: Triton compiles each kernel the first time a rank uses it (dozens
of dtypes and ops, on a cold cache), so a first run may take minutes where it takes seconds
after. The tests' own pytest limit is above it (the run's timeout names the ranks), and both
within the GPU check's step limit (240 s)."""


def run_on_ranks(function, np: int, timeout_s: float = 90, env: dict | None = None, **kwargs) -> list:
    """`function(**kwargs)` on `np` local ranks; the list of their return values, in rank order."""
    options = JobOptions(timeout_s=timeout_s, return_all=True, hide_output=True, env=env or {})
    return Job(FunctionTask(function, kwargs), np, LocalLauncher(), options).run().results


def reports_per_setup(run_all_checks, timeout_s: float):
    """(np, hosts) -> every rank's report from `run_all_checks` on that setup, run once per
    setup. `hosts` ("a,b,a,b": the host of each rank, or None) simulates several hosts."""
    cache = {}

    def for_setup(np: int, hosts: str | None) -> list:
        if (np, hosts) not in cache:
            with pytest.MonkeyPatch.context() as patch:
                if hosts:  # read by each rank as it registers, from the environment it inherits
                    patch.setenv("DDL_MAGIC_TEST_HOSTS", hosts)
                cache[np, hosts] = run_on_ranks(run_all_checks, np, timeout_s=timeout_s)
        return cache[np, hosts]

    return for_setup


def failures_of(reports: list, check: str) -> dict:
    """{rank: its failures} of one check, for the ranks that have any."""
    return {rank: report[check] for rank, report in enumerate(reports) if report[check]}
