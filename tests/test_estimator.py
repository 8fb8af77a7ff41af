"""`TorchEstimator` / `TorchModel` on a real local SparkSession, classic and Spark Connect.

Each fit is a real run: a barrier stage over the DataFrame, ranks training on the rows their
tasks hand them. A model that notes the rows it trains on (`RowNotingNet`) lets the tests
check which rows each epoch saw.
"""

import glob
import os
import sys
import tempfile
import threading

import pytest
import torch

pytest.importorskip("pyspark")
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions

from ddl_magic.labs.datasets import IRIS_FEATURES, load_iris
from ddl_magic.spark.estimator import TorchEstimator, TorchModel
from ddl_magic.driver.run_result import RankFailedError
from spark_sessions import classic_only, connect_only, no_spark_job_active, sent_by_value
from trace_files import chrome_events, columnar_events


@pytest.fixture(scope="module", autouse=True)
def functions_travel_by_value():
    with sent_by_value(sys.modules[__name__]):
        yield


class RowNotingNet(torch.nn.Module):
    """Scores two classes from every feature but the first, a row id: in training mode each
    forward pass appends the ids it was given to `notes_dir/<pid>.txt`."""

    def __init__(self, notes_dir: str, features: int):
        super().__init__()
        self.notes_dir = notes_dir
        self.linear = torch.nn.Linear(features - 1, 2)

    def forward(self, x):
        if self.training:
            with open(os.path.join(self.notes_dir, f"{os.getpid()}.txt"), "a") as notes:
                notes.write("".join(f"{int(row_id)}\n" for row_id in x[:, 0]))
        return self.linear(x[:, 1:])


def shards_left() -> list[str]:
    """Shares a process of this test session still holds (files with no name: nothing is
    ever left on disk), or left on disk by name (never)."""
    import psutil

    named = glob.glob(os.path.join(tempfile.gettempdir(), "**", "ddl_magic-share-*"),
                      recursive=True)
    held = []
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            held += [target for fd in os.listdir(f"/proc/{process.pid}/fd")
                     if "ddl_magic-share-" in (target := os.readlink(f"/proc/{process.pid}/fd/{fd}"))]
        except OSError:
            continue
    return named + held


def rows_trained_on(notes_dir) -> list[int]:
    return [int(line) for path in sorted(notes_dir.glob("*.txt"))
            for line in path.read_text().split()]


def noting_estimator(notes_dir, features=2, **params):
    torch.manual_seed(0)
    model = RowNotingNet(str(notes_dir), features)
    defaults = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    loss=torch.nn.CrossEntropyLoss(), feature_cols=["id_feature", "x"],
                    label_cols=["label"], batch_size=10, epochs=1, num_proc=2)
    return TorchEstimator(**{**defaults, **params})


def numbered_rows(spark, rows, partitions):
    """`rows` rows: a row id (as a feature too), a number and a 0/1 label."""
    return (spark.range(0, rows, 1, partitions)
            .select("id", functions.col("id").cast("float").alias("id_feature"),
                    (functions.col("id") % 7).cast("double").alias("x"),
                    (functions.col("id") % 2).alias("label")))


@pytest.mark.long_on_connect  # Spark Connect runs in CI: spark_launcher, estimator, inference
def test_a_pipeline_with_vector_assembler_trains_iris_as_well_as_spark_mls_mlp(spark):
    connect_only(spark, "on a classic session, lab 1 runs this pipeline in CI "
                        "(test_example_notebooks.py)")
    iris = spark.createDataFrame(load_iris().drop(columns=["species"]))
    train, test = iris.randomSplit([0.7, 0.3], seed=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4),
                              torch.nn.ReLU(), torch.nn.Linear(4, 3))
    estimator = TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.02),
                               loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                               label_cols=["label"], batch_size=8, epochs=60, num_proc=2,
                               validation=0.2, metrics=["accuracy"])
    assembler = VectorAssembler(inputCols=list(IRIS_FEATURES), outputCol="features")
    fitted = Pipeline(stages=[assembler, estimator]).fit(train)

    scored = fitted.transform(test)
    assert set(scored.columns) == {*test.columns, "features", "prediction"}
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy >= 0.9
    history = fitted.stages[-1].history
    assert [row["epoch"] for row in history] == list(range(60))
    assert set(history[-1]) == {"epoch", "loss", "accuracy", "val_loss", "val_accuracy"}
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.mark.long_on_connect
def test_predictions_are_the_trained_modules_on_array_and_scalar_columns(spark, tmp_path):
    df = (numbered_rows(spark, 60, 3)
          .withColumn("pair", functions.array(functions.col("x"), functions.col("x") * 2)))
    estimator = noting_estimator(tmp_path, features=4,
                                 feature_cols=["id_feature", "pair", "x"], epochs=2)
    model = estimator.fit(df)
    module = model.getModel()
    assert isinstance(module, RowNotingNet)

    rows = model.transform(df).orderBy("id").collect()
    inputs = torch.tensor([[row.id_feature, *row.pair, row.x] for row in rows])
    module.eval()
    expected = module(inputs).argmax(dim=-1).double().tolist()
    assert [row.prediction for row in rows] == expected
    assert model.transform(df).schema["prediction"].dataType.simpleString() == "double"


