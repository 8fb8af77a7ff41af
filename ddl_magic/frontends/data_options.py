"""How every front-end takes a run's data, the same way: which of its arguments are datasets,
`--data NAME=VALUE` on a line, and the shares made of them for the run's length.

    %%horovod -np 4 --data train=df          (or a Spark DataFrame the cell reads: its share)
    HorovodRunner(np).run(main, train=df)    @distributed ... f.distributed(train=df)
    TorchDistributor(...).run(main, train=df)    ddlrun -np 2 --data train=/data/train.parquet
    %horovod start -np 2 --data train=df     %horovod data train=df     (a pool: kept)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from ..launch.shares import RunData, is_dataset, is_spark_dataframe, prepare_shares
from ..data.sources import Data


def datasets_among(values: Mapping[str, object]) -> dict[str, object]:
    """The keyword arguments that are datasets (Spark or pandas DataFrames, `Data(...)`)."""
    return {name: value for name, value in values.items() if is_dataset(value)}


def parse_data(specs: list[str], namespace: Mapping[str, object]) -> dict[str, object]:
    """`--data NAME=VALUE` options: VALUE a notebook name (a DataFrame, a `Data`, a path in a
    string) or a path. Raises ValueError saying how to write one.

    >>> parse_data(["train=/data/train.parquet"], {})
    {'train': Data(source='/data/train.parquet', columns=None)}
    """
    datasets = {}
    for spec in specs:
        name, equals, value = spec.partition("=")
        if not equals or not name.isidentifier() or not value:
            raise ValueError(f"--data {spec!r}: write NAME=VALUE, VALUE a DataFrame of the "
                             "notebook or a path, e.g. --data train=df or --data "
                             "train=/data/train.parquet")
        if value.isidentifier() and value in namespace:
            given = namespace[value]
            datasets[name] = Data(given) if isinstance(given, (str, os.PathLike)) else given
        elif value.isidentifier() and not os.path.exists(value):
            raise ValueError(f"--data {spec}: {value!r} is neither a name in the notebook nor "
                             "a path")
        else:
            datasets[name] = Data(value)
    return datasets


def dataframes_read(names: list[str], namespace: Mapping[str, object],
                    given: Mapping[str, object]) -> dict[str, object]:
    """The Spark DataFrames among the notebook names a cell reads, not already given with
    --data: each becomes the ranks' share under its own name (it could not be sent whole)."""
    given_ids = {id(value) for value in given.values()}
    return {name: namespace[name] for name in names
            if name in namespace and is_spark_dataframe(namespace[name])
            and id(namespace[name]) not in given_ids and name not in given}


@contextlib.contextmanager
def shares_for_run(datasets: Mapping[str, object], np: int, on_spark: bool,
                   quiet: bool = False) -> Iterator[RunData]:
    """The run's shares, said in one line per dataset unless `quiet`; the files this process
    holds for the ranks are let go when the run ends."""
    data = prepare_shares(datasets, np, on_spark)
    try:
        if data.lines and not quiet:
            print(data.report(), flush=True)
        yield data
    finally:
        data.close()
