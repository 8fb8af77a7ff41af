"""Front-ends: how a user starts a run, all in the notebook's (or the shell's) process.

The `%%horovod` magic, `HorovodRunner`, the `@distributed` decorator, pyspark's
`TorchDistributor` shape, the `ddlrun` command and `python -m ddl_magic demo`: each turns what
the user wrote into a task and `JobOptions`, picks a display, and hands them to `driver.Job`.
"""
