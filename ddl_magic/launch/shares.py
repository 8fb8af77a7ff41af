"""Datasets given to a run become the ranks' shares: checked, described, and made ready
before any rank starts. Every front-end calls `prepare_shares` with the datasets it was given
(`--data train=df`, `run(main, train=df)`, a Spark DataFrame a cell reads, `ddlrun --data`)
and puts each `Share` where the ranks' code finds it.

| given                          | how the ranks get their shares                                  |
|--------------------------------|-----------------------------------------------------------------|
| a Spark DataFrame (ranks on Spark) | the barrier stage runs over it; each task writes its rank's share on its executor (`spark_shares.py`) |
| a pandas DataFrame             | written once here, as Arrow, to a file with no name that every local rank maps (on Spark: made a Spark DataFrame) |
| an Arrow/Feather file          | every rank maps it                                              |
| Parquet files or a folder, a Delta table | each rank reads its row groups with pyarrow (the path must be readable where the ranks run) |

Rows never pass through the driver, except a pandas DataFrame's, which is already here.
What a run was given is said in one line per dataset (`RunData.lines`), as the capture line
does for the names a cell reads: `train: DataFrame → each rank's share, 1,000,000 rows in 4
shares`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow
import pyarrow.dataset

from ..data.columns import UnsupportedColumnError, check_columns, describe_bad_values
from ..data.share import Share, shares_line
from ..data.share_file import ShareWriter
from ..data.sources import ArrowFileShares, Data, DatasetShares

ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


@dataclass
class RunData:
    """The datasets of one run (or pool), ready: a `Share` for each name, what to say about
    them, and for a Spark run the stage that writes their shares (`spark_shares.ShareStage`)."""

    shares: dict[str, Share] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    spark_stage: object | None = None
    _held: list[int] = field(default_factory=list)  # descriptors of files the ranks map
    _folders: list[str] = field(default_factory=list)  # where /proc is missing: named files

    def report(self) -> str:
        return "\n".join(f"ddl_magic: {line}" for line in self.lines)

    def close(self) -> None:
        """Let go of the files this process holds for the ranks: gone once they let go too."""
        while self._held:
            os.close(self._held.pop())
        while self._folders:
            shutil.rmtree(self._folders.pop(), ignore_errors=True)


def is_dataset(value: object) -> bool:
    """Whether `value` is something a run can hand out as shares: a Spark or pandas
    DataFrame, or `Data(...)`. (A path is data only where a front-end says so: `--data`.)"""
    return isinstance(value, Data) or is_spark_dataframe(value) or _is_pandas(value)


def is_spark_dataframe(value: object) -> bool:
    return type(value).__module__.startswith("pyspark.sql") and type(value).__name__ == "DataFrame"


def prepare_shares(datasets: Mapping[str, object], np: int, on_spark: bool) -> RunData:
    """Check every dataset and make its shares ready for `np` ranks (Spark barrier tasks if
    `on_spark`, else local processes). Raises ValueError, TypeError (a column the ranks
    cannot read) or FileNotFoundError, each saying what to do, before anything starts."""
    data = RunData()
    frames: dict[str, Data] = {}
    try:
        for name, value in datasets.items():
            if not name.isidentifier():
                raise ValueError(f"{name!r} cannot name a dataset: the ranks' code reads it "
                                 "by that name, so it must be a Python name, e.g. train=df")
            given = value if isinstance(value, Data) else Data(value)
            if _is_pandas(given.source) and on_spark:
                given = Data(_spark_session().createDataFrame(given.source), given.columns)
            if is_spark_dataframe(given.source):
                if not on_spark:
                    raise ValueError(
                        f"{name}: a Spark DataFrame's shares are written by Spark tasks beside "
                        "the ranks, and this run's ranks are local processes: run them on "
                        "Spark (--spark, HorovodRunner(np>0), remote=True), or write the "
                        "DataFrame to Parquet and give the path")
                frames[name] = given
            elif _is_pandas(given.source):
                _add(data, name, *_pandas_shares(name, given, np, data))
            elif isinstance(given.source, (str, os.PathLike)):
                _add(data, name, *_path_shares(name, given, np))
            else:
                raise TypeError(
                    f"{name}: a run's data is a Spark DataFrame, a pandas DataFrame or the "
                    f"path of Parquet files, a Delta table or an Arrow file; got "
                    f"{type(given.source).__name__}")
        if frames:
            from .spark_shares import spark_shares

            stage, shares, lines = spark_shares(frames, np)
            data.spark_stage = stage
            for name in frames:
                data.shares[name], line = shares[name], lines[name]
                data.lines.append(line)
    except BaseException:
        data.close()
        raise
    return data


def _add(data: RunData, name: str, share: Share, line: str) -> None:
    data.shares[name] = share
    data.lines.append(line)


def _pandas_shares(name: str, given: Data, np: int, data: RunData) -> tuple[Share, str]:
    """Write the DataFrame once, as Arrow, to a file with no name; every rank maps it."""
    table = pyarrow.Table.from_pandas(given.source, preserve_index=False)
    columns = _checked(table.schema, given.columns, name)
    table = table.select(columns)
    problem = describe_bad_values(table)  # the rows are here: refuse them before any rank starts
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    if os.path.isdir(f"/proc/{os.getpid()}/fd"):
        writer = ShareWriter(table.schema, expected_rows=table.num_rows,
                             what="the pandas DataFrame's rows")
        data._held.append(writer.fd)
        for batch in table.to_batches(max_chunksize=65536):
            writer.write(batch)
        writer.finish()
        path = f"/proc/{os.getpid()}/fd/{writer.fd}"  # other processes of this user open it
    else:  # no /proc (macOS): a named file in a private folder, removed when the run ends
        folder = tempfile.mkdtemp(prefix="ddl_magic-share-")
        data._folders.append(folder)
        path = os.path.join(folder, f"{name}.arrow")
        with pyarrow.ipc.new_file(path, table.schema) as file:
            for batch in table.to_batches(max_chunksize=65536):
                file.write_batch(batch)
    source = ArrowFileShares(path, np, table.num_rows, table.schema.serialize().to_pybytes())
    return (Share(name, source, "pandas DataFrame"),
            shares_line(name, "pandas DataFrame", table.num_rows, np))


def _path_shares(name: str, given: Data, np: int) -> tuple[Share, str]:
    path = os.path.abspath(os.fspath(given.source))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name}: {path} does not exist (working directory "
                                f"{os.getcwd()})")
    if path.endswith(ARROW_SUFFIXES):
        with pyarrow.memory_map(path) as source:
            reader = pyarrow.ipc.open_file(source)
            schema = reader.schema
            rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        columns = _checked(schema, given.columns, f"{name} ({path})")
        if columns != schema.names:
            raise ValueError(f"{name}: an Arrow file is mapped as it is: columns= cannot leave "
                             "columns out of it; pick them in the loader (columns=[...])")
        return (Share(name, ArrowFileShares(path, np, rows, schema.serialize().to_pybytes()),
                      "Arrow file"), shares_line(name, f"Arrow file {path}", rows, np))
    if os.path.isdir(os.path.join(path, "_delta_log")):
        dataset, what = _delta_dataset(name, path)
    else:
        dataset = pyarrow.dataset.dataset(path, format="parquet", partitioning="hive")
        what = "Parquet"
    fragments = [group for fragment in dataset.get_fragments()
                 for group in fragment.split_by_row_group()]
    rows = tuple(group.row_groups[0].num_rows for group in fragments)
    columns = _checked(dataset.schema, given.columns, f"{name} ({path})")
    files = len({fragment.path for fragment in fragments})
    source = DatasetShares(tuple(fragments), rows, np, dataset.schema.serialize().to_pybytes(),
                           tuple(columns))
    described = f"{what} ({files} files, {len(fragments)} row groups)"
    return Share(name, source, what), shares_line(name, described, sum(rows), np)


def _delta_dataset(name: str, path: str):
    try:
        import deltalake
    except ImportError:
        raise ImportError(f"{name}: {path} is a Delta table, read with the deltalake package: "
                          "pip install 'ddl_magic[delta]'") from None
    table = deltalake.DeltaTable(path)
    return table.to_pyarrow_dataset(), f"Delta table (version {table.version()})"


def _checked(schema: pyarrow.Schema, columns, where: str) -> list[str]:
    try:
        return check_columns(schema, columns)
    except (KeyError, UnsupportedColumnError) as exc:
        raise type(exc)(f"{where}: {exc.args[0]}") from None


def _is_pandas(value: object) -> bool:
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(value, pandas.DataFrame)


def _spark_session():
    from . import spark_session

    session = spark_session()
    if session is None:
        raise RuntimeError("ranks on Spark need an active SparkSession")
    return session
