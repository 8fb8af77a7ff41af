"""The DataFrame every side of `data.py` reads, made the same way in each process: `rows` rows
of a 784-float32 vector (an MNIST image's size) and an int label, on `local[4]`, cached.
No ddl_magic here: the peers' benchmark imports it from its own virtual environment."""

from __future__ import annotations

import os
import sys

WIDTH = 784


def local_spark(memory: str = "6g"):
    """A local[4] SparkSession as the tests make it, with room to cache the DataFrame."""
    # This Python, also where the caller's environment names another (`data.py` starts the
    # peers' script from its own venv): Spark's Python workers must run the driver's pyspark.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[4]").appName("ddl_magic data benchmark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", memory)
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def make_frame(spark, rows: int):
    """The benchmark's DataFrame, computed and cached before anything is timed."""
    from pyspark.sql import functions

    pixel = ((functions.col("id") % 255) / 255.0).cast("float")
    frame = spark.range(0, rows, 1, 4).select(
        functions.array_repeat(pixel, WIDTH).alias("features"),
        (functions.col("id") % 10).cast("int").alias("label"))
    frame = frame.cache()
    frame.count()
    return frame
