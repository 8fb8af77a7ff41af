"""Spark DataFrames given to a run: checked on the driver, then cut into the ranks' shares
by the run's own barrier stage, each task writing its rank's share on its executor.

    df ─select, vectors as float32 arrays─┐
    df2 ─ ... ────────────────────────────┼─ union, each row keyed to a rank ─ repartition
                                          ┘   (np partitions)  ─ barrier stage: task r
                                                                   writes rank r's shares

Several datasets go through one stage: each DataFrame's rows become a struct column of its
own (the others' null) in one union, keyed round robin to the ranks, so every rank gets a
share of each whose sizes differ by a few rows at most. The key of rank r is a number that
Spark's hash partitioning sends to partition r (`partition_keys`: Spark's Murmur3, computed
here), so the exchange needs no sort, unlike `repartition(n)`'s round robin.

Before any rank starts (`spark_shares`): every column's type (from the schema, free), and in
one aggregation the rows and the nulls of the columns Spark says may hold nulls (a
DataFrame of non-nullable columns costs a count, which Spark answers without reading them).
Null *elements* of arrays are not looked for here: that takes a pass over every value (a
second reading of the DataFrame, 4 s a million 784-wide rows), while the tasks writing the
shares get their count from Arrow for free, and every rank refuses them alike before its
first step (`data/loader.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.columns import UnsupportedColumnError
from ..data.share import Share, shares_line
from ..data.sources import Data, SparkShares

KEY_COLUMN = "__ddl_magic_key"
DATASET_COLUMN = "__ddl_magic_dataset"
SPARK_HASH_SEED = 42  # the seed of Spark's Murmur3Hash, which hash partitioning uses


@dataclass
class ShareStage:
    """The DataFrame a run's barrier stage runs over (np partitions, one per rank), and
    what its tasks need to write the shares (`plan`, plain data: sent to the executors)."""

    frame: object
    plan: dict  # {"names": [...], "schemas": [bytes...], "expected_rows": [...]}


def spark_shares(frames: dict[str, Data], np: int,
                 checked_rows: dict[str, int] | None = None) -> tuple[ShareStage, dict, dict]:
    """The stage, a `Share` per name and a line per name, for `frames` on `np` ranks; raises
    before anything starts for a column the ranks cannot read or one with nulls.
    `checked_rows`: the rows of frames whose nulls the caller already refused (no count)."""
    from pyspark.sql import functions

    selected, shares, lines, schemas, expected = {}, {}, {}, [], []
    for name, given in frames.items():
        frame = _readable(name, given.source, given.columns)
        rows = (checked_rows or {}).get(name)
        if rows is None:
            rows = _count_and_check_nulls(name, frame)
        schema = _arrow_schema(frame)
        schema_bytes = schema.serialize().to_pybytes()
        selected[name] = frame
        schemas.append(schema_bytes)
        expected.append(rows // np + 1)
        shares[name] = Share(name, SparkShares(np, rows, schema_bytes), "DataFrame")
        lines[name] = shares_line(name, "DataFrame", rows, np)
    keys = partition_keys(np)
    key = functions.element_at(functions.array(*[functions.lit(k).cast("long") for k in keys]),
                               (functions.pmod(functions.monotonically_increasing_id()
                                               + functions.spark_partition_id(),
                                               functions.lit(np)) + 1).cast("int"))
    names = list(selected)
    structs = {name: functions.struct(*[frame[c] for c in frame.columns])
               for name, frame in selected.items()}
    parts = []
    for index, name in enumerate(names):
        columns = [key.alias(KEY_COLUMN), functions.lit(index).alias(DATASET_COLUMN)]
        for other in names:
            columns.append(structs[other].alias(f"d{names.index(other)}") if other == name
                           else functions.lit(None).cast(_struct_type(selected[other]))
                           .alias(f"d{names.index(other)}"))
        parts.append(selected[name].select(*columns))
    union = parts[0]
    for part in parts[1:]:
        union = union.unionByName(part)
    stage = ShareStage(union.repartition(np, KEY_COLUMN),
                       {"names": names, "schemas": schemas, "expected_rows": expected})
    return stage, shares, lines


def partition_keys(np: int) -> list[int]:
    """For each partition r of `np`, the smallest number Spark's hash partitioning sends there.

    >>> partition_keys(2)
    [0, 2]
    """
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < np:
        keys.setdefault(spark_hash_long(candidate) % np, candidate)
        candidate += 1
    return [keys[r] for r in range(np)]


def spark_hash_long(value: int, seed: int = SPARK_HASH_SEED) -> int:
    """Spark's `hash()` of a long (Murmur3 x86 32-bit, `Murmur3_x86_32.hashLong`), signed."""
    def mix_k1(k1: int) -> int:
        k1 = (k1 * 0xCC9E2D51) & 0xFFFFFFFF
        k1 = ((k1 << 15) | (k1 >> 17)) & 0xFFFFFFFF
        return (k1 * 0x1B873593) & 0xFFFFFFFF

    def mix_h1(h1: int, k1: int) -> int:
        h1 ^= k1
        h1 = ((h1 << 13) | (h1 >> 19)) & 0xFFFFFFFF
        return (h1 * 5 + 0xE6546B64) & 0xFFFFFFFF

    value &= 0xFFFFFFFFFFFFFFFF
    h1 = mix_h1(seed & 0xFFFFFFFF, mix_k1(value & 0xFFFFFFFF))
    h1 = mix_h1(h1, mix_k1(value >> 32))
    h1 ^= 8
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & 0xFFFFFFFF
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def _readable(name: str, frame, columns):
    """`frame`'s columns as the ranks read them (ML vectors as arrays of float32), or an error
    naming the first that cannot become a tensor and what to do."""
    from pyspark.sql.types import ArrayType, BooleanType, DecimalType, NumericType

    names = list(columns) if columns is not None else frame.columns
    missing = [column for column in names if column not in frame.columns]
    if missing:
        raise KeyError(f"{name}: columns {missing} are not in the DataFrame; it has "
                       f"{frame.columns}")
    selected = []
    for column in names:
        data_type = frame.schema[column].dataType
        element = data_type.elementType if isinstance(data_type, ArrayType) else data_type
        if type(data_type).__name__ == "VectorUDT":
            from pyspark.ml.functions import vector_to_array

            selected.append(vector_to_array(frame[column], "float32").alias(column))
        elif isinstance(element, (NumericType, BooleanType)) and not isinstance(element, DecimalType):
            selected.append(frame[column])
        else:
            advice = ("cast it (col.cast('double'))" if isinstance(element, DecimalType) else
                      "featurize it first (StringIndexer, a hash or a cast in a select)")
            raise UnsupportedColumnError(
                f"{name}: column {column!r} is {data_type.simpleString()}: a loader turns "
                f"numbers, arrays of numbers and ML vectors into tensors. {advice[0].upper()}"
                f"{advice[1:]}, or leave it out (select the columns to train on, or "
                "Data(df, columns=[...]))")
    return frame.select(*selected)


