"""Public path of batch inference over a DataFrame:
`from ddl_magic.spark_inference import predict_batches`.

The code lives in `ddl_magic/spark/inference.py`.
"""

from .spark.inference import predict_batches, torch_classifier

__all__ = ["predict_batches", "torch_classifier"]
