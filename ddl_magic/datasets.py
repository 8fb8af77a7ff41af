"""Public path of the labs' data sets: `from ddl_magic.datasets import load_iris`.

The code lives in `ddl_magic/labs/datasets.py`.
"""

from .labs.datasets import (IRIS_CLASSES, IRIS_FEATURES, Mnist, load_iris, load_mnist, read_idx,
                            stratified_split)

__all__ = ["IRIS_CLASSES", "IRIS_FEATURES", "Mnist", "load_iris", "load_mnist", "read_idx",
           "stratified_split"]
