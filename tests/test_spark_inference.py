"""`predict_batches`: a model's predictions as a DataFrame column, on a real local SparkSession
(classic and Spark Connect)."""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("pyspark")
from pyspark.sql import functions

from ddl_magic.spark.inference import predict_batches, torch_classifier

ROWS_PER_BATCH_FROM_SPARK = 10


@pytest.fixture(scope="module", autouse=True)
def small_arrow_batches(spark):
    """Small Arrow batches, so a partition reaches the Python worker as several."""
    setting = "spark.sql.execution.arrow.maxRecordsPerBatch"
    previous = spark.conf.get(setting)
    spark.conf.set(setting, str(ROWS_PER_BATCH_FROM_SPARK))
    yield
    spark.conf.set(setting, previous)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    path = tmp_path_factory.mktemp("model") / "linear.pt"
    torch.save(model.state_dict(), path)
    return str(path)


def make_loader(model_path, log_path=None):
    """A load_model for the executors that, when given `log_path`, notes each call there."""
    def load_model():
        if log_path is not None:
            with open(log_path, "a") as log:
                log.write(f"{os.getpid()}\n")
        model = torch.nn.Linear(6, 3)
        model.load_state_dict(torch.load(model_path))
        return model
    return load_model


def partitions_holding_rows(df) -> list[int]:
    ids = df.select(functions.spark_partition_id().alias("p")).distinct().collect()
    return sorted(row.p for row in ids)


def local_predictions(model_path, features):
    return torch_classifier(make_loader(model_path)(), features)


def features_table(rows, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, 6)).astype(np.float32)


def test_array_column_predictions_match_the_model_run_locally(spark, model_path):
    features = features_table(100)
    df = spark.createDataFrame([(i, row.tolist()) for i, row in enumerate(features)],
                               "id long, pixels array<float>").repartition(2)
    scored = predict_batches(df, make_loader(model_path), ["pixels"], batch_rows=7)
    assert scored.columns == ["id", "pixels", "prediction"]
    got = {row.id: row.prediction for row in scored.collect()}
    expected = local_predictions(model_path, features)
    assert len(got) == 100
    assert [got[i] for i in range(100)] == expected.tolist()
    assert len(set(expected.tolist())) > 1  # the check would not notice a constant output


def test_scalar_and_array_columns_are_laid_side_by_side_in_the_order_given(spark, model_path):
    features = features_table(30, seed=1)
    rows = [(i, float(r[0]), float(r[1]), r[2:].tolist()) for i, r in enumerate(features)]
    df = spark.createDataFrame(rows, "id long, a double, b double, rest array<double>")
    scored = predict_batches(df, make_loader(model_path), ["a", "b", "rest"], output_col="digit")
    got = {row.id: row.digit for row in scored.collect()}
    assert [got[i] for i in range(30)] == local_predictions(model_path, features).tolist()


def test_the_model_is_loaded_once_per_task_not_once_per_batch(spark, model_path, tmp_path):
    loads, batches = tmp_path / "loads.txt", tmp_path / "batches.txt"

    def counting_predict(model, x):
        with open(batches, "a") as log:
            log.write(f"{len(x)}\n")
        return torch_classifier(model, x)

    df = spark.createDataFrame([(row.tolist(),) for row in features_table(100)],
                               "pixels array<float>").repartition(2)
    scored = predict_batches(df, make_loader(model_path, loads), ["pixels"],
                             predict=counting_predict, batch_rows=7)
    assert len(scored.select("prediction").collect()) == 100
    batch_sizes = [int(n) for n in batches.read_text().split()]
    assert sum(batch_sizes) == 100
    assert max(batch_sizes) <= 7
    assert len(batch_sizes) >= 100 // ROWS_PER_BATCH_FROM_SPARK
    assert len(loads.read_text().split()) == len(partitions_holding_rows(df)) == 2


def test_an_empty_partition_does_not_load_the_model(spark, model_path, tmp_path):
    loads = tmp_path / "loads.txt"
    pixels = functions.array(*map(functions.lit, features_table(1)[0].tolist()))
    # range puts row i in partition i; the filter keeps the partitions, and empties two.
    df = (spark.range(0, 4, 1, 4).where("id < 2")
          .select(pixels.cast("array<float>").alias("pixels")))
    assert partitions_holding_rows(df) == [0, 1]
    scored = predict_batches(df, make_loader(model_path, loads), ["pixels"])
    assert len(scored.select("prediction").collect()) == 2
    assert len(loads.read_text().split()) == 2


def test_a_custom_predict_and_output_type(spark):
    df = spark.createDataFrame([(1.0, 2.0), (3.0, 4.0)], "x double, y double")
    scored = predict_batches(df, lambda: 10.0, ["x", "y"], output_col="score",
                             predict=lambda scale, x: x.sum(axis=1) * scale, output_type="double")
    assert [row.score for row in scored.orderBy("x").collect()] == [30.0, 70.0]


def test_predict_must_return_one_value_per_row(spark):
    df = spark.createDataFrame([(1.0,), (2.0,), (3.0,)], "x double").coalesce(1)  # one batch of 3
    scored = predict_batches(df, lambda: None, ["x"], predict=lambda model, x: [0])
    with pytest.raises(Exception, match="predict returned 1 values for a batch of"):
        scored.collect()


def test_mistakes_in_the_call_are_named_before_spark_runs_anything(spark):
    df = spark.createDataFrame([(1.0, 0)], "x double, prediction long")
    with pytest.raises(ValueError, match=r"\['pixels'\] are not columns"):
        predict_batches(df, lambda: None, ["pixels"])
    with pytest.raises(ValueError, match="already has a column 'prediction'"):
        predict_batches(df, lambda: None, ["x"])
    with pytest.raises(ValueError, match="feature_cols is empty"):
        predict_batches(df, lambda: None, [])
    with pytest.raises(TypeError, match="load_model must be a function"):
        predict_batches(df, "model.pt", ["x"], output_col="p")
