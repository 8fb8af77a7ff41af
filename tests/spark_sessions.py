"""What the Spark tests need to know about the session they were given, classic or Connect."""

import pytest


def spark_context():
    """The SparkContext behind this process's session, classic or local Connect."""
    from pyspark import SparkContext

    return SparkContext._active_spark_context


def classic_only(spark, why: str) -> None:
    """Skip a test that needs what only a classic session offers (`why` says what)."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        pytest.skip(f"classic sessions only: {why}")


def no_spark_job_active() -> bool:
    return not spark_context().statusTracker().getActiveJobsIds()
