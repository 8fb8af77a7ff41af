"""`TorchEstimator`: train a torch model on a Spark DataFrame, as a Spark ML Estimator.

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler
    from ddl_magic.spark.estimator import TorchEstimator

    assembler = VectorAssembler(inputCols=["sepal_length", ...], outputCol="features")
    estimator = TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
                               loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                               label_cols=["label"], batch_size=16, epochs=50, num_proc=2,
                               validation=0.2, metrics=["accuracy"])
    model = Pipeline(stages=[assembler, estimator]).fit(train_df)    # a PipelineModel
    model.transform(test_df).select("label", "prediction").show()

How the rows reach the ranks: the same way as any run's data (`ddl_magic.data`): `fit` runs
the ranks as one barrier stage over the DataFrame itself, split into `num_proc` shares, and
each task writes its rank's share to its executor's local disk as Arrow while the rank
starts (`launch/spark_shares.py`), so no row passes through the driver, and nothing is
written to shared storage, converted to Parquet or read back through Petastorm. The ranks
stream their shares batch by batch as `estimator_training` describes and rank 0's weights
come back to the driver; the fitted `TorchModel` scores DataFrames with
`predict_batches`, loading the model once per task.

Mistakes are found before any rank starts, by one Spark aggregation over the columns: a
missing or non-numeric column, nulls, arrays of uneven length, class labels the model's
outputs cannot score, more ranks than task slots.

Both classes save in Spark ML's layout, so a `Pipeline` or fitted `PipelineModel` holding
them saves and loads with Spark's own `save`/`load`, on classic and Connect sessions alike:

    model.write().overwrite().save("/Volumes/main/default/models/iris")
    PipelineModel.load("/Volumes/main/default/models/iris").transform(test_df)
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Callable

import cloudpickle
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWritable, MLWriter

from ..frontends.options import make_display
from .persistence import (ESTIMATOR_OBJECTS_FILE, MODEL_FILE, PICKLED_PARAMS, FolderReader,
                          FolderWriter, unpickle)
from .estimator_training import CHECKPOINT_LAST, TrainingPlan, train_on_shard
from ..data.sources import Data
from ..driver.tracking import log_fitted_model

__all__ = ["TorchEstimator", "TorchModel"]

DEFAULT_CHECKPOINT_ROOT = os.path.join(tempfile.gettempdir(), "ddl_magic-estimator")


def accuracy(outputs, labels):
    """The share of rows whose highest-scoring class is the label."""
    return (outputs.argmax(dim=-1) == labels).float().mean()


BUILT_IN_METRICS = {"accuracy": accuracy}


def _param(name: str, doc: str, converter=TypeConverters.identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


class _TorchParams(Params):
    """The parameters `TorchEstimator` and `TorchModel` share."""

    feature_cols = _param("feature_cols", "columns the model reads: numbers, arrays of "
                          "numbers or ML vectors, laid side by side in this order",
                          TypeConverters.toListString)
    prediction_col = _param("prediction_col", "the column transform() adds",
                            TypeConverters.toString)

    def getFeatureCols(self) -> list[str]:
        return self.getOrDefault(self.feature_cols)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.prediction_col)


class TorchEstimator(Estimator, _TorchParams, MLWritable, MLReadable):
    """Trains a torch model on a Spark DataFrame on `num_proc` ranks; `fit` returns a
    `TorchModel`. Parameter names follow Horovod's `horovod.spark.torch.TorchEstimator`.

    - `model`: a `torch.nn.Module`; `optimizer`: an optimizer over its parameters (rebuilt
      with its defaults on each rank) or a function `parameters -> optimizer`; `loss`: a
      function `(outputs, labels) -> loss`. With `CrossEntropyLoss`/`NLLLoss` the labels are
      class indices and `prediction` is the best class; otherwise labels are float targets
      and `prediction` the model's output.
    - `feature_cols`, `label_cols`: column names. `validation`: a fraction of the rows (each
      rank holds out that share of its rows) or the name of a boolean column.
    - `metrics`: names ("accuracy") or functions `(outputs, labels) -> value`, averaged over
      rows. `callbacks`: functions `(epoch, metrics, model)` run on rank 0 after each epoch.
    - `run_id`, `checkpoint_dir`: rank 0 writes `last.pt` and `best.pt` to
      `checkpoint_dir/run_id/` after every epoch (a path every executor and the driver can
      read); a later fit with the same `run_id` resumes after the last epoch saved.
    - `timeline`: a path for every rank's timeline, as `%%horovod --timeline` records it.

    `copy(extra)` (what `CrossValidator` and `TrainValidationSplit` call for each param map)
    shares the model, optimizer and loss objects with the original, as Spark's shallow copy
    does: a fit never changes them, it trains a copy of the model on every rank. `save(path)`
    / `TorchEstimator.load(path)`, and a `Pipeline` holding it, keep every parameter, those
    objects cloudpickled.
    - `mlflow`: True or an experiment name tracks the fit in MLflow (as `%%horovod --mlflow`
      does) and logs the history per epoch and the trained model (`mlflow.pytorch`); by
      default a fit is tracked while the notebook has an active MLflow run.
    """

    model = _param("model", "the torch.nn.Module to train")
    optimizer = _param("optimizer", "a torch optimizer over the model's parameters, or a "
                       "function parameters -> optimizer")
    loss = _param("loss", "a function (outputs, labels) -> loss, e.g. torch.nn.CrossEntropyLoss()")
    label_cols = _param("label_cols", "label columns", TypeConverters.toListString)
    batch_size = _param("batch_size", "rows per step on each rank", TypeConverters.toInt)
    epochs = _param("epochs", "passes over the data", TypeConverters.toInt)
    num_proc = _param("num_proc", "ranks: Spark barrier tasks, one task slot each",
                      TypeConverters.toInt)
    validation = _param("validation", "a fraction of rows held out, or a boolean column")
    shuffle = _param("shuffle", "shuffle each rank's rows every epoch", TypeConverters.toBoolean)
    metrics = _param("metrics", "metric names ('accuracy') or functions (outputs, labels)")
    callbacks = _param("callbacks", "functions (epoch, metrics, model) run on rank 0 per epoch")
    run_id = _param("run_id", "names the run's checkpoint folder; a fit with the same run_id "
                    "resumes", TypeConverters.toString)
    checkpoint_dir = _param("checkpoint_dir", "where runs keep their checkpoints",
                            TypeConverters.toString)
    use_gpu = _param("use_gpu", "train on one GPU per rank", TypeConverters.toBoolean)
    random_seed = _param("random_seed", "seeds shuffling and torch on every rank",
                         TypeConverters.toInt)
    verbose = _param("verbose", "1: rank 0 prints a line per epoch; 0: quiet",
                     TypeConverters.toInt)
    timeline = _param("timeline", "record every rank's timeline to this path ('': with the "
                      "run's logs)", TypeConverters.toString)
    mlflow = _param("mlflow", "track the fit in MLflow: True, an experiment name, or False")

    @keyword_only
    def __init__(self, *, model=None, optimizer=None, loss=None, feature_cols=None,
                 label_cols=None, batch_size=32, epochs=1, num_proc=None, validation=None,
                 shuffle=True, metrics=None, callbacks=None, run_id=None, checkpoint_dir=None,
                 use_gpu=False, random_seed=0, verbose=1, timeline=None,
                 prediction_col="prediction", mlflow=None):
        super().__init__()
        self._setDefault(batch_size=32, epochs=1, shuffle=True, use_gpu=False, random_seed=0,
                         verbose=1, prediction_col="prediction", metrics=[], callbacks=[],
                         checkpoint_dir=DEFAULT_CHECKPOINT_ROOT)
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, model=None, optimizer=None, loss=None, feature_cols=None,
                  label_cols=None, batch_size=32, epochs=1, num_proc=None, validation=None,
                  shuffle=True, metrics=None, callbacks=None, run_id=None, checkpoint_dir=None,
                  use_gpu=False, random_seed=0, verbose=1, timeline=None,
                  prediction_col="prediction", mlflow=None):
        return self._set(**{name: value for name, value in self._input_kwargs.items()
                            if value is not None})

    def _fit(self, dataset) -> TorchModel:
        from ..driver.job import Job, JobOptions
        from ..launch.spark import SparkLauncher
        from ..launch.spark_shares import spark_shares
        from ..wire.tasks import FunctionTask

        num_proc = self._num_proc()
        plan, frames, rows = self._plan(dataset)
        stage, shares, lines = spark_shares(frames, num_proc, checked_rows=rows)
        if plan.verbose:
            print("\n".join(f"ddl_magic: {line}" for line in lines.values()), flush=True)
        launcher = SparkLauncher(data=stage)
        title = (f"TorchEstimator(num_proc={num_proc}, epochs={plan.epochs}): "
                 f"{type(plan.model).__name__}")
        options = JobOptions(display=make_display, use_gpu=plan.use_gpu, timeline_path=self._optional(self.timeline),
                             title=title, mlflow=self._optional(self.mlflow))
        task = FunctionTask(train_on_shard, {"plan": plan, "data": shares["data"],
                                             "validation": shares.get("validation")})
        self.last_run = Job(task, num_proc, launcher, options).run()
        trained = self._fresh_model()
        trained.load_state_dict(self.last_run.result["state"])
        log_fitted_model(self.last_run, _tracked_params(plan), self.last_run.result["history"],
                         trained)
        fitted = TorchModel(model=trained, feature_cols=plan.feature_cols,
                            prediction_col=self.getPredictionCol(),
                            classification=plan.classification,
                            history=self.last_run.result["history"])
        return self._copyValues(fitted)

    def write(self) -> MLWriter:
        """Writes this estimator as a folder in Spark ML's layout (see `FolderWriter`)."""
        objects = {param.name: value for param, value in self._paramMap.items()
                   if param.name in PICKLED_PARAMS}
        return FolderWriter(self, {ESTIMATOR_OBJECTS_FILE: objects})

    @classmethod
    def read(cls) -> MLReader:
        return FolderReader(cls)

    @classmethod
    def _from_folder(cls, folder: str, metadata: dict) -> "TorchEstimator":
        estimator = cls()
        estimator._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(estimator, metadata)
        estimator._set(**unpickle(folder, ESTIMATOR_OBJECTS_FILE))
        return estimator

    # ---- checks and the plan the ranks follow -------------------------------------------------

    def _plan(self, dataset) -> tuple[TrainingPlan, dict, dict]:
        """The ranks' plan, the datasets they read ("data", and "validation" where a column
        marks it) with their rows, or a ValueError/TypeError that says what to change, before
        any rank starts."""
        import torch

        model = self._optional(self.model)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchEstimator needs model=<a torch.nn.Module>, got "
                            f"{type(model).__name__}")
        loss = self._required(self.loss, "loss", "e.g. loss=torch.nn.CrossEntropyLoss()")
        if not callable(loss):
            raise TypeError(f"loss must be a function (outputs, labels) -> loss, got "
                            f"{type(loss).__name__}")
        feature_cols = self._required(self.feature_cols, "feature_cols", "e.g. ['features']")
        label_cols = self._required(self.label_cols, "label_cols", "e.g. ['label']")
        batch_size, epochs = self.getOrDefault(self.batch_size), self.getOrDefault(self.epochs)
        if batch_size < 1 or epochs < 1:
            raise ValueError(f"batch_size and epochs must be at least 1, got {batch_size} "
                             f"and {epochs}")
        classification = isinstance(loss, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))
        validation_fraction, validation_col = self._validation(dataset)
        kinds = _column_kinds(dataset, [*feature_cols, *label_cols])
        if classification and (len(label_cols) != 1 or kinds[label_cols[0]] != "number"):
            raise ValueError(f"{type(loss).__name__} takes one label column of class indices; "
                             f"label_cols is {label_cols}")
        widths, label_range, rows = _scan_columns(dataset, kinds, label_cols, validation_col)
        features_in = sum(widths[name] for name in feature_cols)
        if classification:
            self._check_classes(model, features_in, label_cols[0], label_range)
        columns = list(kinds)
        if validation_col is None:
            frames = {"data": Data(dataset.select(*columns))}
        else:
            marked = dataset[validation_col]
            frames = {"data": Data(dataset.where(~marked).select(*columns)),
                      "validation": Data(dataset.where(marked).select(*columns))}
        run_id = self._optional(self.run_id)
        checkpoint_dir = os.path.join(self.getOrDefault(self.checkpoint_dir),
                                      run_id or uuid.uuid4().hex[:12])
        plan = TrainingPlan(
            model=model, make_optimizer=self._optimizer_factory(), loss=loss,
            feature_cols=feature_cols, label_cols=label_cols, classification=classification,
            batch_size=batch_size, epochs=epochs, shuffle=self.getOrDefault(self.shuffle),
            seed=self.getOrDefault(self.random_seed), validation_fraction=validation_fraction,
            validation_col=validation_col, metrics=self._metrics(),
            callbacks=list(self.getOrDefault(self.callbacks)), checkpoint_dir=checkpoint_dir,
            resume=_last_checkpoint(checkpoint_dir) if run_id else None,
            use_gpu=self.getOrDefault(self.use_gpu), verbose=self.getOrDefault(self.verbose))
        return plan, frames, rows

    def _optional(self, param: Param):
        """The parameter's value, or None where neither set nor defaulted."""
        return self.getOrDefault(param) if self.isDefined(param) else None

    def _required(self, param: Param, name: str, example: str):
        if not self.isDefined(param) or self.getOrDefault(param) in (None, []):
            raise ValueError(f"TorchEstimator needs {name}= ({example})")
        return self.getOrDefault(param)

    def _num_proc(self) -> int:
        num_proc = self._required(self.num_proc, "num_proc", "the number of ranks, e.g. 2")
        if num_proc < 1:
            raise ValueError(f"num_proc must be at least 1, got {num_proc}")
        return num_proc

    def _validation(self, dataset) -> tuple[float, str | None]:
        validation = self._optional(self.validation)
        if validation is None:
            return 0.0, None
        if isinstance(validation, str):
            if validation not in dataset.columns:
                raise ValueError(f"validation={validation!r} is not a column of the DataFrame; "
                                 f"it has {dataset.columns}")
            type_name = dataset.schema[validation].dataType.simpleString()
            if type_name != "boolean":
                raise TypeError(f"validation column {validation!r} must be boolean (true: a "
                                f"validation row), it is {type_name}")
            return 0.0, validation
        if not 0 <= float(validation) < 1:
            raise ValueError(f"validation={validation!r}: give a fraction in [0, 1) of the rows "
                             "to hold out, or the name of a boolean column")
        return float(validation), None

    def _optimizer_factory(self) -> Callable:
        import torch

        optimizer = self._required(self.optimizer, "optimizer",
                                   "e.g. torch.optim.SGD(model.parameters(), lr=0.1)")
        if isinstance(optimizer, torch.optim.Optimizer):
            kind, defaults = type(optimizer), dict(optimizer.defaults)
            return lambda parameters: kind(parameters, **defaults)
        if callable(optimizer):
            return optimizer
        raise TypeError(f"optimizer must be a torch optimizer or a function parameters -> "
                        f"optimizer, got {type(optimizer).__name__}")

    def _metrics(self) -> dict[str, Callable]:
        metrics = {}
        for metric in self.getOrDefault(self.metrics):
            if isinstance(metric, str):
                if metric not in BUILT_IN_METRICS:
                    raise ValueError(f"unknown metric {metric!r}: the built-in ones are "
                                     f"{sorted(BUILT_IN_METRICS)}; pass a function "
                                     "(outputs, labels) -> value for others")
                metrics[metric] = BUILT_IN_METRICS[metric]
            elif callable(metric):
                metrics[getattr(metric, "__name__", f"metric_{len(metrics)}")] = metric
            else:
                raise TypeError(f"a metric is a name or a function, got {type(metric).__name__}")
        return metrics

    @staticmethod
    def _check_classes(model, features_in: int, label_col: str, label_range) -> None:
        import torch

        low, high, whole = label_range
        try:
            with torch.no_grad():
                classes = model.eval()(torch.zeros(2, features_in)).shape[-1]
        except Exception as exc:
            raise ValueError(f"the model cannot take the {features_in} features of "
                             f"feature_cols: {type(exc).__name__}: {exc}") from None
        finally:
            model.train()
        if not whole or low < 0 or high >= classes:
            raise ValueError(
                f"label column {label_col!r} holds values from {low:g} to {high:g}, but the "
                f"loss needs class indices 0..{classes - 1} (the model scores {classes} "
                "classes): index the labels (StringIndexer), or widen the model's last layer")

    def _fresh_model(self):
        return cloudpickle.loads(cloudpickle.dumps(self.getOrDefault(self.model)))


