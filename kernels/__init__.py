"""Fusion-buffer kernels: pack many tensors into one buffer, reduce, unpack.

On CUDA tensors they run as Triton kernels (one launch packs hundreds of
tensors); elsewhere, or without triton, as a few torch ops. Both follow the
same casting rule (:mod:`ddl_magic.kernels.casting`), so results match.

A fused, compressed allreduce step on one rank:

>>> import torch
>>> from ddl_magic import kernels
>>> grads = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0], [4.0]])]
>>> mine = kernels.pack(grads, torch.empty(4, dtype=torch.float16), prescale=0.5)
>>> theirs = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float16)  # from a peer
>>> kernels.reduce_(mine, theirs, "sum")
>>> kernels.unpack(mine, grads)
>>> grads[1]
tensor([[2.5000],
        [3.0000]])

``DDL_MAGIC_KERNELS=torch`` or ``=triton`` forces a backend; see
:func:`backend_for`.
"""

from .dispatch import backend_for, compress, decompress, pack, reduce_, reducer, unpack

__all__ = ["backend_for", "compress", "decompress", "pack", "reduce_", "reducer", "unpack"]