def _count_and_check_nulls(name: str, frame) -> int:
    """The rows, counted in the one aggregation that also counts the nulls of every column
    Spark says may hold some; raises ValueError naming each column with nulls and how many.
    (Null elements of arrays: the ranks, from the shares; see the module's docstring.)"""
    from pyspark.sql import functions

    checks = [functions.count(functions.lit(1)).alias("rows")]
    for field in frame.schema.fields:
        if field.nullable:
            checks.append(functions.sum(frame[field.name].isNull().cast("long"))
                          .alias(f"nulls:{field.name}"))
    found = frame.agg(*checks).first().asDict()
    nulls = {key.split(":", 1)[1]: count for key, count in found.items()
             if key != "rows" and count}
    if nulls:
        listed = ", ".join(f"{column!r} ({count:,} rows)" for column, count in nulls.items())
        raise ValueError(
            f"{name}: columns with nulls: {listed}. Drop or fill them "
            f"first (df.dropna(subset={list(nulls)}) or df.fillna(...)), or leave them out")
    return int(found["rows"])


def _arrow_schema(frame):
    import pyarrow
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(frame.schema)
    return pyarrow.schema([field.with_nullable(True) for field in schema])


def _struct_type(frame):
    from pyspark.sql.types import StructType

    return StructType(frame.schema.fields)
