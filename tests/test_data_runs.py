"""Data given to local runs reaches every rank as its share, from every front-end: each row
exactly once per epoch across the ranks, equal steps with unequal and empty shares, a new
order per epoch, a pool keeping its data across cells, a source failing mid-read, and
nothing left on disk after a SIGKILLed rank or a killed kernel."""

import os
import signal
import textwrap

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.parquet
import pytest

from ddl_magic import HorovodRunner, RankFailedError, TorchDistributor, distributed, last_run
from ddl_magic.data import Data
from ddl_magic.frontends import ddlrun
from ddl_magic.frontends.data_options import shares_for_run
from kernel import Kernel
from share_files import held_share_files, none_held_within


def _frame(rows: int) -> pd.DataFrame:
    return pd.DataFrame({"id": np.arange(rows),
                         "v": [np.full(3, i, dtype=np.float32) for i in range(rows)]})


def read_epochs(train, tiny=None, epochs=2):
    """Every rank's ids per epoch (a function the ranks run), and the steps it agreed on."""
    import ddl_magic.torch as hvd

    hvd.init()
    loader = train.loader(batch_size=64, columns=["id", "v"], seed=1, drop_last=False)
    seen = [[int(i) for batch in loader for i in batch["id"]] for _ in range(epochs)]
    steps = len(tiny.loader(batch_size=1, columns=["id"])) if tiny is not None else None
    return {"rank": hvd.rank(), "ids": seen, "steps": len(loader), "tiny_steps": steps,
            "rows": train.num_rows}


def _check_exactly_once(results, rows):
    for epoch in range(len(results[0]["ids"])):
        ids = sorted(i for result in results for i in result["ids"][epoch])
        assert ids == list(range(rows)), f"epoch {epoch}"
    assert results[0]["ids"][0] != results[0]["ids"][1]  # a new order every epoch


def test_a_pandas_dataframe_and_its_share_on_every_rank_with_an_empty_one(capfd):
    results = distributed(np=3)(read_epochs).distributed(train=_frame(1000), tiny=_frame(2))
    out = capfd.readouterr().out
    assert "train: pandas DataFrame → each rank's share, 1,000 rows in 3 shares" in out
    assert sorted(r["rows"] for r in results) == [333, 333, 334]  # unequal shares...
    assert {r["steps"] for r in results} == {6}  # ...equal steps
    assert {r["tiny_steps"] for r in results} == {0}  # an empty share: no rank steps, none waits
    _check_exactly_once(results, 1000)