class TorchModel(Model, _TorchParams, MLWritable, MLReadable):
    """A trained torch model as a Spark ML Model: `transform(df)` adds `prediction_col`.

    `getModel()` is the torch module; `history` the per-epoch metrics of its training.
    `save(path)` / `TorchModel.load(path)` use a folder on a file system the driver reads
    (local, or a FUSE mount such as /Volumes or /dbfs), in Spark ML's layout: a fitted
    `PipelineModel` holding it saves and loads with `PipelineModel.save`/`load`.

        model.save("/tmp/iris-model")
        TorchModel.load("/tmp/iris-model").transform(test_df)
    """

    @keyword_only
    def __init__(self, *, model=None, feature_cols=None, prediction_col="prediction",
                 classification=True, history=None):
        super().__init__()
        self._setDefault(prediction_col="prediction")
        # Unset, not None, where not given: a saved model's parameters must convert back.
        given = {"feature_cols": feature_cols, "prediction_col": prediction_col}
        self._set(**{name: value for name, value in given.items() if value is not None})
        self._model = model
        self.classification = classification
        self.history = list(history or [])

    def getModel(self):
        return self._model

    def _transform(self, dataset):
        from .inference import predict_batches

        feature_cols = self.getFeatureCols()
        kinds = _column_kinds(dataset, feature_cols)
        scratch = {name: f"__ddl_magic_{name}" for name, kind in kinds.items() if kind == "vector"}
        for name, column in scratch.items():
            dataset = dataset.withColumn(column, _as_arrays(dataset, name, "vector"))
        model_bytes = cloudpickle.dumps(self._model)
        # Spark ML's evaluators take predictions as doubles, class indices included.
        predict = _best_class if self.classification else _regression_output
        scored = predict_batches(dataset, lambda: cloudpickle.loads(model_bytes),
                                 [scratch.get(name, name) for name in feature_cols],
                                 predict=predict, output_col=self.getPredictionCol(),
                                 output_type="double")
        return scored.drop(*scratch.values()) if scratch else scored

    def write(self) -> MLWriter:
        """Writes this model as a folder in Spark ML's layout (see `FolderWriter`)."""
        return FolderWriter(self, {MODEL_FILE: self._model},
                             {"classification": self.classification, "history": self.history})

    @classmethod
    def read(cls) -> MLReader:
        return FolderReader(cls)

    @classmethod
    def _from_folder(cls, folder: str, metadata: dict) -> "TorchModel":
        model = cls(model=unpickle(folder, MODEL_FILE),
                    classification=metadata["classification"], history=metadata["history"])
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model


