"""Launchers start the ranks of a run: local processes, or Spark barrier tasks."""

from __future__ import annotations

import sys


def spark_session():
    """The SparkSession ranks would run on, or None (pyspark is not imported for the asking).

    pyspark's *active* session is per thread, so a notebook that runs HorovodRunner from
    another thread would find none; the *default* session, the builder's, serves every
    thread, as `SparkSession.active()` (pyspark 3.5+) also falls back to it.
    """
    if "pyspark" not in sys.modules:
        return None
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)
