"""Triton kernels for the fusion buffer, and the launchers that call them.

One launch packs any number of tensors: their addresses go to the device as
an int64 table (:mod:`.segment_table`, cached across steps), and each program
loads its tensor's address and casts it with ``.to(tl.pointer_type(dtype))``.
This works compiled and under ``TRITON_INTERPRET=1``, where the addresses are
host addresses; hence the rule enforced below: compiled kernels take CUDA
tensors, interpreted ones CPU tensors. The alternative, up to N pointer
arguments per launch with tensors grouped in chunks, would need several
launches for hundreds of tensors and a signature that grows with N.

The price is alignment: Triton cannot prove that an address loaded from
memory, or a tensor's start inside the buffer, is a multiple of 16 bytes, so
accesses are element-sized (coalesced, not vectorised).

Casts follow torch bit for bit (see ``_cast``), and a scale factor travels as
a one-element float64 device tensor, not a scalar argument: the interpreter
narrows float scalars to float32, which would break the float64 half of the
rule in :mod:`.casting`.

Importing this module imports triton; :mod:`.dispatch` imports it lazily.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .casting import compute_dtype
from .segment_table import segment_table

# Elements per program and warps per program; not yet tuned on a GPU.
BLOCK = 2048
NUM_WARPS = 4

_TRITON_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
    torch.int16: tl.int16,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


@triton.jit
def _round_to_bfloat16(values):
    # Round to nearest even on the bits, as torch does. Triton's own
    # float32 -> bfloat16 cast rounds this way when compiled but truncates
    # when interpreted, and the interpreter is where the tests run.
    bits = values.to(tl.float32).to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)  # NaN becomes torch's canonical NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(values, OUT_DTYPE: tl.constexpr):
    """Convert like torch: to the half types through float32, rounding to nearest even."""
    if values.dtype == OUT_DTYPE:
        return values
    elif OUT_DTYPE == tl.bfloat16:
        return _round_to_bfloat16(values)
    elif OUT_DTYPE == tl.float16:
        return values.to(tl.float32).to(tl.float16)
    else:
        return values.to(OUT_DTYPE)


@triton.jit
def _scale_and_cast(
    values, scale, COMPUTE_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, APPLY_SCALE: tl.constexpr
):
    if APPLY_SCALE:
        values = values.to(COMPUTE_DTYPE) * tl.load(scale).to(COMPUTE_DTYPE)
    return _cast(values, OUT_DTYPE)


@triton.jit
def _this_block(sizes, first_block, block_owner, BLOCK: tl.constexpr):
    """Which tensor this program works on, and which of its elements."""
    program = tl.program_id(0)
    owner = tl.load(block_owner + program)
    offsets = (program - tl.load(first_block + owner)) * BLOCK + tl.arange(0, BLOCK)
    return owner, offsets, offsets < tl.load(sizes + owner)


@triton.jit
def _pack_kernel(
    buffer, addresses, starts, sizes, first_block, block_owner, scale,
    TENSOR_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, APPLY_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    owner, offsets, in_tensor = _this_block(sizes, first_block, block_owner, BLOCK)
    tensor = tl.load(addresses + owner).to(tl.pointer_type(TENSOR_DTYPE))
    values = tl.load(tensor + offsets, mask=in_tensor)
    values = _scale_and_cast(values, scale, COMPUTE_DTYPE, buffer.dtype.element_ty, APPLY_SCALE)
    tl.store(buffer + tl.load(starts + owner) + offsets, values, mask=in_tensor)


@triton.jit
def _unpack_kernel(
    buffer, addresses, starts, sizes, first_block, block_owner, scale,
    TENSOR_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, APPLY_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    owner, offsets, in_tensor = _this_block(sizes, first_block, block_owner, BLOCK)
    values = tl.load(buffer + tl.load(starts + owner) + offsets, mask=in_tensor)
    values = _scale_and_cast(values, scale, COMPUTE_DTYPE, TENSOR_DTYPE, APPLY_SCALE)
    tensor = tl.load(addresses + owner).to(tl.pointer_type(TENSOR_DTYPE))
    tl.store(tensor + offsets, values, mask=in_tensor)


@triton.jit
def _scaled_copy_kernel(
    dst, src, numel, scale,
    COMPUTE_DTYPE: tl.constexpr, APPLY_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    values = tl.load(src + offsets, mask=in_range)
    values = _scale_and_cast(values, scale, COMPUTE_DTYPE, dst.dtype.element_ty, APPLY_SCALE)
    tl.store(dst + offsets, values, mask=in_range)


@triton.jit
def _reduce_kernel(dst, src, numel, OP: tl.constexpr, ACCUMULATE_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    a = tl.load(dst + offsets, mask=in_range).to(ACCUMULATE_DTYPE)
    b = tl.load(src + offsets, mask=in_range).to(ACCUMULATE_DTYPE)
    if OP == "sum":
        result = a + b
    elif OP == "product":
        result = a * b
    elif OP == "min":
        result = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)  # NaN wins, as in torch.minimum
    else:
        result = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    tl.store(dst + offsets, _cast(result, dst.dtype.element_ty), mask=in_range)


INTERPRETED = isinstance(_pack_kernel, InterpretedFunction)


def pack(tensors: Sequence[torch.Tensor], packed: torch.Tensor, prescale: float) -> None:
    _check_launchable(packed)
    table = segment_table(tensors, BLOCK)
    if table.num_blocks == 0:
        return
    dtype = tensors[0].dtype
    _pack_kernel[(table.num_blocks,)](
        packed, table.addresses, table.starts, table.sizes, table.first_block, table.block_owner,
        _scale_tensor(prescale, packed.device),
        TENSOR_DTYPE=_TRITON_DTYPES[dtype],
        COMPUTE_DTYPE=_TRITON_DTYPES[compute_dtype(dtype, packed.dtype)],
        APPLY_SCALE=prescale != 1.0,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


def unpack(packed: torch.Tensor, tensors: Sequence[torch.Tensor], postscale: float) -> None:
    _check_launchable(packed)
    table = segment_table(tensors, BLOCK)
    if table.num_blocks == 0:
        return
    dtype = tensors[0].dtype
    _unpack_kernel[(table.num_blocks,)](
        packed, table.addresses, table.starts, table.sizes, table.first_block, table.block_owner,
        _scale_tensor(postscale, packed.device),
        TENSOR_DTYPE=_TRITON_DTYPES[dtype],
        COMPUTE_DTYPE=_TRITON_DTYPES[compute_dtype(packed.dtype, dtype)],
        APPLY_SCALE=postscale != 1.0,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


def scaled_copy_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    _check_launchable(dst)
    numel = dst.numel()
    if numel == 0:
        return
    _scaled_copy_kernel[(triton.cdiv(numel, BLOCK),)](
        dst, src, numel, _scale_tensor(scale, dst.device),
        COMPUTE_DTYPE=_TRITON_DTYPES[compute_dtype(src.dtype, dst.dtype)],
        APPLY_SCALE=scale != 1.0,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    _check_launchable(dst)
    numel = dst.numel()
    if numel == 0:
        return
    accumulate = torch.float32 if dst.dtype in (torch.float16, torch.bfloat16) else dst.dtype
    _reduce_kernel[(triton.cdiv(numel, BLOCK),)](
        dst, src, numel,
        OP=op,
        ACCUMULATE_DTYPE=_TRITON_DTYPES[accumulate],
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


@functools.lru_cache(maxsize=16)
def _scale_tensor(scale: float, device: torch.device) -> torch.Tensor:
    # Cached, because a run uses one or two scale factors. A blocking copy
    # rather than torch.full, so that the value is in place before any stream
    # reads it.
    return torch.tensor([scale], dtype=torch.float64).to(device)


def _check_launchable(tensor: torch.Tensor) -> None:
    if INTERPRETED and tensor.is_cuda:
        raise RuntimeError(
            "Triton is running interpreted (TRITON_INTERPRET=1), which reads CPU memory only; "
            "unset TRITON_INTERPRET to run these kernels on CUDA tensors"
        )
    if not INTERPRETED and not tensor.is_cuda:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got one on {tensor.device}; set "
            "TRITON_INTERPRET=1 before importing triton to run them on CPU, or "
            "DDL_MAGIC_KERNELS=torch to use the torch reference"
        )
