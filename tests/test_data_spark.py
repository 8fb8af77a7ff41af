"""A Spark DataFrame given to a run reaches every rank as its share, written by the rank's own
barrier task beside it: on a real local SparkSession, classic and Spark Connect."""

import os
import re
import sys

import pytest
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import functions

import ddl_magic
from ddl_magic import HorovodRunner, RankFailedError
from ddl_magic.driver.capture import capture_cell
from ddl_magic.launch.spark_shares import partition_keys, spark_hash_long

from share_files import none_held_within
from spark_sessions import classic_only, connect_only, no_spark_job_active, sent_by_value


@pytest.fixture(scope="module", autouse=True)
def functions_travel_by_value():
    with sent_by_value(sys.modules[__name__]):
        yield


def numbered(spark, rows, partitions):
    """Rows with an id, an ML vector (id, id % 3) and an array column; some partitions empty."""
    frame = (spark.range(0, rows, 1, partitions)
             .select("id", (functions.col("id") % 3).cast("double").alias("third"),
                     functions.array(functions.col("id").cast("float"),
                                     functions.lit(1.0).cast("float")).alias("pair")))
    return VectorAssembler(inputCols=["id", "third"], outputCol="features").transform(frame)


def read_twice(train, val):
    import ddl_magic.torch as hvd

    hvd.init()
    out = {"rows": train.num_rows, "epochs": [], "val": []}
    loader = train.loader(batch_size=16, columns=["id", "features", "pair"], seed=3,
                          drop_last=False)
    for _ in range(2):
        ids = []
        for batch in loader:
            assert batch["features"].shape[1:] == (2,) and str(batch["features"].dtype) == "torch.float32"
            assert (batch["features"][:, 0] == batch["id"].float()).all()
            ids += batch["id"].tolist()
        out["epochs"].append(ids)
    out["val"] = [i for batch in val.loader(batch_size=4, columns=["id"]) for i in batch["id"].tolist()]
    return hvd.allgather_object(out)


def test_spark_hash_partitioning_sends_each_key_to_its_rank(spark):
    classic_only(spark, "Spark's hash is the same behind either session")
    hashes = spark.range(0, 40).select("id", functions.hash("id").alias("h")).collect()
    assert all(spark_hash_long(row.id) == row.h for row in hashes)
    keys = partition_keys(3)
    placed = (spark.createDataFrame([(key,) for key in keys], "key long").repartition(3, "key")
              .select("key", functions.spark_partition_id().alias("p")).collect())
    assert sorted((keys.index(row.key), row.p) for row in placed) == [(0, 0), (1, 1), (2, 2)]


@pytest.mark.parametrize("change, error, message", [
    (lambda df: df.withColumn("city", functions.lit("x")), TypeError,
     r"train: column .city. is string: .*Featurize it first .* or leave it out"),
    (lambda df: df.withColumn("nested", functions.array(functions.array(functions.lit(1.0)))),
     TypeError, r"column 'nested' is array<array<double>>"),
    (lambda df: df.withColumn("maybe", functions.when(functions.col("id") > 2, 1.0)), ValueError,
     r"train: columns with nulls: 'maybe' \(3 rows\)"),
])
def test_bad_input_is_refused_before_any_rank_starts(spark, change, error, message):
    before = ddl_magic.last_run()
    with pytest.raises(error, match=message):
        HorovodRunner(np=2).run(read_twice, train=change(numbered(spark, 20, 2)), val=None)
    assert ddl_magic.last_run() is before, "a rank was started"


def test_null_elements_of_an_array_are_refused_on_every_rank_before_the_first_step(spark):
    """Not counted before launch (a pass over every value): the tasks writing the shares count
    them from Arrow, and the ranks refuse them alike, with their counts, before a step."""
    classic_only(spark, "the ranks' refusal is the same behind either session")
    holes = numbered(spark, 20, 2).withColumn("pair", functions.array(
        functions.when(functions.col("id") > 2, functions.lit(1.0)).cast("float"),
        functions.lit(1.0).cast("float")))
    with pytest.raises(RankFailedError) as failure:
        HorovodRunner(np=2).run(read_twice, train=holes, val=None)
    assert re.search(r"dataset 'train': column 'pair' has 3 nulls \(rank \d: [123]",
                     failure.value.traceback), failure.value.traceback
    assert no_spark_job_active()


