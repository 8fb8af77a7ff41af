"""The public kernel functions: check the arguments, pick a backend, run it.

Backend choice (:func:`backend_for`): Triton for CUDA tensors when triton is
installed, else the torch reference. ``DDL_MAGIC_KERNELS=triton`` or
``=torch`` overrides that; it is read on every call so tests can switch it.
Triton is imported only when its backend is first used.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from . import reference
from .casting import check_cast
from .checks import check_pack, check_pair, check_reduce, check_unpack

BACKEND_VARIABLE = "DDL_MAGIC_KERNELS"
_BACKEND_CHOICES = ("auto", "triton", "torch")


def backend_for(t: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the backend that kernels on ``t`` will use.

    >>> backend_for(torch.zeros(3))  # a CPU tensor, DDL_MAGIC_KERNELS unset
    'torch'
    """
    choice = os.environ.get(BACKEND_VARIABLE, "auto")
    if choice not in _BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_VARIABLE}={choice!r} is not one of {', '.join(_BACKEND_CHOICES)}")
    if choice == "auto":
        return "triton" if t.is_cuda and _triton_installed() else "torch"
    return choice


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, prescale: float = 1.0) -> torch.Tensor:
    """Copy ``tensors`` end to end into the 1-D buffer ``out``, times ``prescale``.

    The tensors share one dtype; ``out`` may have another float dtype
    (compression: scaled in float32, rounded once). Integers with a scale
    other than 1 are scaled in float64 and rounded toward zero. Returns the
    filled prefix ``out[:total]``.

    >>> grads = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0], [4.0]])]
    >>> pack(grads, torch.zeros(6), prescale=0.5)
    tensor([0.5000, 1.0000, 1.5000, 2.0000])
    >>> pack(grads, torch.zeros(4, dtype=torch.float16))
    tensor([1., 2., 3., 4.], dtype=torch.float16)
    """
    total = check_pack(tensors, out)
    packed = out[:total]
    if total:
        _backend(out).pack(tensors, packed, float(prescale))
    return packed


def unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], postscale: float = 1.0) -> None:
    """Copy ``buffer`` back into ``tensors`` in place, times ``postscale``: the reverse of :func:`pack`.

    >>> grads = [torch.zeros(2), torch.zeros(2, 1)]
    >>> unpack(torch.tensor([2.0, 4.0, 6.0, 8.0], dtype=torch.bfloat16), grads, postscale=0.5)
    >>> grads[1]
    tensor([[3.],
            [4.]])
    """
    total = check_unpack(buffer, tensors)
    if total:
        _backend(buffer).unpack(buffer[:total], tensors, float(postscale))


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """``dst op= src`` element by element, ``op`` one of sum, min, max, product.

    float16/bfloat16 are combined in float32 and rounded once; integers wrap
    on overflow, as torch's do. min and max propagate NaN.

    >>> dst = torch.tensor([1, 5], dtype=torch.int32)
    >>> reduce_(dst, torch.tensor([3, 2], dtype=torch.int32), "max")
    >>> dst
    tensor([3, 5], dtype=torch.int32)
    """
    check_reduce(dst, src, op)
    _backend(dst).reduce_(dst, src, op)


def reducer(op: str, like: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``reduce_`` for many calls on tensors like ``like`` (its dtype and device): ``op`` is
    checked and the backend chosen once, and each call goes straight to it. The calls'
    tensors must be contiguous, of equal numel, with ``like``'s dtype and device; a
    collective reducing chunk after chunk pays for the checks only once.

    >>> add = reducer("sum", torch.zeros(2))
    >>> dst = torch.tensor([1.0, 2.0])
    >>> add(dst, torch.tensor([3.0, 4.0])); dst
    tensor([4., 6.])
    """
    check_reduce(like, like, op)
    return functools.partial(_backend(like).reduce_, op=op)


def compress(src: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """A new ``dtype`` tensor holding ``src * scale``, scaled before rounding.

    131072 overflows float16, but scaled first it fits:

    >>> compress(torch.tensor([131072.0, 1.0]), torch.float16, scale=0.25)
    tensor([3.2768e+04, 2.5000e-01], dtype=torch.float16)
    """
    check_cast(src.dtype, dtype)
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    check_pair(out, src)
    _backend(src).scaled_copy_(out, src, float(scale))
    return out


def decompress(src: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write ``src * scale`` into ``out`` (same numel, any shape) and return ``out``.

    >>> decompress(torch.tensor([1.5, 2.0], dtype=torch.float16), torch.empty(2), scale=2.0)
    tensor([3., 4.])
    """
    check_cast(src.dtype, out.dtype)
    check_pair(out, src)
    _backend(out).scaled_copy_(out, src, float(scale))
    return out


def _backend(t: torch.Tensor) -> ModuleType:
    return _triton_backend() if backend_for(t) == "triton" else reference


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_backend() -> ModuleType:
    try:
        from . import triton_kernels
    except ImportError as error:
        raise ImportError(
            f"the Triton kernels need triton ({error}); install it with "
            f"pip install 'ddl_magic[gpu]', or set {BACKEND_VARIABLE}=torch"
        ) from error
    return triton_kernels
