"""Saving and loading `TorchEstimator` and `TorchModel` in Spark ML's layout, so that a
`Pipeline` or `PipelineModel` holding them saves and loads like any other.

A stage is a folder: Spark's metadata (one line of JSON, which `PipelineModel.load` reads to
learn which class loads the stage), plus cloudpickled files for what JSON cannot hold.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import urllib.parse
from typing import Any

import cloudpickle
import pyspark
from pyspark.ml.param import Params
from pyspark.ml.util import MLReader, MLWriter

# Parameters that hold objects (a module, functions, an optimizer), cloudpickled instead of
# written as JSON.
PICKLED_PARAMS = ("model", "optimizer", "loss", "metrics", "callbacks")
MODEL_FILE = "model.pkl"
ESTIMATOR_OBJECTS_FILE = "params.pkl"
METADATA_DIR = "metadata"


class FolderWriter(MLWriter):
    """Saves a `TorchModel` or `TorchEstimator` as a folder in Spark ML's layout:

    - `metadata/part-00000`: one line of JSON, what Spark's `DefaultParamsWriter.saveMetadata`
      writes (class, timestamp, sparkVersion, uid, paramMap, defaultParamMap, and this class's
      extra fields). It is what `PipelineModel.load`/`Pipeline.load` read, through
      `DefaultParamsReader.loadParamsInstance`, to learn which class loads a stage; they then
      call that class's `load`. Written without Spark, so that saving needs no session.
    - cloudpickled files for what JSON cannot hold: the torch module, or the estimator's
      object parameters.

    The folder is on a file system the driver reads (local, or a FUSE mount); Spark reads
    the metadata from the same path, so a pipeline goes to a path both see alike (a local
    folder, or /Volumes/... on Databricks).
    """

    def __init__(self, instance: Params, pickled: dict[str, Any],
                 extra_metadata: dict[str, Any] | None = None):
        super().__init__()
        self._instance = instance
        self._pickled = pickled
        self._extra_metadata = extra_metadata or {}

    def save(self, path: str) -> None:
        folder = _local_folder(path, type(self._instance).__name__)
        if os.path.exists(folder):
            if not self.shouldOverwrite:
                raise FileExistsError(f"{path} exists: call write().overwrite().save(path) on "
                                      f"the {type(self._instance).__name__} to replace it")
            shutil.rmtree(folder)
        os.makedirs(os.path.join(folder, METADATA_DIR))
        instance = self._instance
        json_params = {param.name: value for param, value in instance._paramMap.items()
                       if param.name not in PICKLED_PARAMS}
        json_defaults = {param.name: value for param, value in instance._defaultParamMap.items()
                         if param.name not in PICKLED_PARAMS}
        metadata = {"class": _class_name(type(instance)),
                    "timestamp": int(round(time.time() * 1000)),
                    "sparkVersion": pyspark.__version__, "uid": instance.uid,
                    "paramMap": json_params, "defaultParamMap": json_defaults,
                    **self._extra_metadata}
        # As Spark's text writer leaves it: a part file, and _SUCCESS once it is complete.
        with open(os.path.join(folder, METADATA_DIR, "part-00000"), "w") as file:
            file.write(json.dumps(metadata, separators=(",", ":")) + "\n")
        open(os.path.join(folder, METADATA_DIR, "_SUCCESS"), "w").close()
        for filename, value in self._pickled.items():
            with open(os.path.join(folder, filename), "wb") as file:
                cloudpickle.dump(value, file)


class FolderReader(MLReader):
    """Loads what `FolderWriter` saved, as an instance of `cls`."""

    def __init__(self, cls: type):
        super().__init__()
        self._cls = cls

    def load(self, path: str):
        folder = _local_folder(path, self._cls.__name__)
        parts = sorted(glob.glob(os.path.join(folder, METADATA_DIR, "part-*")))
        if not parts:
            raise FileNotFoundError(f"{path} holds no saved {self._cls.__name__} "
                                    f"({METADATA_DIR}/part-* is missing): give the folder that "
                                    "save() wrote")
        with open(parts[0]) as file:
            metadata = json.loads(file.readline())
        if metadata["class"] != _class_name(self._cls):
            raise ValueError(f"{path} holds a {metadata['class']}, not a "
                             f"{_class_name(self._cls)}: load it with that class")
        return self._cls._from_folder(folder, metadata)


def _class_name(cls: type) -> str:
    """The class's public path, which Spark imports to load the stage: it stays the same
    wherever the code lives, so a folder saved by one version loads in the next."""
    return f"ddl_magic.estimator.{cls.__name__}"


def unpickle(folder: str, filename: str):
    with open(os.path.join(folder, filename), "rb") as file:
        return cloudpickle.load(file)


def _local_folder(path: str, what: str) -> str:
    """The local path of `path`, which Spark may give as a file: URI (a stage's folder in a
    saved pipeline is under the pipeline's path); other file systems are refused."""
    parsed = urllib.parse.urlparse(path)
    if parsed.scheme == "file":
        return parsed.path
    if parsed.scheme:
        raise ValueError(
            f"a {what} is saved to a folder on a file system the driver reads, not {path!r}: "
            "give a local path, or a FUSE path such as /Volumes/... on Databricks (for a "
            "Pipeline or PipelineModel holding it, save the whole pipeline to such a path)")
    return path
