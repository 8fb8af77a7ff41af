"""CUDA tensors between ranks of one host: GPU memory the ranks map from each other (CUDA IPC).

Needs a GPU, so it runs only where one is: the rounds themselves are the host group's, tested
on CPU (`test_shared_memory.py`, with host memory standing in for the GPU buffers), and what
is CUDA's alone (allocating, exporting and opening the buffers, fencing on the stream) is
checked here. Two ranks share one GPU when the machine has only one.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.launch.local import LocalLauncher
from ddl_magic.wire.tasks import FunctionTask

from ranks import CUDA_RUN_TIMEOUT_S, run_on_ranks

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(CUDA_RUN_TIMEOUT_S + 20)]

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
SIZES = [1, 7, 1001, 300_001, 3_000_001]  # one phase, two phases, several rounds


def reduce_on_gpus():
    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context
    from ddl_magic.runtime.planes.peer_memory import CudaIpcMemory

    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    failures = []
    for dtype in DTYPES:
        for numel in SIZES:
            mine = ((torch.arange(numel, device=device) * 3 + hvd.rank() * 5) % 11).to(dtype)
            result = hvd.allreduce(mine, op=hvd.Sum, name=f"{dtype}.{numel}")
            expected = sum(((torch.arange(numel) * 3 + r * 5) % 11) for r in range(hvd.size()))
            if result.device != device or not torch.equal(result.cpu().double(), expected.double()):
                failures.append(f"{dtype} numel={numel}")
    averaged = hvd.allreduce(torch.full((5,), float(hvd.rank()), device=device))
    if averaged.tolist() != [(hvd.size() - 1) / 2] * 5:
        failures.append(f"average {averaged.tolist()}")
    memory = context.current("test").queue._runner.plane.gpu_memory(device)
    checksum = hvd.allgather(hvd.allreduce(torch.rand(1 << 20, device=device)).sum().view(1).cpu())
    return {"failures": failures, "ipc": isinstance(memory, CudaIpcMemory),
            "identical": bool((checksum == checksum[0]).all())}


def test_cuda_tensors_are_reduced_through_peer_mapped_gpu_memory_alike_on_every_rank():
    for report in run_on_ranks(reduce_on_gpus, 2, timeout_s=CUDA_RUN_TIMEOUT_S):
        assert report == {"failures": [], "ipc": True, "identical": True}


def allreduce_on_gpu_until_rank_1_kills_itself():
    import ddl_magic.torch as hvd

    hvd.init()
    tensor = torch.ones(1 << 22, device=f"cuda:{hvd.local_rank() % torch.cuda.device_count()}")
    for step in range(1000):
        if hvd.rank() == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(tensor, name="grad")
    return "finished"


def test_a_rank_killed_during_a_gpu_allreduce_fails_the_run_and_leaves_nothing():
    before = set(os.listdir("/dev/shm"))
    job = Job(FunctionTask(allreduce_on_gpu_until_rank_1_kills_itself, {}), 2, LocalLauncher(),
              JobOptions(timeout_s=120, hide_output=True))
    with pytest.raises(RankFailedError) as failure:
        job.run()
    assert failure.value.rank == 1 and "SIGKILL" in str(failure.value)
    assert {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")} <= before