@pytest.mark.long_on_connect
@pytest.mark.parametrize("num_proc", [2, 3])
def test_each_epoch_sees_every_row_once_however_uneven_the_partitions(spark, tmp_path, num_proc):
    # 8 partitions of 125 rows; the filter empties five and leaves two partial.
    df = numbered_rows(spark, 1000, 8).where("id < 300 or id >= 900")
    estimator = noting_estimator(tmp_path, num_proc=num_proc, batch_size=16)
    estimator.fit(df)
    seen = rows_trained_on(tmp_path)
    assert len(seen) == len(set(seen)), "a row was trained on twice in one epoch"
    assert set(seen) <= set(range(300)) | set(range(900, 1000))
    # Every rank takes the same number of full batches: at most a batch and a row per rank
    # (the round robin split differs by one row) is left out.
    assert 400 - num_proc * 17 < len(seen) <= 400
    assert len(seen) % (num_proc * 16) == 0
    assert shards_left() == []


@pytest.mark.long_on_connect
def test_a_validation_column_holds_rows_out_of_training(spark, tmp_path):
    df = numbered_rows(spark, 200, 4).withColumn("held_out", functions.col("id") >= 150)
    model = noting_estimator(tmp_path, validation="held_out", metrics=["accuracy"]).fit(df)
    assert max(rows_trained_on(tmp_path)) < 150
    assert {"val_loss", "val_accuracy"} <= set(model.history[0])


@pytest.mark.long_on_connect
def test_a_fraction_holds_out_that_share_of_the_rows(spark, tmp_path):
    df = numbered_rows(spark, 400, 4)
    model = noting_estimator(tmp_path, validation=0.25, batch_size=5).fit(df)
    assert len(rows_trained_on(tmp_path)) == 300
    assert "val_loss" in model.history[0]


@pytest.mark.long_on_connect
def test_save_and_load_give_the_same_predictions_and_history(spark, tmp_path):
    df = numbered_rows(spark, 60, 2)
    model = noting_estimator(tmp_path, epochs=2).fit(df)
    path = str(tmp_path / "saved")
    model.save(path)
    with pytest.raises(FileExistsError, match=r"overwrite\(\)"):
        model.save(path)
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)

    assert loaded.uid == model.uid and loaded.history == model.history
    assert loaded.getFeatureCols() == ["id_feature", "x"]
    predictions = [row.prediction for row in model.transform(df).orderBy("id").collect()]
    assert [row.prediction for row in loaded.transform(df).orderBy("id").collect()] == predictions


def test_a_model_saves_to_a_folder_the_driver_reads_and_loads_as_its_own_class(tmp_path):
    model = TorchModel(model=torch.nn.Linear(2, 2), feature_cols=["x"], history=[{"loss": 1.0}])
    with pytest.raises(ValueError, match="TorchModel is saved to a folder .* not 's3://b/model'"):
        model.save("s3://b/model")
    model.save(f"file://{tmp_path}/model")  # as Spark names a pipeline's stage folders
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getFeatureCols() == ["x"] and loaded.history == [{"loss": 1.0}]
    with pytest.raises(ValueError, match="holds a ddl_magic.estimator.TorchModel, not a "
                                         "ddl_magic.estimator.TorchEstimator"):
        TorchEstimator.load(str(tmp_path / "model"))
    with pytest.raises(FileNotFoundError, match="holds no saved TorchModel"):
        TorchModel.load(str(tmp_path))


def scaled_pipeline(estimator):
    """Spark's own stages before ours: an assembler, and a scaler that is fitted too."""
    return [VectorAssembler(inputCols=["id_feature", "x"], outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="scaled"), estimator]


def predictions(model, df) -> list[float]:
    return [row.prediction for row in model.transform(df).orderBy("id").collect()]