def _best_class(model, features):
    from .inference import torch_classifier

    return torch_classifier(model, features).astype("float64")


def _regression_output(model, features):
    import torch

    model.eval()
    with torch.no_grad():
        outputs = model(torch.from_numpy(features))
    return outputs.reshape(len(features), -1)[:, 0].double().numpy()


# ---- the DataFrame's columns ------------------------------------------------------------------

def _column_kinds(dataset, names: list[str]) -> dict[str, str]:
    """Each column's kind ("number", "array", "vector"), or an error naming what is wrong."""
    missing = [name for name in names if name not in dataset.columns]
    if missing:
        raise ValueError(f"columns {missing} are not in the DataFrame; it has {dataset.columns}")
    from pyspark.sql.types import ArrayType, BooleanType, NumericType

    numeric = (NumericType, BooleanType)
    kinds = {}
    for name in dict.fromkeys(names):
        data_type = dataset.schema[name].dataType
        if isinstance(data_type, numeric):
            kinds[name] = "number"
        elif isinstance(data_type, ArrayType) and isinstance(data_type.elementType, numeric):
            kinds[name] = "array"
        elif type(data_type).__name__ == "VectorUDT":
            kinds[name] = "vector"
        else:
            raise TypeError(
                f"column {name!r} is {data_type.simpleString()}: the model reads numbers, arrays "
                "of numbers or ML vectors. Cast it (col.cast('double')), index it "
                "(StringIndexer) or assemble the columns with VectorAssembler")
    return kinds


