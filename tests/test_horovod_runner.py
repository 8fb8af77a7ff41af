"""HorovodRunner: the function API of %%horovod (np < 0 local processes, np > 0 Spark)."""

import threading

import pytest

from ddl_magic import HorovodRunner
from ddl_magic.driver.capture import CaptureError


def allreduce_ranks(offset):
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    return hvd.allreduce(torch.tensor([hvd.rank() + offset]), op=hvd.Sum).item()


def test_negative_np_runs_local_processes_and_returns_rank_0s_value():
    runner = HorovodRunner(np=-2)
    assert runner.run(allreduce_ranks, offset=1.0) == 3.0
    assert runner.last_run.where == "local processes"
    assert [r.status for r in runner.last_run.ranks] == ["done", "done"]
    control = runner.last_run.control  # what the driver did: one thread, 2 messages a rank
    assert control["threads"] == 1 and control["rendezvous_messages"] == 2 * 2


@pytest.mark.parametrize("np", [0, 1.5, True])
def test_np_must_be_a_nonzero_integer(np):
    with pytest.raises(ValueError, match="np=-2 runs 2 local processes"):
        HorovodRunner(np=np)


def test_an_unpicklable_argument_is_named_before_launch():
    with pytest.raises(CaptureError, match="argument 'offset'"):
        HorovodRunner(np=-2).run(allreduce_ranks, offset=threading.Lock())


def test_asking_for_gpus_without_any_is_an_error_before_launch():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        HorovodRunner(np=-2, use_gpu=True).run(allreduce_ranks, offset=0.0)
