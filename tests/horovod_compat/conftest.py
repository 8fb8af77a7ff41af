"""Horovod's own test files, vendored to check that ddl_magic runs them unchanged.

`test_torch_elastic.py` is meant for two ranks (Horovod's CI runs it under `horovodrun -np
2`), and its `hvd.init()` must not run inside the test session, so a plain `pytest tests`
leaves it alone: `tests/test_horovod_elastic_compat.py` runs it under
`ddlrun -np 2` (with `--noconftest`, so this file does not hide it there), and
`tests/horovod_elastic_compat.py` runs it beside the kill and exception schedules.
"""

collect_ignore = ["test_torch_elastic.py"]
