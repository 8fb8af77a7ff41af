"""A rank keeps the memory its tensors free for the next step (`rank/allocator.py`): freed, a
step's tensors stay with the process instead of being faulted in afresh every step; the
setting can be turned off; a pool's rank hands what it kept back after each cell (that half
runs in a real kernel, in `test_pool.py`)."""

import pytest

from ddl_magic.rank import allocator
from ranks import run_on_ranks

MIB = 1 << 20


def resident_before_and_after_freeing() -> tuple[int, int]:
    import torch

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    blocks = [torch.ones(MIB) for _ in range(20)]  # 20 blocks of 4 MiB, every page touched
    full = resident()
    del blocks
    return full, resident()


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")
@pytest.mark.parametrize("keep", [True, False])
def test_a_rank_keeps_what_its_tensors_free_unless_told_not_to(keep):
    env = {} if keep else {allocator.VARIABLE: "0"}
    [(full, after)] = run_on_ranks(resident_before_and_after_freeing, 1, env=env)
    if keep:
        assert after > full - 8 * MIB, (full, after)  # 80 MiB freed, all of it kept
    else:
        assert after < full - 60 * MIB, (full, after)  # glibc's own thresholds hand it back
