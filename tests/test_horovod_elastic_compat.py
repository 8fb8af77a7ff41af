"""CI's short version of `horovod_elastic_compat.py`: Horovod's elastic unit tests under
`ddlrun -np 2`, and two of its integration test's exit schedules, run on ddl_magic with
`import horovod.torch as hvd` changed to `import ddl_magic.torch as hvd` and nothing else."""

import pytest

from horovod_elastic_compat import SCHEDULES, SHORT, run_schedule, run_unit_tests

RUN_TIMEOUT_S = 90.0  # each run takes 3 to 5 s alone, several times that beside another test process; past this it is stopped with its ranks


@pytest.mark.timeout(180)
def test_horovods_torch_elastic_unit_tests_pass_on_two_ranks():
    outcome = run_unit_tests(RUN_TIMEOUT_S)
    assert outcome.ok, outcome.detail


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s.name in SHORT], ids=lambda schedule: schedule.name)
def test_horovods_elastic_training_script_survives_its_exit_schedule(schedule):
    outcome = run_schedule(schedule, RUN_TIMEOUT_S)
    assert outcome.ok, f"{schedule.maps}\n{outcome.detail}"
