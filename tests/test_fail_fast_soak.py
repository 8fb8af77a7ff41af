"""CI's short version of `fail_fast_soak.py`: real `ddlrun` runs of healthy and failing
workloads beside busy processes: no healthy run fails, every failing one is named right and
in time. The default run makes 8 (every kind of failure, the quick healthy workloads); the
long checks 20 (the slow healthy ones too: the GIL held in native code, a Spark fit)."""

import pytest

from fail_fast_soak import FAILING, report, soak

BUSY_PROCESSES = 2  # the full soak runs 200 beside 4; on CI's two cores this keeps it short


@pytest.mark.parametrize("runs", [8, pytest.param(20, marks=pytest.mark.long)])
def test_runs_beside_busy_processes_no_false_failure_and_every_failure_named(runs):
    outcomes = soak(runs, BUSY_PROCESSES, short=True)
    summary = report(outcomes, BUSY_PROCESSES)
    wrong = [(o.workload, o.detail) for o in outcomes if not o.ok]
    assert not wrong, wrong
    assert summary["false_failures"] == 0
    assert {o.workload for o in outcomes if o.expected_failure} == set(FAILING)