def hold_then_die(train, told):
    """Each rank writes down the share files it holds (`…/ddl_magic-share-… (deleted)`), then
    rank 1 is SIGKILLed while rank 0 waits for it."""
    import os
    import signal

    import ddl_magic.torch as hvd

    hvd.init()
    train.file()
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            pass
    with open(told, "a") as written:
        written.writelines(f"{link}\n" for link in links if "ddl_magic-share-" in link)
    hvd.barrier()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.barrier()


def test_nothing_left_on_disk_after_a_sigkilled_rank_on_spark(spark, tmp_path):
    """The tasks write the shares into Spark's local folder, as files with no name: once the
    run has failed, no process holds one and the folder holds none."""
    classic_only(spark, "the tasks and their files are the same behind either session")
    told = tmp_path / "held"
    with pytest.raises(RankFailedError, match="SIGKILL"):
        HorovodRunner(np=2).run(hold_then_die, train=numbered(spark, 40, 2), told=str(told))
    held = set(told.read_text().splitlines())  # a rank may hold its share more than once
    assert len(held) == 2 and all(link.endswith(" (deleted)") for link in held), held
    for folder in {os.path.dirname(link) for link in held}:
        assert none_held_within(folder, timeout_s=30) == []
        assert not [name for name in os.listdir(folder) if name.startswith("ddl_magic-share-")]
    assert no_spark_job_active()


def test_an_elastic_run_on_spark_is_refused_a_dataframe_saying_what_to_do(spark):
    classic_only(spark, "the refusal is the launcher's, whatever the session")
    with pytest.raises(ValueError, match="an elastic run on Spark cannot be given a Spark "
                                         "DataFrame: .* Write the DataFrame to Parquet"):
        HorovodRunner(np=2, min_np=1).run(read_twice, train=numbered(spark, 20, 2), val=None)


def test_a_cell_reads_a_dataframe_and_is_given_another_each_row_once_per_epoch(spark, capfd):
    """One stage writes both: `train`, which the cell reads (its share, by itself), and `val`
    given with --data; every row once per epoch across the ranks, in a new order each."""
    classic_only(spark, "the Connect session runs the same stage as a pool's")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("ddl_magic")
    shell.user_ns.update(train=numbered(spark, 1001, 3), read_twice=read_twice,
                         held_out=numbered(spark, 30, 4).where("id < 9"))
    cell = shell.run_cell("%%horovod -np 2 --data val=held_out\nread_twice(train, val)")
    assert cell.error_in_exec is None, cell.error_in_exec
    out = capfd.readouterr().out
    assert "train: DataFrame → each rank's share, 1,001 rows in 2 shares" in out
    assert "val: DataFrame → each rank's share, 9 rows in 2 shares" in out
    results = cell.result
    assert sorted(r["rows"] for r in results) == [500, 501]
    for epoch in range(2):
        assert sorted(i for r in results for i in r["epochs"][epoch]) == list(range(1001))
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
    assert len(sum((r["val"] for r in results), [])) == 8  # 4 and 5 rows: one batch each
    assert no_spark_job_active()


@pytest.mark.long_on_connect  # Spark Connect runs in CI: spark_launcher, estimator, inference
def test_a_spark_pool_keeps_the_shares_its_tasks_wrote_at_its_start(spark):
    connect_only(spark, "the classic session runs the magic's stage")
    read = ("sorted(sum(hvd.allgather_object([int(i) for b in train.loader(batch_size=8, "
            "columns=['id']) for i in b['id']]), []))")
    with ddl_magic.start(np=2, spark=True, data={"train": numbered(spark, 50, 3)},
                         quiet=True) as pool:
        for _ in range(2):  # across cells, the same shares: 2 x 3 batches of 8 of 50 rows
            cell = capture_cell(f"import ddl_magic.torch as hvd\nhvd.init()\n{read}", {})
            seen = pool.run_cell(cell.payload, quiet=True).result
            assert len(seen) == len(set(seen)) == 48 and set(seen) <= set(range(50))
        with pytest.raises(ddl_magic.driver.pool.PoolError, match="only take rows as the pool starts"):
            ddl_magic.frontends.pool_magic.load_data(pool, {"train": numbered(spark, 5, 1)})
    assert no_spark_job_active()
