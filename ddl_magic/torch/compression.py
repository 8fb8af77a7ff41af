"""Gradient compression for allreduce, as in `horovod.torch.Compression`."""

from __future__ import annotations

import torch

from .. import kernels


class Compressor:
    """Turns a tensor into what goes on the wire, and back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Sends float32/float64 tensors as a 16-bit float type: half the bytes on the wire."""

    wire_dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        if tensor.dtype in (torch.float32, torch.float64):
            return kernels.compress(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        if ctx is None:
            return tensor
        return kernels.decompress(tensor, torch.empty(tensor.shape, dtype=ctx, device=tensor.device))


class FP16Compressor(_CastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    wire_dtype = torch.bfloat16


class Compression:
    """The choices for `DistributedOptimizer(..., compression=...)`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
