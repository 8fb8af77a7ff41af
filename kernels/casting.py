"""How a value changes when it moves between dtypes with a scale factor.

Both backends follow one rule, so the torch reference can be the oracle for
the Triton kernels::

    scale == 1:  out = cast(x, out_dtype)
    otherwise:   out = cast(cast(x, compute) * cast(scale, compute), out_dtype)

``compute`` is float64 when either side is float64 or an integer, else
float32. So float16/bfloat16 are scaled in float32 and rounded once, and an
integer scaled by 0.5 becomes a float64 product rounded toward zero (a C
cast), exactly as ``torch.Tensor.copy_`` converts float to int. A scale of 1
is a plain copy, so int64 values beyond 2**53 survive it unchanged.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
INTEGER_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
SUPPORTED_DTYPES = FLOAT_DTYPES | INTEGER_DTYPES


def check_cast(src: torch.dtype, dst: torch.dtype) -> None:
    """Raise TypeError unless kernels can move ``src`` values into ``dst``.

    Allowed: any supported dtype to itself, and any float dtype to any other
    (compression to float16/bfloat16 and back).

    >>> check_cast(torch.float32, torch.bfloat16)
    >>> check_cast(torch.int32, torch.float32)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: cannot move torch.int32 values into torch.float32: only float dtypes convert to each other...
    """
    for dtype in (src, dst):
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
            raise TypeError(f"{dtype} is not supported by ddl_magic.kernels; use one of {names}")
    if src != dst and not (src in FLOAT_DTYPES and dst in FLOAT_DTYPES):
        raise TypeError(
            f"cannot move {src} values into {dst}: only float dtypes "
            f"convert to each other; use {src} on both sides"
        )


def compute_dtype(src: torch.dtype, dst: torch.dtype) -> torch.dtype:
    """The dtype a scale factor is applied in when moving ``src`` into ``dst``.

    >>> compute_dtype(torch.float32, torch.float16)
    torch.float32
    >>> compute_dtype(torch.int32, torch.int32)
    torch.float64
    """
    if torch.float64 in (src, dst) or src in INTEGER_DTYPES:
        return torch.float64
    return torch.float32


def scaling_commutes_with_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting to ``dst`` first and scaling in place afterwards obeys the rule.

    True for float ``dst`` when the cast is the identity or a widening that
    lands exactly in the compute dtype. torch's in-place multiply scales
    float16/bfloat16 in float32 and rounds once, which is the rule too.
    Backends use this to scale a buffer in place instead of through a
    temporary.

    >>> scaling_commutes_with_cast(torch.float16, torch.float32)
    True
    >>> scaling_commutes_with_cast(torch.float32, torch.float16)
    False
    """
    if dst not in FLOAT_DTYPES:
        return False
    return src == dst or dst == compute_dtype(src, dst)
