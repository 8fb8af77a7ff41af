"""Reduction operations, numbered as in Horovod so ported code passing ints still works."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    ADASUM = 2  # accepted by name for clear errors; not implemented
    MIN = 3
    MAX = 4
    PRODUCT = 5

    @property
    def kernel_name(self) -> str:
        """The elementwise reduction the ring applies (Average sums, then scales by 1/size)."""
        return _KERNEL_NAMES[self]


_KERNEL_NAMES = {ReduceOp.AVERAGE: "sum", ReduceOp.SUM: "sum", ReduceOp.MIN: "min",
                 ReduceOp.MAX: "max", ReduceOp.PRODUCT: "product"}


def as_reduce_op(op: "int | ReduceOp | None", average: "bool | None" = None) -> ReduceOp:
    """Resolve Horovod's `op=` / legacy `average=` arguments to one ReduceOp (default Average)."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    if type(op) is ReduceOp and op is not ReduceOp.ADASUM:
        return op  # hvd.Sum and friends, as most calls pass them
    try:
        resolved = ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"unknown reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product"
        ) from None
    if resolved is ReduceOp.ADASUM:
        raise NotImplementedError("hvd.Adasum is not supported by ddl_magic; use hvd.Average or hvd.Sum")
    return resolved
