"""The driver: one run, watched from the notebook's process.

`job.Job` starts the ranks through a launcher and serves them (`control`); its `watcher`
applies their events (`events`, `records`) and the verdict on which failure caused the
others (`attribution`, pure); the run's record is a `run_result.RunResult` (`job.last_run`).
Nothing here runs on a rank.
"""
