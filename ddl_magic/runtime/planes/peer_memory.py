"""The memory the ranks of one host exchange data through: each rank owns a pair of data
buffers, and its neighbours map them.

The shared-memory collectives (`shared_memory.HostGroup`) run the same rounds and phases on
either kind, through this small interface:

- `HostMemory`: the data buffers of the ranks' memfd segments, for CPU tensors;
- `CudaIpcMemory`: a pair of buffers in each rank's GPU memory that the others map through
  CUDA IPC (as `torch.multiprocessing` shares CUDA tensors between processes), for CUDA
  tensors: they are packed, reduced and copied on the GPU with the kernels in `kernels/` (`ddl_magic.kernels`),
  never staged through host memory or a socket.

The counters that order the phases stay in the host segments either way. What differs is
`fence`: GPU kernels run asynchronously, so before a rank publishes the end of a phase, the
kernels that wrote its own buffer, or read its neighbours' (which frees them for reuse), must
have finished. On the host every copy has finished when it returns.
"""

from __future__ import annotations

import ctypes
import os
from typing import Protocol

import torch

from ... import kernels

BUFFER_BYTES = 8 << 20
"""Bytes per data buffer: a larger collective runs as several rounds, alternating buffers."""
HOST_ROUND_BYTES = 2 << 20
"""Bytes a round of a large host collective moves through a rank's buffer. Smaller than the
buffer, so that the rounds' buffers stay in the CPU's caches while the tensors stream through
memory: with 8 MiB rounds, two ranks' alternating buffers filled a 32 MiB L3 and a 64 MiB
allreduce at np 2 ran at 6.5 GB/s of bus bandwidth; with 2 MiB rounds, at 10.2 GB/s
(`benchmarks/allreduce.py`). The buffer stays larger for the data a negotiation round
carries (`collectives.ATTACHABLE_BYTES`), which is one round whatever its size, and for a
hierarchical allreduce's rounds, each of which waits for a collective across the network."""


class PeerMemory(Protocol):
    """Every local rank's two data buffers of one kind of memory, by local index."""

    round_bytes: int
    """The most bytes one round of a collective moves through a buffer."""

    def view(self, index: int, buffer: int, dtype: torch.dtype, numel: int,
             offset: int = 0) -> torch.Tensor:
        """`numel` elements of `dtype` at byte `offset` of local rank `index`'s buffer `buffer`."""

    def fence(self) -> None:
        """Return once this rank's writes to its buffers and reads of the others' are done."""


class HostMemory:
    """The data buffers of the host segments (CPU tensors).

    A training loop asks for the same views step after step, and making one costs two
    torch calls (more than copying a small gradient), so views are kept and reused.
    """

    VIEWS_KEPT = 1024
    round_bytes = HOST_ROUND_BYTES

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]]):
        self._buffers = buffers  # per local rank: its two uint8 buffers
        self._views: dict[tuple, torch.Tensor] = {}

    def view(self, index: int, buffer: int, dtype: torch.dtype, numel: int,
             offset: int = 0) -> torch.Tensor:
        key = (index, buffer, dtype, numel, offset)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self.VIEWS_KEPT:
                self._views.clear()
            view = self._views[key] = \
                self._buffers[index][buffer][offset:offset + numel * dtype.itemsize].view(dtype)
        return view

    def fence(self) -> None:
        pass


