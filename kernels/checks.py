"""Argument checks shared by both backends: fail before any copy, and say what to do.

The common case (every tensor fine) costs one set comprehension over the
tensors; the loop that names the offending tensor runs only when one is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .casting import check_cast

REDUCE_OPS = ("sum", "min", "max", "product")


def check_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """Check the arguments of ``pack``; return the tensors' total numel."""
    total = _check_segments(tensors, out, "out")
    if tensors:
        check_cast(tensors[0].dtype, out.dtype)
    return total


def check_unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> int:
    """Check the arguments of ``unpack``; return the tensors' total numel."""
    total = _check_segments(tensors, buffer, "buffer")
    if tensors:
        check_cast(buffer.dtype, tensors[0].dtype)
    return total


def _check_segments(tensors: Sequence[torch.Tensor], buffer: torch.Tensor, buffer_name: str) -> int:
    _check_flat_buffer(buffer, buffer_name)
    if not tensors:
        return 0
    dtype, device = tensors[0].dtype, buffer.device
    if {(t.dtype, t.device, t.is_contiguous()) for t in tensors} != {(dtype, device, True)}:
        _raise_for_first_misfit(tensors, dtype, device, buffer_name)
    total = sum(t.numel() for t in tensors)
    if buffer.numel() < total:
        raise ValueError(
            f"{buffer_name} holds {buffer.numel()} elements but the tensors need {total}; "
            f"allocate at least {total}"
        )
    return total


def check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Check two tensors for an element-by-element kernel (same numel and device, contiguous)."""
    if dst.numel() != src.numel():
        raise ValueError(
            f"size mismatch: {src.numel()} elements into {dst.numel()}; pass tensors of equal numel"
        )
    if dst.device != src.device:
        raise ValueError(f"device mismatch: {src.device} into {dst.device}; move them to one device")
    for name, tensor in (("destination", dst), ("source", src)):
        if not tensor.is_contiguous():
            raise ValueError(f"the {name} tensor is not contiguous; pass .contiguous()")


def check_reduce(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    if dst.dtype != src.dtype:
        raise TypeError(f"reduce_ needs one dtype, got {dst.dtype} and {src.dtype}; cast src first")
    check_cast(src.dtype, dst.dtype)
    check_pair(dst, src)


def _raise_for_first_misfit(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device, buffer_name: str
) -> None:
    for index, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(
                f"tensors[{index}] is {t.dtype} but tensors[0] is {dtype}; use one buffer per dtype"
            )
        if t.device != device:
            raise ValueError(
                f"tensors[{index}] is on {t.device} but {buffer_name} is on {device}; move them to one device"
            )
        if not t.is_contiguous():
            raise ValueError(f"tensors[{index}] is not contiguous; pass tensors[{index}].contiguous()")


def _check_flat_buffer(buffer: torch.Tensor, name: str) -> None:
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"{name} must be a 1-D contiguous tensor, got shape {tuple(buffer.shape)}; pass buffer.view(-1)"
        )
