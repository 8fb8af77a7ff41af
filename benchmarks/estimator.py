"""Training on a Spark DataFrame: `TorchEstimator.fit(df)` against collecting the data first.

    python benchmarks/estimator.py              # 1,000,000 rows x 20 features (~2 minutes)
    python benchmarks/estimator.py --rows 100000

One epoch of the same MLP (20-64-2, batch 256 per rank, SGD) on 2 ranks of a local[4]
SparkSession, two ways:

1. **estimator**: ``TorchEstimator(num_proc=2).fit(df)``: the ranks' barrier stage runs over
   the DataFrame, each task hands its partition to its rank on local disk;
2. **collect**: ``df.toPandas()`` on the driver, then ``HorovodRunner(np=2).run(train)`` with
   the arrays in the function's closure (what users do without an estimator).

Each side first runs once on a few rows, so that neither pays for imports and Spark's first
Python workers in its measurement. While each runs, a thread samples the resident memory of this Python process (the driver)
and of Spark's JVM every 50 ms; the table shows how far each grew above where it started.
Target: the driver's RSS grows by at most 100 MB during `fit`. Then the Iris pipeline of
lab 1, ``VectorAssembler -> TorchEstimator`` against ``VectorAssembler ->
MultilayerPerceptronClassifier`` (layers [4, 5, 4, 3]), scored by the same evaluator
(target: TorchEstimator >= 0.9). Prints tables and writes ``benchmarks/results/estimator.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import psutil
import torch

from common import print_table, warn_if_busy, write_results

FEATURES = 20
BATCH_SIZE = 256
NUM_PROC = 2


class PeakMemory:
    """Samples the RSS of processes every `interval_s` while in use: growth above the start."""

    def __init__(self, processes: dict[str, psutil.Process], interval_s: float = 0.05):
        self._processes = processes
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.start = {name: process.memory_info().rss for name, process in processes.items()}
        self.peak = dict(self.start)

    def __enter__(self) -> PeakMemory:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            for name, process in self._processes.items():
                self.peak[name] = max(self.peak[name], process.memory_info().rss)

    def growth_mb(self) -> dict[str, float]:
        return {name: (self.peak[name] - self.start[name]) / 1e6 for name in self._processes}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 2))


def synthetic_rows(spark, rows: int):
    """`rows` rows of FEATURES random features and a label they decide, made on the executors."""
    from pyspark.sql import functions

    features = [functions.rand(seed=i).cast("float").alias(f"f{i}") for i in range(FEATURES)]
    frame = spark.range(0, rows, 1, 8).select(*features)
    label = ((functions.col("f0") + functions.col("f1")) > 1).cast("long").alias("label")
    return frame.select("*", label).cache()


def fit_with_estimator(df) -> float:
    from ddl_magic.spark.estimator import TorchEstimator

    model = make_model()
    estimator = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               loss=torch.nn.CrossEntropyLoss(),
                               feature_cols=[f"f{i}" for i in range(FEATURES)],
                               label_cols=["label"], batch_size=BATCH_SIZE, epochs=1,
                               num_proc=NUM_PROC, metrics=["accuracy"], verbose=0)
    fitted = estimator.fit(df)
    return fitted.history[-1]["accuracy"]


def fit_after_collecting(df) -> float:
    from ddl_magic import HorovodRunner

    frame = df.toPandas()
    features = frame[[f"f{i}" for i in range(FEATURES)]].to_numpy("float32")
    labels = frame["label"].to_numpy("int64")
    del frame

    def train(features, labels):
        import numpy as np
        import torch

        import ddl_magic.torch as hvd

        hvd.init()
        x = torch.from_numpy(features[hvd.rank()::hvd.size()])
        y = torch.from_numpy(labels[hvd.rank()::hvd.size()])
        model = make_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        steps = len(labels) // hvd.size() // BATCH_SIZE
        order = np.random.default_rng(hvd.rank()).permutation(len(y))
        correct = 0
        for step in range(steps):
            rows = order[step * BATCH_SIZE:(step + 1) * BATCH_SIZE]
            optimizer.zero_grad()
            outputs = model(x[rows])
            torch.nn.functional.cross_entropy(outputs, y[rows]).backward()
            optimizer.step()
            correct += int((outputs.argmax(dim=1) == y[rows]).sum())
        return float(hvd.allreduce(torch.tensor(correct / (steps * BATCH_SIZE)), op=hvd.Average))

    return HorovodRunner(np=NUM_PROC, driver_log_verbosity="log_callback_only").run(
        train, features=features, labels=labels)


def iris_pipelines(spark) -> dict[str, float]:
    from pyspark.ml import Pipeline
    from pyspark.ml.classification import MultilayerPerceptronClassifier
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler

    from ddl_magic.labs.datasets import IRIS_FEATURES, load_iris
    from ddl_magic.spark.estimator import TorchEstimator

    iris = spark.createDataFrame(load_iris().drop(columns=["species"]))
    train, test = iris.randomSplit([0.7, 0.3], seed=1)
    assembler = VectorAssembler(inputCols=list(IRIS_FEATURES), outputCol="features")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, 4),
                              torch.nn.Sigmoid(), torch.nn.Linear(4, 3))
    estimator = TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.02),
                               loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                               label_cols=["label"], batch_size=8, epochs=150, num_proc=NUM_PROC,
                               verbose=0)
    mlp = MultilayerPerceptronClassifier(layers=[4, 5, 4, 3], maxIter=200, seed=0)
    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    return {name: evaluator.evaluate(Pipeline(stages=[assembler, stage]).fit(train)
                                     .transform(test))
            for name, stage in (("TorchEstimator", estimator),
                                ("MultilayerPerceptronClassifier", mlp))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    load_before = warn_if_busy()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("DDL_MAGIC_DISPLAY", "text")
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[4]").appName("ddl_magic estimator benchmark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    driver = psutil.Process()
    jvm = next(child for child in driver.children(recursive=True) if "java" in child.name())
    df = synthetic_rows(spark, args.rows)
    df.count()  # materialise the cache: neither side pays for generating the rows
    for fit in (fit_with_estimator, fit_after_collecting):
        fit(df.limit(4 * BATCH_SIZE))  # imports and Spark's Python workers, paid once for both

    sides = {}
    for name, fit in (("estimator", fit_with_estimator), ("collect", fit_after_collecting)):
        with PeakMemory({"driver": driver, "jvm": jvm}) as memory:
            started = time.perf_counter()
            accuracy = fit(df)
            wall_s = time.perf_counter() - started
        sides[name] = {"wall_s": wall_s, "train_accuracy": accuracy,
                       "rss_growth_mb": memory.growth_mb()}
    print_table(f"{args.rows:,} rows x {FEATURES} features, 1 epoch, {NUM_PROC} ranks, local[4]",
                ["side", "wall s", "driver RSS +MB", "JVM RSS +MB", "train accuracy"],
                [[name, f"{side['wall_s']:.1f}", f"{side['rss_growth_mb']['driver']:.0f}",
                  f"{side['rss_growth_mb']['jvm']:.0f}", f"{side['train_accuracy']:.3f}"]
                 for name, side in sides.items()])
    print("target: driver RSS grows <= 100 MB during fit: "
          f"{'met' if sides['estimator']['rss_growth_mb']['driver'] <= 100 else 'MISSED'}")

    iris = iris_pipelines(spark)
    print_table("Iris, the same 30% held out, same evaluator", ["pipeline", "test accuracy"],
                [[f"VectorAssembler -> {name}", f"{value:.3f}"] for name, value in iris.items()])
    spark.stop()
    path = write_results("estimator", {
        "settings": {"rows": args.rows, "features": FEATURES, "batch_size": BATCH_SIZE,
                     "num_proc": NUM_PROC, "master": "local[4]", "epochs": 1},
        "load_average_before": load_before, "sides": sides, "iris_accuracy": iris,
        "targets": {"driver_rss_growth_mb": 100, "iris_accuracy": 0.9}})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