class CudaIpcMemory:
    """Two buffers in each rank's GPU memory, mapped by the other ranks of the host.

    Each rank allocates its pair with `cudaMalloc` (its own allocation, not a block of
    torch's caching allocator, so an IPC handle names exactly it), exports an IPC handle,
    and opens its neighbours' handles (`cudaIpcMemLazyEnablePeerAccess`: ranks on different
    GPUs of the host read each other's memory directly). Nothing is written to the file
    system, so a killed rank leaves nothing behind; the driver releases its memory.
    """

    round_bytes = BUFFER_BYTES  # on a GPU a round's fixed cost is a kernel launch and a fence

    def __init__(self, device: torch.device, regions: list[torch.Tensor], own_pointer: int,
                 opened: list[int]):
        self.device = device
        self._regions = regions  # per local rank: 2 * BUFFER_BYTES uint8 on the GPU
        self._own_pointer = own_pointer
        self._opened = opened

    @staticmethod
    def export(device: torch.device) -> tuple[int, bytes]:
        """Allocate this rank's buffers on `device`: their address and IPC handle.

        Refused without the Triton kernels: a neighbour's buffers may live on another GPU of
        the host, which a Triton kernel reads directly (peer access, one address space) and
        torch's own ops do not.
        """
        if kernels.backend_for(torch.empty(0, device=device)) != "triton":
            raise RuntimeError("reducing in GPU memory needs the Triton kernels "
                               "(pip install 'ddl_magic[gpu]'; DDL_MAGIC_KERNELS not 'torch')")
        runtime = cuda_runtime()
        with torch.cuda.device(device):
            pointer = ctypes.c_void_p()
            runtime.check(runtime.lib.cudaMalloc(ctypes.byref(pointer), 2 * BUFFER_BYTES), "cudaMalloc")
            handle = _IpcHandle()
            runtime.check(runtime.lib.cudaIpcGetMemHandle(ctypes.byref(handle), pointer),
                          "cudaIpcGetMemHandle")
        return pointer.value, bytes(handle)  # all 64 bytes (a c_char field would stop at a zero)

    @classmethod
    def open(cls, device: torch.device, own_index: int, own_pointer: int,
             handles: list[bytes]) -> "CudaIpcMemory":
        """Map every neighbour's buffers from their handles (`handles` by local index)."""
        runtime = cuda_runtime()
        regions, opened = [], []
        with torch.cuda.device(device):
            try:
                for index, handle in enumerate(handles):
                    pointer = own_pointer
                    if index != own_index:
                        mapped = ctypes.c_void_p()
                        runtime.check(runtime.lib.cudaIpcOpenMemHandle(
                            ctypes.byref(mapped), _IpcHandle.from_buffer_copy(handle),
                            _LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
                        pointer = mapped.value
                        opened.append(pointer)
                    regions.append(_wrap(pointer, 2 * BUFFER_BYTES))
            except BaseException:
                cls(device, [], own_pointer, opened).close()
                raise
        return cls(device, regions, own_pointer, opened)

    def view(self, index: int, buffer: int, dtype: torch.dtype, numel: int,
             offset: int = 0) -> torch.Tensor:
        start = buffer * BUFFER_BYTES + offset
        return self._regions[index][start:start + numel * dtype.itemsize].view(dtype)

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        runtime = cuda_runtime()
        with torch.cuda.device(self.device):
            for pointer in self._opened:
                runtime.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer))
            if self._own_pointer:
                runtime.lib.cudaFree(ctypes.c_void_p(self._own_pointer))
        self._regions, self._opened, self._own_pointer = [], [], 0


# ---- the CUDA runtime, as torch loaded it --------------------------------------------------

_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t


class _CudaRuntime:
    """The few CUDA runtime calls torch has no Python binding for (IPC of raw allocations)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        pointer, size = ctypes.c_void_p, ctypes.c_size_t  # without argtypes ctypes passes C ints
        lib.cudaMalloc.argtypes = [ctypes.POINTER(pointer), size]
        lib.cudaFree.argtypes = [pointer]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), pointer]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(pointer), _IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [pointer]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def check(self, status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} failed: {self.lib.cudaGetErrorString(status).decode()} "
                               f"(CUDA error {status})")


_runtime: _CudaRuntime | None = None


def cuda_runtime() -> _CudaRuntime:
    """The CUDA runtime library torch itself uses (found among the loaded libraries, so the
    IPC handles come from the same runtime as torch's tensors)."""
    global _runtime
    if _runtime is None:
        torch.cuda.init()
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        if not paths:
            raise RuntimeError("CUDA IPC needs the CUDA runtime library (libcudart), which "
                               "torch has not loaded: is this a CUDA build of torch?")
        _runtime = _CudaRuntime(ctypes.CDLL(sorted(paths)[0]))
    return _runtime


class _DeviceArray:
    """A raw device allocation in the form `torch.as_tensor` maps without copying."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 3}


def _wrap(pointer: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over device memory at `pointer`, on the GPU that memory belongs to
    (asking for another device would copy it, and the neighbours would never see a write)."""
    return torch.as_tensor(_DeviceArray(pointer, nbytes))
