"""ddl_magic: distributed deep learning from a notebook cell."""

from .job import RankFailedError, RunResult, last_run

__all__ = ["RankFailedError", "RunResult", "last_run"]
__version__ = "0.1.0"
