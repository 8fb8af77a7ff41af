"""The driver: one run, watched from the notebook's process.

`job.Job` starts the ranks through a launcher, serves them (`control`), applies their events
(`events`, `records`), decides which failure caused the others (`attribution`, pure) and
keeps the result (`RunResult`, `last_run`). Nothing here runs on a rank.
"""