@pytest.mark.long_on_connect
def test_a_fitted_pipeline_saves_and_loads_with_spark_ml_persistence(spark, tmp_path):
    df = numbered_rows(spark, 60, 2)
    estimator = noting_estimator(tmp_path, feature_cols=["scaled"], epochs=2)
    fitted = Pipeline(stages=scaled_pipeline(estimator)).fit(df)
    path = str(tmp_path / "pipeline_model")
    fitted.save(path)

    loaded = PipelineModel.load(path)
    torch_model, loaded_torch_model = fitted.stages[-1], loaded.stages[-1]
    assert isinstance(loaded_torch_model, TorchModel)
    assert loaded_torch_model.uid == torch_model.uid
    assert loaded_torch_model.history == torch_model.history
    trained = torch_model.getModel().state_dict()
    for name, weights in loaded_torch_model.getModel().state_dict().items():
        assert torch.equal(weights, trained[name]), name
    assert predictions(loaded, df) == predictions(fitted, df)


@pytest.mark.long_on_connect
def test_a_pipeline_with_an_unfitted_estimator_saves_loads_and_fits_alike(spark, tmp_path):
    df = numbered_rows(spark, 60, 2)
    estimator = noting_estimator(tmp_path, feature_cols=["scaled"], epochs=2, batch_size=5,
                                 metrics=["accuracy"])
    pipeline = Pipeline(stages=scaled_pipeline(estimator))
    path = str(tmp_path / "pipeline")
    pipeline.save(path)

    loaded = Pipeline.load(path)
    loaded_estimator = loaded.getStages()[-1]
    assert isinstance(loaded_estimator, TorchEstimator) and loaded_estimator.uid == estimator.uid
    assert loaded_estimator.getOrDefault("batch_size") == 5
    assert loaded_estimator.getOrDefault("metrics") == ["accuracy"]
    loaded_optimizer = loaded_estimator.getOrDefault("optimizer")
    assert type(loaded_optimizer) is torch.optim.SGD and loaded_optimizer.defaults["lr"] == 0.1
    # Fitted from the same initial weights with the same seed: the same model.
    refitted, fitted = loaded.fit(df), pipeline.fit(df)
    trained = fitted.stages[-1].getModel().state_dict()
    for name, weights in refitted.stages[-1].getModel().state_dict().items():
        assert torch.equal(weights, trained[name]), name
    assert predictions(refitted, df) == predictions(fitted, df)


@pytest.mark.long  # five fits: each param map on each of two folds, then the best on all
@pytest.mark.timeout(300)  # ~55 s alone, twice that beside the other long checks
def test_cross_validation_fits_each_param_map_on_a_copy(spark, tmp_path):
    classic_only(spark, "the copies are made on the driver, the same on either kind of "
                        "session; fits on Connect are the other tests'")
    df = numbered_rows(spark, 80, 2)
    estimator = noting_estimator(tmp_path)
    initial = {name: weights.clone() for name, weights in
               estimator.getOrDefault("model").state_dict().items()}
    own_optimizer = estimator.getOrDefault("optimizer")
    parameters = list(estimator.getOrDefault("model").parameters())
    frozen, learning = (torch.optim.SGD(parameters, lr=0.0), torch.optim.SGD(parameters, lr=0.5))
    grid = ParamGridBuilder().addGrid(estimator.optimizer, [frozen, learning]).build()
    validator = CrossValidator(estimator=estimator, estimatorParamMaps=grid, numFolds=2,
                               evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
                               collectSubModels=True, seed=1)
    cross_validated = validator.fit(df)

    assert len(cross_validated.avgMetrics) == 2
    for fold in cross_validated.subModels:
        unchanged, trained = (model.getModel().state_dict() for model in fold)
        assert all(torch.equal(unchanged[name], initial[name]) for name in initial)  # lr=0
        assert not all(torch.equal(trained[name], initial[name]) for name in initial)
    assert isinstance(cross_validated.bestModel, TorchModel)
    assert estimator.getOrDefault("optimizer") is own_optimizer
    assert estimator.getOrDefault("model").state_dict()["linear.weight"].equal(
        initial["linear.weight"]), "fitting changed the estimator's own model"


@pytest.mark.long_on_connect
def test_a_second_fit_with_the_same_run_id_resumes_after_the_last_epoch(spark, tmp_path):
    df = numbered_rows(spark, 40, 2)
    notes, checkpoints = tmp_path / "notes", str(tmp_path / "checkpoints")
    notes.mkdir()
    first = noting_estimator(notes, epochs=2, run_id="resumed", checkpoint_dir=checkpoints,
                             shuffle=False).fit(df)
    assert sorted(os.listdir(os.path.join(checkpoints, "resumed"))) == ["best.pt", "last.pt"]
    trained_per_epoch = len(rows_trained_on(notes)) // 2

    second = noting_estimator(notes, epochs=3, run_id="resumed", checkpoint_dir=checkpoints,
                              shuffle=False).fit(df)
    assert len(rows_trained_on(notes)) == 3 * trained_per_epoch  # one more epoch, not three
    assert second.history[:2] == first.history
    assert [row["epoch"] for row in second.history] == [0, 1, 2]


