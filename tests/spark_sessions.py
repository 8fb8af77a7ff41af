"""What the Spark tests share: the session they were given (classic or Connect), and
sending test code to the executors."""

import contextlib

import cloudpickle
import pytest


def spark_context():
    """The SparkContext behind this process's session, classic or local Connect."""
    from pyspark import SparkContext

    return SparkContext._active_spark_context


def is_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def classic_only(spark, why: str) -> None:
    """Skip a test that needs what only a classic session offers (`why` says what)."""
    if is_connect(spark):
        pytest.skip(f"classic sessions only: {why}")


def connect_only(spark, why: str) -> None:
    """Skip on a classic session a test that another test already runs there (`why` says which)."""
    if not is_connect(spark):
        pytest.skip(f"Spark Connect only: {why}")


def no_spark_job_active() -> bool:
    return not spark_context().statusTracker().getActiveJobsIds()


@contextlib.contextmanager
def sent_by_value(*modules):
    """Within, cloudpickle sends these modules' functions and classes by value, as a
    notebook's are sent: the executors cannot import test files."""
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)
