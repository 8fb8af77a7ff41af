"""Spark ML: `TorchEstimator` and `TorchModel` (fit and transform as pipeline stages, saved
and loaded), the training loop they run on the ranks, and batch inference over a DataFrame.

Public import paths stay `ddl_magic.estimator` and `ddl_magic.spark_inference`.
"""
