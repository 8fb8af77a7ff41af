"""The GPU code path end to end without a GPU: a fused allreduce on 2 ranks whose pack,
reduce and unpack run as Triton kernels under the interpreter, on CPU tensors."""

import pytest
import torch

from ranks import run_on_ranks

pytest.importorskip("triton")

TRITON_ON_CPU = {"DDL_MAGIC_KERNELS": "triton", "TRITON_INTERPRET": "1"}


def fused_allreduce_through_triton():
    import ddl_magic.torch as hvd
    from ddl_magic import kernels

    hvd.init()
    results = {"backend": kernels.backend_for(torch.zeros(1))}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        tensors = [torch.full((size,), hvd.rank() + 1, dtype=dtype) for size in (1, 5, 129, 1000)]
        handles = [hvd.allreduce_async(t, name=f"{dtype}.{i}", op=hvd.Sum, prescale_factor=2.0)
                   for i, t in enumerate(tensors)]
        results[str(dtype)] = [hvd.synchronize(h).tolist() for h in handles]
    averaged = hvd.grouped_allreduce([torch.full((7,), float(hvd.rank())), torch.ones(3)])
    results["average"] = [t.tolist() for t in averaged]
    return results


def test_fused_allreduce_runs_through_the_triton_kernels():
    results = run_on_ranks(fused_allreduce_through_triton, 2, env=TRITON_ON_CPU, timeout_s=240)
    for rank_result in results:
        assert rank_result["backend"] == "triton"
        for dtype in ("torch.float32", "torch.float16", "torch.bfloat16", "torch.int32"):
            # ranks contribute 1 and 2, each doubled by the prescale: 2 + 4 = 6
            assert rank_result[dtype] == [[6] * n for n in (1, 5, 129, 1000)], dtype
        assert rank_result["average"] == [[0.5] * 7, [1.0] * 3]
