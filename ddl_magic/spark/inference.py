"""Distributed inference: a trained model's predictions as a new column of a Spark DataFrame.

Training ends on rank 0 with a checkpoint; scoring a big table is the next step, and Spark
does it without the ring: each task loads the model once and pushes its partition through
it in batches (an iterator ``pandas_udf``: only the feature columns travel between the JVM
and Python, as Arrow batches).

    from ddl_magic.spark.inference import predict_batches

    def load_model():                      # runs once per task, on the executor
        model = Net()
        model.load_state_dict(torch.load("/dbfs/models/net.pt"))
        return model

    scored = predict_batches(df, load_model, ["pixels"])      # adds a "prediction" column
    scored.groupBy("prediction").count().show()

``load_model`` is pickled and sent to the executors: it must read the model from a place
every executor can reach (a shared file system, or bytes it closes over).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType

__all__ = ["predict_batches", "torch_classifier"]

DEFAULT_BATCH_ROWS = 1024


def torch_classifier(model: Any, features: np.ndarray) -> np.ndarray:
    """The default ``predict``: the class a torch classifier scores highest, per row.

    Runs ``model`` in eval mode without gradients on a float32 tensor of ``features``
    and returns the argmax over the last dimension as int64.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 3)
        >>> torch_classifier(model, np.zeros((4, 2), dtype=np.float32)).shape
        (4,)
    """
    import torch

    model.eval()
    with torch.no_grad():
        scores = model(torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)))
    return scores.argmax(dim=-1).numpy().astype(np.int64)


def predict_batches(
    df: DataFrame,
    load_model: Callable[[], Any],
    feature_cols: Sequence[str],
    *,
    predict: Callable[[Any, np.ndarray], Any] = torch_classifier,
    output_col: str = "prediction",
    output_type: str | DataType = "long",
    batch_rows: int = DEFAULT_BATCH_ROWS,
) -> DataFrame:
    """``df`` with one more column, ``output_col``: the model's prediction for each row.

    On each Spark task, ``load_model()`` is called once, however many batches the task's
    partition holds; then for every batch of at most ``batch_rows`` rows,
    ``predict(model, features)`` is called with the batch's features as a 2-D float32
    numpy array (one row per DataFrame row) and must return one value per row.

    ``feature_cols`` are numeric columns, array columns (e.g. ``array<float>`` of the 784
    pixels of a digit) or both; their values are laid side by side, in the order given.
    ``output_type`` is the Spark SQL type of the new column, as a name or a ``DataType``
    ("long" for the class index that the default ``predict``, ``torch_classifier``,
    returns; "double" for a regression).
    Evaluation is lazy, as for any Spark transformation.

    Example:
        >>> scored = predict_batches(images, load_model, ["pixels"])      # doctest: +SKIP
        >>> scored.select("label", "prediction").show(3)                  # doctest: +SKIP
        >>> predict_batches(houses, load_regressor, ["rooms", "age"],     # doctest: +SKIP
        ...                 predict=lambda m, x: m.predict(x), output_type="double")
    """
    if not callable(load_model):
        raise TypeError(f"load_model must be a function that returns the model, "
                        f"got {type(load_model).__name__}")
    if isinstance(feature_cols, str):
        feature_cols = [feature_cols]
    feature_cols = list(feature_cols)
    if not feature_cols:
        raise ValueError("feature_cols is empty: name the columns the model reads")
    missing = [c for c in feature_cols if c not in df.columns]
    if missing:
        raise ValueError(f"feature_cols {missing} are not columns of the DataFrame; "
                         f"it has {df.columns}")
    if output_col in df.columns:
        raise ValueError(f"the DataFrame already has a column {output_col!r}; "
                         "choose another output_col")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    import pandas as pd
    from pyspark.sql import functions

    def predict_column(batches: Iterator[pd.DataFrame]) -> Iterator[pd.Series]:
        model = None
        for frame in batches:
            predictions = []
            for start in range(0, len(frame), batch_rows):
                rows = frame.iloc[start:start + batch_rows]
                if model is None:  # a task whose partition is empty never loads the model
                    model = load_model()
                batch = np.asarray(predict(model, _feature_matrix(rows, feature_cols)))
                if len(batch) != len(rows):
                    raise ValueError(f"predict returned {len(batch)} values for a batch of "
                                     f"{len(rows)} rows; it must return one per row")
                predictions.append(batch)
            yield pd.Series(np.concatenate(predictions) if predictions else [])

    # Real types, not this module's postponed strings: pyspark reads the UDF's kind from them.
    predict_column.__annotations__ = {"batches": Iterator[pd.DataFrame],
                                      "return": Iterator[pd.Series]}
    # Only the feature columns travel to Python (as one struct: a DataFrame per batch); the
    # others stay in the JVM, whatever their types.
    features = functions.struct(*[df[name] for name in feature_cols])
    return df.withColumn(output_col, functions.pandas_udf(predict_column, output_type)(features))


def _feature_matrix(rows: pd.DataFrame, feature_cols: list[str]) -> np.ndarray:
    """The batch's features as one float32 matrix: scalar columns and array columns side by side."""
    parts = []
    for name in feature_cols:
        column = rows[name]
        if column.dtype == object:  # an array column: one numpy array per row
            parts.append(np.stack([np.asarray(v, dtype=np.float32) for v in column]))
        else:
            parts.append(column.to_numpy(dtype=np.float32)[:, None])
    return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
