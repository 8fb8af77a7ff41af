"""Which columns a loader turns into tensors, and how: decided from the Arrow type alone.

| Arrow type                              | tensor                         |
|-----------------------------------------|--------------------------------|
| integers, floats, booleans              | 1-D, of the same type          |
| a list (or fixed-size list) of those    | 2-D `[rows, width]`, every row the same width |
| Spark ML vectors                        | written as lists of float32 by the Spark stage: 2-D float32 |

Anything else (strings, maps, structs, lists of lists, dates, decimals) is refused with its
type and what to do, before any rank starts where the front-end can tell (`check_columns`).
Values too: nulls, and arrays of uneven width, cannot become a tensor (`describe_bad_values`,
where the rows are at hand; the loader's agreement refuses them otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow
import pyarrow.compute

# Unsigned integers torch has no tensor type for are widened to int64.
_WIDENED = {pyarrow.uint16(): np.int64, pyarrow.uint32(): np.int64, pyarrow.uint64(): np.int64}


class UnsupportedColumnError(TypeError):
    """A column a loader cannot turn into tensors; the message says what to do."""


def element_dtype(arrow_type: pyarrow.DataType) -> np.dtype | None:
    """The numpy type of a number column's values, or None if it is not a number column."""
    if arrow_type in _WIDENED:
        return np.dtype(_WIDENED[arrow_type])
    if (pyarrow.types.is_integer(arrow_type) or pyarrow.types.is_floating(arrow_type)
            or pyarrow.types.is_boolean(arrow_type)):
        return np.dtype(arrow_type.to_pandas_dtype())
    return None


def is_list(arrow_type: pyarrow.DataType) -> bool:
    return (pyarrow.types.is_list(arrow_type) or pyarrow.types.is_large_list(arrow_type)
            or pyarrow.types.is_fixed_size_list(arrow_type))


def describe_unsupported(name: str, arrow_type: pyarrow.DataType) -> str | None:
    """Why column `name` cannot become a tensor, and what to do; None if it can.

    >>> describe_unsupported("label", pyarrow.int32()) is None
    True
    >>> print(describe_unsupported("city", pyarrow.string()))
    column 'city' is string: a loader turns numbers, arrays of numbers and ML vectors into tensors. Featurize it first (StringIndexer, a hash or a cast in a select), or leave it out (select the columns to train on, or columns=[...])
    """
    if element_dtype(arrow_type) is not None:
        return None
    if is_list(arrow_type) and element_dtype(arrow_type.value_type) is not None:
        return None
    kind = ("array of arrays" if is_list(arrow_type) and is_list(arrow_type.value_type)
            else _spark_name(arrow_type))
    return (f"column {name!r} is {kind}: a loader turns numbers, arrays of numbers and ML "
            "vectors into tensors. Featurize it first (StringIndexer, a hash or a cast in a "
            "select), or leave it out (select the columns to train on, or columns=[...])")


def check_columns(schema: pyarrow.Schema, columns: Sequence[str] | None = None) -> list[str]:
    """The columns to read (all of `schema`'s if None), each one a loader can read; raises
    `UnsupportedColumnError` for the first that is not, and KeyError for a missing one."""
    names = list(schema.names if columns is None else columns)
    missing = [name for name in names if name not in schema.names]
    if missing:
        raise KeyError(f"columns {missing} are not in the data; it has {schema.names}")
    for name in names:
        problem = describe_unsupported(name, schema.field(name).type)
        if problem is not None:
            raise UnsupportedColumnError(problem)
    return names


def describe_bad_values(table: pyarrow.Table) -> str | None:
    """What in `table`'s values cannot become a tensor (nulls, null elements of arrays,
    arrays of uneven width), with the counts and what to do; None if nothing. Reads Arrow's
    null counts and list lengths, never copies the values.

    >>> print(describe_bad_values(pyarrow.table({"x": [1.0, None], "v": [[1, 2], [3]]})))
    columns with nulls (or null elements): 'x' (1 null). Drop or fill them first (df.dropna(subset=['x']) or df.fillna(...)), or leave them out (columns=[...])
    """
    nulls, uneven = {}, {}
    for name in table.column_names:
        column = table.column(name)
        count = column.null_count
        if is_list(column.type):
            count += sum(chunk.flatten().null_count for chunk in column.chunks)
            lengths = pyarrow.compute.min_max(pyarrow.compute.list_value_length(column))
            low, high = lengths["min"].as_py(), lengths["max"].as_py()
            if low is not None and low != high:
                uneven[name] = (low, high)
        if count:
            nulls[name] = count
    if nulls:
        listed = ", ".join(f"{name!r} ({count:,} null{'s' if count > 1 else ''})"
                           for name, count in nulls.items())
        return (f"columns with nulls (or null elements): {listed}. Drop or fill them first "
                f"(df.dropna(subset={list(nulls)}) or df.fillna(...)), or leave them out "
                "(columns=[...])")
    if uneven:
        name, (low, high) = next(iter(uneven.items()))
        return (f"column {name!r} holds arrays of {low} to {high} values: every row must have "
                "the same length to make a 2-D tensor (pad or trim them first)")
    return None


def _spark_name(arrow_type: pyarrow.DataType) -> str:
    """The type as a Spark user reads it: string, map<string,int>, struct<...>, date..."""
    if pyarrow.types.is_string(arrow_type) or pyarrow.types.is_large_string(arrow_type):
        return "string"
    if pyarrow.types.is_struct(arrow_type):
        return f"struct<{','.join(f'{field.name}:{_spark_name(field.type)}' for field in arrow_type)}>"
    if pyarrow.types.is_map(arrow_type):
        return f"map<{_spark_name(arrow_type.key_type)},{_spark_name(arrow_type.item_type)}>"
    if is_list(arrow_type):
        return f"array<{_spark_name(arrow_type.value_type)}>"
    return str(arrow_type)
