"""Public path of the Spark ML estimator: `from ddl_magic.estimator import TorchEstimator`.

The code lives in `ddl_magic/spark/estimator.py`; models saved with this path load as before.
"""

from .spark.estimator import BUILT_IN_METRICS, TorchEstimator, TorchModel, accuracy

__all__ = ["BUILT_IN_METRICS", "TorchEstimator", "TorchModel", "accuracy"]
