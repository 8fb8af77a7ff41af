"""A rank's share read through its loader, in this process (a world of one): batches of
tensors, every row once per epoch, a new order each epoch, exact resumes, what is refused."""

import os

import numpy as np
import pyarrow
import pytest
import torch

from ddl_magic.data import Share
from ddl_magic.data.share_file import ShareFile, ShareWriter
from ddl_magic.data.sources import ArrowFileShares


def _share(table: pyarrow.Table, name: str = "train", chunk: int = 100) -> Share:
    writer = ShareWriter(table.schema)
    for batch in table.to_batches(max_chunksize=chunk):
        writer.write(batch)
    writer.finish()
    path = f"/proc/{os.getpid()}/fd/{writer.fd}"
    return Share(name, ArrowFileShares(path, 1, table.num_rows,
                                       table.schema.serialize().to_pybytes()), "test table")


@pytest.fixture
def table():
    rows = 1000
    features = pyarrow.ListArray.from_arrays(
        pyarrow.array(np.arange(0, 4 * (rows + 1), 4, dtype=np.int32)),
        pyarrow.array(np.repeat(np.arange(rows, dtype=np.float32), 4)))
    return pyarrow.table({"id": np.arange(rows), "features": features,
                          "label": (np.arange(rows) % 3).astype(np.int32),
                          "city": ["x"] * rows})


def _ids(loader) -> list[list[int]]:
    return [batch["id"].tolist() for batch in loader]


def test_batches_are_dicts_of_tensors_arrays_two_dimensional(table):
    loader = _share(table).loader(batch_size=64, columns=["id", "features", "label"])
    batch = next(iter(loader))
    assert batch["features"].shape == (64, 4) and batch["features"].dtype == torch.float32
    assert batch["label"].dtype == torch.int32 and batch["id"].dtype == torch.int64
    assert torch.equal(batch["features"][:, 0], batch["id"].float())  # rows stay aligned
    batch["features"] += 1  # the tensors are the caller's to change


def test_every_row_once_per_epoch_in_a_new_order_each_epoch(table):
    loader = _share(table).loader(batch_size=100, columns=["id"], shuffle=True, seed=5,
                                  shuffle_window=250)
    first, second = _ids(loader), _ids(loader)
    assert len(loader) == 10 and loader.epoch == 2
    for epoch in (first, second):
        assert sorted(sum(epoch, [])) == list(range(1000))
    assert first != second
    again = _share(table).loader(batch_size=100, columns=["id"], shuffle=True, seed=5,
                                 shuffle_window=250)
    assert _ids(again) == first  # reproducible from the seed


def test_resuming_from_a_state_dict_gives_the_batch_that_came_next(table):
    share = _share(table)
    loader = share.loader(batch_size=64, columns=["id"], seed=2, drop_last=False)
    _ids(loader)
    batches = iter(loader)  # epoch 1
    for _ in range(4):
        next(batches)
    state = loader.state_dict()
    expected = [batch["id"].tolist() for batch in batches]
    restarted = share.loader(batch_size=64, columns=["id"], seed=2, drop_last=False)
    restarted.load_state_dict(state)
    assert _ids(restarted) == expected
    assert restarted.epoch == 2 and restarted.step == 0
    other = share.loader(batch_size=32, columns=["id"], seed=2)
    with pytest.raises(ValueError, match="batch_size 64 there, 32 here"):
        other.load_state_dict(state)


def test_a_dataset_for_a_dataloader_with_workers_gives_the_same_batches(table):
    share = _share(table)
    expected = sorted(map(tuple, _ids(share.loader(batch_size=100, columns=["id"], seed=9))))
    dataset = share.dataset(batch_size=100, columns=["id"], seed=9)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(tuple(batch["id"].tolist()) for batch in loader) == expected
    assert len(dataset) == 10


def test_columns_the_loader_cannot_read_are_named_with_what_to_do(table):
    share = _share(table)
    with pytest.raises(TypeError, match="column 'city' is string: .*leave it out"):
        share.loader(batch_size=10)
    with pytest.raises(KeyError, match="'nope'"):
        share.loader(batch_size=10, columns=["nope"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        share.loader(batch_size=0, columns=["id"])


def test_nulls_and_uneven_arrays_are_refused_before_the_first_step():
    with_nulls = pyarrow.table({"x": pyarrow.array([1.0, None, 3.0, None])})
    with pytest.raises(ValueError, match=r"column 'x' has 2 nulls \(rank 0: 2\)"):
        len(_share(with_nulls).loader(batch_size=2))
    uneven = pyarrow.table({"v": pyarrow.array([[1.0, 2.0], [3.0]])})
    with pytest.raises(ValueError, match="arrays of 1 to 2 values"):
        len(_share(uneven).loader(batch_size=1))


def test_a_share_on_a_rank_is_not_the_dataframe_and_says_how_to_read_it(table):
    share = _share(table)
    with pytest.raises(AttributeError, match=r"train.loader\(batch_size="):
        share.toPandas()
    assert share.num_rows == 1000 and share.columns == ["id", "features", "label", "city"]


def test_memory_is_released_block_by_block():
    rows, width = 20_000, 256
    values = pyarrow.array(np.ones(rows * width, dtype=np.float32))
    table = pyarrow.table({"v": pyarrow.FixedSizeListArray.from_arrays(values, width)})
    share = _share(table, chunk=1000)
    loader = share.loader(batch_size=500, shuffle=True, shuffle_window=2000)
    for _ in loader:
        assert len(loader._views) <= 4  # two windows of two blocks at most
    assert not loader._views


def test_share_file_reads_a_row_range(table):
    writer = ShareWriter(table.schema)
    for batch in table.to_batches(max_chunksize=300):
        writer.write(batch)
    writer.finish()
    part = ShareFile(writer.fd, (250, 700))
    assert part.num_rows == 450 and part.block_rows == [50, 300, 100]
    assert part.views(0, ["id"])["id"][0] == 250
    os.close(writer.fd)


def test_room_for_a_share_is_set_aside_before_it_is_written_and_its_size_left_alone(tmp_path):
    import shutil

    from ddl_magic.data.share_file import _fallocate, reserve, unlinked_file

    if _fallocate() is None:
        pytest.skip("no fallocate here: nothing is set aside, the writes allocate as they come")
    fd = unlinked_file(str(tmp_path))
    try:
        assert reserve(fd, 8 << 20)
        assert os.fstat(fd).st_size == 0, "the reader maps the file's size: it must be the rows'"
        assert os.fstat(fd).st_blocks * 512 >= 8 << 20
        assert not reserve(fd, shutil.disk_usage(tmp_path).free + (1 << 30))
    finally:
        os.close(fd)


def test_a_share_that_does_not_fit_the_disk_names_host_folder_bytes_and_free_space(tmp_path):
    import socket

    from ddl_magic.data.share_file import ShareDiskFullError

    schema = pyarrow.schema([("x", pyarrow.float64())])
    writer = ShareWriter(schema, str(tmp_path), expected_rows=10**12, what="rank 1's share of 'train'")
    with pytest.raises(ShareDiskFullError) as full:
        writer.write(pyarrow.record_batch([pyarrow.array([1.0, 2.0])], schema=schema))
    message = str(full.value)
    assert f"rank 1's share of 'train' needs about 7.3 TB of local disk on {socket.gethostname()}" in message
    assert f"but {tmp_path} has" in message and "free" in message
    writer.abandon()
    assert os.listdir(tmp_path) == []
