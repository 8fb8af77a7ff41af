"""CUDA tensors through every Horovod op, DistributedOptimizer, ZeRO-1, SyncBatchNorm and the
`ddl` backend (DDP), on the planes a GPU user gets:
NCCL (`DDL_MAGIC_TORCH_PLANE=nccl`) at np 1, and CUDA IPC between 2 ranks sharing one GPU
(NCCL refuses two ranks on one GPU, so its np 2 runs where a machine has two).

Needs a GPU, so it runs only where one is (`benchmarks/gpu_check.py` runs it); the same code
runs on CPU in CI with gloo standing in for NCCL (`test_torch_distributed_plane.py`). Each
rank runs every op on CUDA tensors and on CPU tensors over the same ring and compares them.
"""

from __future__ import annotations

import pytest
import torch

from ranks import CUDA_RUN_TIMEOUT_S, run_on_ranks
from test_torch_distributed_plane import every_op, through_the_ddl_backend, what_users_train

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(CUDA_RUN_TIMEOUT_S + 20)]


def cuda_against_cpu() -> dict:
    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context

    hvd.init()
    device = f"cuda:{hvd.local_rank() % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    on_gpu, _ = every_op(hvd, device)
    on_gpu.update(what_users_train(hvd, device))
    on_gpu.update(through_the_ddl_backend(hvd.rank(), hvd.size(), device))
    on_cpu, _ = every_op(hvd)
    on_cpu.update(what_users_train(hvd))
    on_cpu.update(through_the_ddl_backend(hvd.rank(), hvd.size()))
    mismatches = []
    for name, expected in on_cpu.items():
        got = on_gpu[name]
        close = torch.allclose(got.double(), expected.double(), rtol=1e-2, atol=1e-2) \
            if expected.dtype.is_floating_point else torch.equal(got, expected)
        if got.dtype != expected.dtype or got.shape != expected.shape or not close:
            mismatches.append(f"{name}: {got.tolist()} vs {expected.tolist()}")
    return {"transport": context.current("test").transport, "mismatches": mismatches}


def test_every_op_on_cuda_tensors_through_nccl_at_np_1():
    [report] = run_on_ranks(cuda_against_cpu, 1, env={"DDL_MAGIC_TORCH_PLANE": "nccl"}, timeout_s=CUDA_RUN_TIMEOUT_S)
    assert report == {"transport": "none+nccl", "mismatches": []}


def test_every_op_on_cuda_tensors_through_cuda_ipc_at_np_2():
    for report in run_on_ranks(cuda_against_cpu, 2, timeout_s=CUDA_RUN_TIMEOUT_S):
        assert report == {"transport": "shm", "mismatches": []}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_every_op_on_cuda_tensors_through_nccl_at_np_2():
    for report in run_on_ranks(cuda_against_cpu, 2, env={"DDL_MAGIC_TORCH_PLANE": "nccl"},
                               timeout_s=CUDA_RUN_TIMEOUT_S):
        assert report == {"transport": "shm+nccl", "mismatches": []}


def test_a_cuda_tensor_captured_in_the_notebook_lands_on_each_ranks_own_gpu(monkeypatch):
    import cloudpickle

    from ddl_magic.driver.capture import capture_cell

    captured = capture_cell("y = x * 2", {"x": torch.ones(3, device="cuda:0", requires_grad=True)})
    assert captured.on_gpu == ["x"]
    local_rank = torch.cuda.device_count() - 1  # the last GPU, so a wrong device shows
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    x = cloudpickle.loads(captured.payload).namespace["x"]  # as that rank unpickles it
    assert x.device == torch.device("cuda", local_rank) and x.requires_grad
