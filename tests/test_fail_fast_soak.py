"""CI's short version of `fail_fast_soak.py`: 20 real `ddlrun` runs of healthy and failing
workloads beside busy processes: no healthy run fails, every failing one is named right and
in time."""

from fail_fast_soak import FAILING, report, soak

RUNS = 20
BUSY_PROCESSES = 2  # the full soak runs 200 beside 4; on CI's two cores this keeps it short


def test_twenty_runs_beside_busy_processes_no_false_failure_and_every_failure_named():
    outcomes = soak(RUNS, BUSY_PROCESSES, short=True)
    summary = report(outcomes, BUSY_PROCESSES)
    wrong = [(o.workload, o.detail) for o in outcomes if not o.ok]
    assert not wrong, wrong
    assert summary["false_failures"] == 0
    assert {o.workload for o in outcomes if o.expected_failure} == set(FAILING)
