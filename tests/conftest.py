"""Fixtures shared by the test modules."""

import os
import shutil
import sys

import pytest


@pytest.fixture(scope="module")
def spark():
    """A local SparkSession with 4 task slots, one per test module (a cold start takes ~5 s)."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java")
    from pyspark.sql import SparkSession

    with pytest.MonkeyPatch.context() as patch:
        # Read when the session starts: Spark's Python workers are this Python, on loopback.
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        session = (SparkSession.builder.master("local[4]").appName("ddl_magic tests")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "4")
                   .getOrCreate())
        session.sparkContext.setLogLevel("ERROR")
        yield session
        session.stop()
