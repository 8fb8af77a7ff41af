"""Launchers start the ranks of a run: local processes, or Spark barrier tasks."""

from __future__ import annotations

import sys


def spark_session():
    """The SparkSession ranks would run on, or None (pyspark is not imported for the asking).

    A notebook's Spark Connect session comes first: a local one (``remote("local[4]")``)
    runs its server on a classic session in this same process, which is not the user's.
    pyspark's *active* session is per thread, so a notebook that runs HorovodRunner from
    another thread would find none; the *default* session, the builder's, serves every
    thread, and `SparkSession.active()` falls back to it.
    """
    if "pyspark" not in sys.modules:
        return None
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession

    kinds = [SparkSession]
    connect = sys.modules.get("pyspark.sql.connect.session")
    if connect is not None:
        kinds.insert(0, connect.SparkSession)
    for kind in kinds:
        try:
            return kind.active()
        except PySparkRuntimeError:  # NO_ACTIVE_OR_DEFAULT_SESSION: try the next kind
            continue
    return None