def test_a_rank_that_raises_mid_epoch_fails_the_fit_with_its_traceback(spark, tmp_path):
    def fails_on_rank_1(epoch, metrics, model):
        raise AssertionError("never called: rank 1 fails first")

    class FailingLoss(torch.nn.CrossEntropyLoss):
        def forward(self, outputs, labels):
            import ddl_magic.torch as hvd

            if hvd.rank() == 1:
                raise RuntimeError("loss exploded on purpose")
            return super().forward(outputs, labels)

    estimator = noting_estimator(tmp_path, loss=FailingLoss(), callbacks=[fails_on_rank_1])
    with pytest.raises(RankFailedError) as failure:
        estimator.fit(numbered_rows(spark, 60, 2))
    assert failure.value.rank == 1
    assert "RuntimeError: loss exploded on purpose" in failure.value.traceback
    assert no_spark_job_active()
    assert shards_left() == []


@pytest.mark.parametrize("change, message", [
    ({"feature_cols": ["id_feature", "missing"]}, r"columns \['missing'\] are not in the DataFrame"),
    ({"feature_cols": ["id_feature", "word"]}, r"column 'word' is string: .*VectorAssembler"),
    ({"label_cols": ["big_label"]}, r"holds values from 0 to 9, but the loss needs class "
                                    r"indices 0..1 \(the model scores 2 classes\)"),
    ({"feature_cols": ["id_feature", "sometimes_null"]}, r"\['sometimes_null'\] have nulls"),
    ({"feature_cols": ["id_feature", "ragged"], "model": RowNotingNet("/tmp", 3)},
     "holds arrays of 1 to 2 values"),
    ({"num_proc": 5}, "np=5 needs 5 Spark task slots"),
    ({"validation": 1.5}, r"fraction in \[0, 1\)"),
    ({"metrics": ["f1"]}, "unknown metric 'f1'"),
    ({"model": None}, r"model=<a torch.nn.Module>"),
])
def test_mistakes_fail_before_training_with_what_to_change(spark, tmp_path, change, message):
    import ddl_magic

    df = (numbered_rows(spark, 20, 2)
          .withColumn("word", functions.lit("a"))
          .withColumn("big_label", functions.col("id") % 10)
          .withColumn("sometimes_null", functions.when(functions.col("id") > 3, 1.0))
          .withColumn("ragged", functions.when(
              functions.col("id") > 3, functions.array(functions.lit(1.0))).otherwise(
              functions.array(functions.lit(1.0), functions.lit(2.0)))))
    before = ddl_magic.last_run()
    with pytest.raises((ValueError, TypeError), match=message):
        noting_estimator(tmp_path, **change).fit(df)
    assert ddl_magic.last_run() is before, "a rank was started"


def test_it_is_a_spark_ml_estimator(tmp_path):
    estimator = noting_estimator(tmp_path, epochs=3)
    copy = estimator.copy({estimator.epochs: 5})
    assert copy.getOrDefault(copy.epochs) == 5 and estimator.getOrDefault(estimator.epochs) == 3
    assert copy.uid == estimator.uid
    other = torch.optim.Adam(estimator.getOrDefault("model").parameters())
    with_adam = estimator.copy({estimator.optimizer: other})
    assert with_adam.getOrDefault("optimizer") is other
    assert estimator.getOrDefault("optimizer") is not other
    assert with_adam.getOrDefault("model") is estimator.getOrDefault("model")
    explained = estimator.explainParams()
    for name in ("model", "optimizer", "loss", "feature_cols", "label_cols", "batch_size",
                 "epochs", "num_proc", "validation", "shuffle", "metrics", "callbacks", "run_id",
                 "checkpoint_dir", "use_gpu"):
        assert f"\n{name}: " in f"\n{explained}"


def test_a_fit_from_another_thread_finds_the_session(spark, tmp_path):
    outcome = {}

    def fit_elsewhere():
        try:
            outcome["model"] = noting_estimator(tmp_path).fit(numbered_rows(spark, 40, 2))
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=fit_elsewhere)
    thread.start()
    thread.join(timeout=120)
    assert "error" not in outcome, outcome
    assert len(outcome["model"].history) == 1


@pytest.mark.long_on_connect
def test_a_fit_records_every_ranks_timeline_when_asked(spark, tmp_path):
    path = tmp_path / "fit.timeline.json"
    noting_estimator(tmp_path, timeline=str(path)).fit(numbered_rows(spark, 40, 2))
    events = chrome_events(path)
    assert {rank for rank, *_ in events} == {0, 1}
    assert any(name.startswith("estimator.") for _, _, name, *_ in events)
    assert columnar_events(path) == events