def _as_arrays(dataset, name: str, kind: str):
    """The column as the ranks read it: vectors become arrays of float32 on the executors."""
    if kind != "vector":
        return dataset[name]
    from pyspark.ml.functions import vector_to_array

    return vector_to_array(dataset[name], "float32").alias(name)


def _scan_columns(dataset, kinds, label_cols, validation_col=None):
    """One aggregation over the data: rows, nulls, array widths, the label range. Returns
    ({column: width}, (lowest label, highest label, whether all are whole numbers),
    {dataset: rows}: "data", and "validation" where `validation_col` marks rows)."""
    from pyspark.sql import functions

    checks = [functions.count(functions.lit(1)).alias("rows")]
    if validation_col is not None:
        checks.append(functions.sum(dataset[validation_col].cast("long")).alias("held_out"))
    for name, kind in kinds.items():
        column = _as_arrays(dataset, name, kind)
        checks.append(functions.sum(column.isNull().cast("long")).alias(f"nulls:{name}"))
        if kind != "number":
            size = functions.size(column)
            checks += [functions.min(size).alias(f"min:{name}"),
                       functions.max(size).alias(f"max:{name}")]
    label = dataset[label_cols[0]].cast("double")  # booleans too
    if kinds[label_cols[0]] == "number":
        checks += [functions.min(label).alias("low"), functions.max(label).alias("high"),
                   functions.sum((label != functions.floor(label)).cast("long")).alias("fractions")]
    found = dataset.agg(*checks).first().asDict()
    with_nulls = [name for name in kinds if found[f"nulls:{name}"]]
    if with_nulls:
        raise ValueError(f"columns {with_nulls} have nulls: drop or fill them first "
                         "(df.dropna(subset=[...]) or df.fillna(...))")
    widths = {}
    for name, kind in kinds.items():
        if kind == "number":
            widths[name] = 1
            continue
        low, high = found[f"min:{name}"], found[f"max:{name}"]
        if low != high:
            raise ValueError(f"column {name!r} holds arrays of {low} to {high} values: every "
                             "row must have the same length")
        widths[name] = low or 0
    label_range = (float(found.get("low") or 0), float(found.get("high") or 0),
                   not found.get("fractions"))
    held_out = int(found.get("held_out") or 0)
    rows = {"data": int(found["rows"]) - held_out}
    if validation_col is not None:
        rows["validation"] = held_out
    return widths, label_range, rows


def _last_checkpoint(directory: str) -> dict | None:
    import torch

    path = os.path.join(directory, CHECKPOINT_LAST)
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=True)  # tensors, numbers and names only


def _tracked_params(plan: TrainingPlan) -> dict:
    """What an MLflow run of the fit records about it (`ddl_magic.<name>` parameters)."""
    return {"model": type(plan.model).__name__, "loss": type(plan.loss).__name__,
            "feature_cols": ",".join(plan.feature_cols), "label_cols": ",".join(plan.label_cols),
            "batch_size": plan.batch_size, "epochs": plan.epochs, "shuffle": plan.shuffle,
            "random_seed": plan.seed,
            "validation": plan.validation_col or plan.validation_fraction or None}
