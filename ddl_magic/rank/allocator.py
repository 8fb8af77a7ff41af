"""A rank keeps the memory its tensors free for the next step, instead of handing it back to
the kernel and faulting it in again.

A training step on the CPU allocates and frees the same activations and gradients every step.
glibc's malloc serves blocks over its mmap threshold with mmap (unmapped again when freed),
and gives the top of its heap back to the kernel once more than its trim threshold lies free
there; both thresholds follow the largest block freed so far (the trim threshold is twice
the mmap one). A step whose tensors are a few MB each then often frees more than the trim
threshold at the top of the heap, which glibc returns, and the next step takes it back one
page fault per 4 KiB page. On a virtual machine a fault costs a microsecond or two, so a
2 MB tensor costs up to a millisecond before it holds a byte, and two ranks faulting at once
slow each other down. Measured on the 2-core test machine (the small ResNet of
`benchmarks/sync_batch_norm.py`, batch 32): 33-36 ms a step in one process with glibc's own
thresholds, 24-25 ms with those below; at np 2, 36 ms with plain BatchNorm and 48 ms with
SyncBatchNorm, against 25 and 30-34 ms.

So a rank fixes the thresholds, as GPU caching allocators keep freed blocks and as torch's
CPU launcher (`torch.backends.xeon.run_cpu`) does by preloading jemalloc or tcmalloc: blocks
up to `HEAP_BLOCKS_UP_TO` come from the heap, and up to `KEPT_AT_THE_TOP` of freed heap
stays with the process. What it keeps is bounded by that, and a pool's rank hands it back
after every cell (`give_back`), when nobody waits for a step. A rank with a memory cap
returns large blocks at once instead (`return_large_blocks_when_freed`, from
`memory_cap.py`): there, memory held counts against the cap. `DDL_MAGIC_KEEP_FREED_MEMORY=0` leaves glibc's thresholds as they are. Elsewhere
than glibc (musl, macOS) the allocator is left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os

VARIABLE = "DDL_MAGIC_KEEP_FREED_MEMORY"
HEAP_BLOCKS_UP_TO = 32 << 20  # glibc's own ceiling for its moving mmap threshold on 64-bit
KEPT_AT_THE_TOP = 256 << 20
RETURNED_FROM = 1 << 20  # under a memory cap: every block over this is mmapped, returned when freed
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3)


def keep_freed_memory() -> bool:
    """Fix glibc's thresholds in this process (a freshly forked rank) as described above;
    whether they were set."""
    if os.environ.get(VARIABLE, "1") == "0":
        return False
    libc = _glibc()
    return (libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, KEPT_AT_THE_TOP) == 1)


def return_large_blocks_when_freed() -> None:
    """Serve every block over `RETURNED_FROM` with mmap, so that freeing it returns it to the
    kernel at once (a rank under a memory cap: see `memory_cap.cap_this_process`)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, RETURNED_FROM)


def give_back() -> None:
    """Return the freed memory this process keeps to the kernel (between a pool's cells)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt but not this)
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc
