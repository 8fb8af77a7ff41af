"""The torch-ops backend: the CPU hot path and the oracle for the Triton kernels.

Each function makes a handful of whole-buffer torch calls and no per-element
Python: pack is one ``torch.cat``, unpack one ``torch.split_with_sizes_copy``. A
scale factor costs one more pass over the buffer, plus a temporary only where
the rule in :mod:`.casting` says scaling must happen before a lossy cast.
Inputs (the tensors given to pack, the buffer given to unpack) are never
modified.

Arguments arrive already checked by :mod:`.dispatch` (contiguous tensors of
one dtype, ``packed`` exactly as long as they are together).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from .casting import compute_dtype, scaling_commutes_with_cast

_REDUCE_OPS = {
    "sum": lambda dst, src: dst.add_(src),
    "product": lambda dst, src: dst.mul_(src),
    "min": lambda dst, src: torch.minimum(dst, src, out=dst),
    "max": lambda dst, src: torch.maximum(dst, src, out=dst),
}


def pack(tensors: Sequence[torch.Tensor], packed: torch.Tensor, prescale: float) -> None:
    # (A view per tensor costs more than copying a small one: 1-D tensors go as they are.)
    flat = [t if t.dim() == 1 else t.view(-1) for t in tensors]
    if prescale == 1.0:
        torch.cat(flat, out=packed)
    elif scaling_commutes_with_cast(flat[0].dtype, packed.dtype):
        torch.cat(flat, out=packed)
        packed.mul_(prescale)
    else:
        # Scale before the lossy cast, in a temporary that is ours to scale in place.
        staged = torch.cat(flat).to(compute_dtype(flat[0].dtype, packed.dtype))
        packed.copy_(staged.mul_(prescale))


def unpack(packed: torch.Tensor, tensors: Sequence[torch.Tensor], postscale: float) -> None:
    compute = compute_dtype(packed.dtype, tensors[0].dtype)
    if postscale != 1.0 and tensors[0].dtype != compute:
        # Scale the whole buffer once, into a copy; copying that into integer
        # tensors then rounds toward zero.
        packed, postscale = packed.to(compute, copy=True).mul_(postscale), 1.0
    _copy_out(packed, tensors)
    if postscale != 1.0:
        # An exact widening (or none): scale the tensors in place. Not for
        # float16/bfloat16 tensors: _foreach_mul_ rounds the scale itself to
        # their dtype (casting.py sends those through the branch above).
        torch._foreach_mul_(tensors, postscale)


def _copy_out(packed: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``packed`` into ``tensors``, in one torch call and no
    Python per tensor beyond a 1-D view (a thousand small tensors: most of the time)."""
    if packed.dtype == tensors[0].dtype:
        torch.split_with_sizes_copy(packed, [t.numel() for t in tensors],
                                    out=[t if t.dim() == 1 else t.view(-1) for t in tensors])
    else:  # a cast on the way: torch's views shaped like the tensors (DDP's unflatten)
        torch._foreach_copy_(tensors, _unflatten_dense_tensors(packed, tensors))


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    # torch's CPU and CUDA kernels already compute float16/bfloat16 in float32.
    _REDUCE_OPS[op](dst, src)


def scaled_copy_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = src * scale`` under the casting rule; same numel, both contiguous."""
    dst, src = dst.view(-1), src.view(-1)
    compute = compute_dtype(src.dtype, dst.dtype)
    if scale == 1.0:
        dst.copy_(src)
    elif (src.dtype == dst.dtype and dst.is_floating_point()) or src.dtype == compute:
        torch.mul(src, scale, out=dst)  # computes in `compute`, rounds once into dst
    elif scaling_commutes_with_cast(src.dtype, dst.dtype):
        dst.copy_(src)
        dst.mul_(scale)
    else:
        dst.copy_(src.to(compute).mul_(scale))  # src.to makes a copy: src is not in `compute`