def test_parquet_split_by_row_groups_through_ddlrun(tmp_path, capfd):
    folder = tmp_path / "train"
    folder.mkdir()
    table = pyarrow.Table.from_pandas(_frame(600), preserve_index=False)
    for part in range(3):
        pyarrow.parquet.write_table(table.slice(part * 200, 200), folder / f"part-{part}.parquet",
                                    row_group_size=70)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import ddl_magic.data, ddl_magic.torch as hvd
        hvd.init()
        train = ddl_magic.data.share("train")
        ids = [int(i) for batch in train.loader(batch_size=50, columns=["id"]) for i in batch["id"]]
        everyone = sorted(i for rank in hvd.allgather_object(ids) for i in rank)
        print("rows", train.num_rows, "unique", len(set(everyone)), "of", len(everyone))
    """))
    assert ddlrun.main(["-np", "2", "--data", f"train={folder}", "python", str(script)]) == 0
    out = capfd.readouterr().out
    assert "train: Parquet (3 files, 9 row groups) → each rank's share, 600 rows in 2 shares" in out
    assert "[0] rows 300 unique 600 of 600" in out and "[1] rows 300" in out


def test_a_delta_table_split_among_the_ranks_with_its_partition_column(tmp_path, capfd):
    deltalake = pytest.importorskip("deltalake")
    frame = _frame(90).assign(part=lambda df: df["id"] % 3)
    deltalake.write_deltalake(str(tmp_path / "table"), frame[["id", "part"]], partition_by=["part"])
    results = distributed(np=2)(read_parts).distributed(train=Data(tmp_path / "table"))
    assert "train: Delta table (version 0) (3 files, 3 row groups) → each rank's share, 90 rows" in capfd.readouterr().out
    rows = sorted(row for result in results for row in result)
    assert rows == sorted((i, i % 3) for i in range(90))


def read_parts(train):
    return [(int(i), int(p)) for batch in train.loader(batch_size=5, drop_last=False)
            for i, p in zip(batch["id"], batch["part"])]


def delete_then_read(train, path):
    import ddl_magic.torch as hvd

    hvd.init()
    if hvd.rank() == 0:
        os.remove(path)
    hvd.barrier()
    return train.num_rows


def test_a_source_failing_mid_read_names_the_rank_and_the_file(tmp_path):
    folder = tmp_path / "train"
    folder.mkdir()
    for part in range(2):
        pyarrow.parquet.write_table(pyarrow.Table.from_pandas(_frame(10), preserve_index=False),
                                    folder / f"part-{part}.parquet")
    with pytest.raises(RankFailedError) as failure:
        HorovodRunner(np=-2).run(delete_then_read, train=Data(folder),
                                 path=str(folder / "part-1.parquet"))
    assert failure.value.rank == 1
    assert "rank 1 could not read" in failure.value.traceback
    assert "part-1.parquet" in failure.value.traceback


def elastic_epochs(train, log_dir, epochs=2):
    """Each trained batch's ids, logged per slot and epoch; slot 1 SIGKILLs itself once,
    mid-epoch 0, before its 7th step (the others' step then fails, and goes back to the
    last commit)."""
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    loader = train.loader(batch_size=10, columns=["id"], seed=4)
    state = hvd.elastic.TorchState(loader=loader)
    slot = os.environ["DDL_MAGIC_SLOT"]

    @hvd.elastic.run
    def run(state):
        while loader.epoch < epochs:
            for batch in loader:
                marker = os.path.join(log_dir, "killed")
                if slot == "1" and loader.step == 6 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                hvd.allreduce(torch.ones(1), name="step")  # a training step's gradients
                with open(os.path.join(log_dir, f"slot-{slot}-epoch-{loader.epoch}"), "a") as log:
                    log.write("".join(f"{int(i)}\n" for i in batch["id"]))
                state.commit()
        return len(loader)

    return run(state)


def test_an_elastic_run_losing_a_rank_reads_its_rows_again_from_the_source(tmp_path):
    steps = HorovodRunner(np=-2, min_np=1).run(elastic_epochs, train=_frame(200),
                                               log_dir=str(tmp_path))
    assert steps == 10 and (tmp_path / "killed").exists()
    for epoch in range(2):  # the replacement went on with slot 1's rows where it was lost
        ids = [int(line) for slot in range(2)
               for line in (tmp_path / f"slot-{slot}-epoch-{epoch}").read_text().split()]
        assert sorted(ids) == list(range(200)), f"epoch {epoch}"


def count_rows(train):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    steps = len(train.loader(batch_size=10, columns=["id"]))  # agreed over gloo
    dist.destroy_process_group()
    return steps


def test_torch_distributor_and_bad_columns_and_values_refused_before_launch():
    assert TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        count_rows, train=_frame(45)) == 2
    ran = last_run()
    frame = _frame(10).assign(city="x")
    with pytest.raises(TypeError, match="train: column 'city' is string"):
        HorovodRunner(np=-2).run(count_rows, train=frame)
    with pytest.raises(ValueError, match=r"train: columns with nulls .*'x' \(2 nulls\)"):
        HorovodRunner(np=-2).run(count_rows, train=_frame(10).assign(x=[None, 1.0, None] + [2.0] * 7))
    uneven = _frame(10).assign(v=[np.ones(3 if i else 2, np.float32) for i in range(10)])
    with pytest.raises(ValueError, match="column 'v' holds arrays of 2 to 3 values"):
        HorovodRunner(np=-2).run(count_rows, train=Data(uneven, columns=["id", "v"]))
    assert last_run() is ran, "a rank was started"
    with shares_for_run({"train": Data(frame, columns=["id"])}, 2, on_spark=False) as left_out:
        assert left_out.shares["train"].columns == ["id"]  # what columns= leaves out is not read


def hold_then_die(train):
    import ddl_magic.torch as hvd

    hvd.init()
    train.file()
    hvd.barrier()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.barrier()


def test_nothing_left_on_disk_after_a_sigkilled_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_SHARE_DIR", str(tmp_path))
    with pytest.raises(RankFailedError, match="SIGKILL"):
        HorovodRunner(np=-2).run(hold_then_die, train=_frame(100))
    assert os.listdir(tmp_path) == []  # the files never had a name there
    assert held_share_files(tmp_path) == []


@pytest.fixture(scope="module")
def shares_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("shares")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory, shares_folder):
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "DDL_MAGIC_SHARE_DIR": str(shares_folder)},
                    cwd=str(tmp_path_factory.mktemp("data")))
    setup = kernel.run("%load_ext ddl_magic\nimport numpy as np, pandas as pd\n"
                       "df = pd.DataFrame({'id': np.arange(10), 'x': np.arange(10.0)})\n"
                       "other = pd.DataFrame({'id': np.arange(100, 106)})")
    assert setup.error is None, setup.error
    yield kernel
    try:
        kernel.close()
    except RuntimeError:  # the last test killed it
        pass


def test_the_magic_gives_a_cell_its_data_and_a_pool_keeps_it_across_cells(kernel):
    cell = kernel.run("%%horovod -np 2 --data train=df\nimport ddl_magic.torch as hvd\nhvd.init()\n"
                      "sorted(sum(hvd.allgather_object([int(i) for b in train.loader(batch_size=5)"
                      " for i in b['id']]), []))")
    assert cell.error is None, cell.error
    assert "train: pandas DataFrame → each rank's share, 10 rows in 2 shares" in cell.text
    assert cell.result == str(list(range(10)))
    started = kernel.run("%horovod start -np 2 --local --data train=df")
    assert started.error is None, started.error
    read = ("%%horovod --all-ranks\nsorted(int(i) for b in train.loader(batch_size=1, "
            "shuffle=False) for i in b['id'])")
    first, second = kernel.run(read), kernel.run(read)
    assert first.error is None and first.result == second.result == "[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]"
    replaced = kernel.run("%horovod data train=other")
    assert replaced.error is None, replaced.error
    assert kernel.run(read).result == "[[100, 101, 102], [103, 104, 105]]"
    kernel.run("%horovod stop")


def test_a_killed_kernel_leaves_no_share_behind(kernel, shares_folder):
    started = kernel.run("%horovod start -np 2 --local --data train=df")
    assert started.error is None, started.error
    assert held_share_files(shares_folder)  # the ranks hold their shares
    os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
    # the ranks exit once their control connection closes
    assert none_held_within(shares_folder, timeout_s=10) == []
    assert os.listdir(shares_folder) == []
