"""`@distributed`: Databricks' decorator shape on ddl_magic's ranks. `f.distributed(...)`
returns every rank's value in rank order, or raises the failing rank's error; `f(...)` runs
once, here. Local processes, and Spark barrier tasks (classic and Connect) with remote=True."""

import os
import subprocess
import sys
import threading

import pytest

import ddl_magic
from ddl_magic import RankFailedError, distributed
from ddl_magic.driver.capture import CaptureError
from spark_sessions import sent_by_value


@distributed(np=3)
def ranks_and_sum(offset, scale=1):
    """Each rank's (rank * scale + offset), and the sum over the ring of every rank's."""
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    mine = hvd.rank() * scale + offset
    return mine, int(hvd.allreduce(torch.tensor(mine), op=hvd.Sum))


@distributed(np=2)
def rank_1_refuses():
    import ddl_magic.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 refuses")
    hvd.barrier()  # rank 0 waits here until the driver stops it


@distributed(np=2, remote=True)
def rank_and_world_size():
    import ddl_magic.torch as hvd

    hvd.init()
    return hvd.rank(), hvd.size(), os.environ["WORLD_SIZE"]


def test_distributed_returns_every_ranks_value_in_rank_order():
    assert ranks_and_sum.distributed(10, scale=2) == [(10, 36), (12, 36), (14, 36)]
    assert ranks_and_sum.last_run.where == "local processes"
    assert [rank.status for rank in ranks_and_sum.last_run.ranks] == ["done"] * 3


def test_a_failing_rank_raises_its_error_with_its_traceback():
    with pytest.raises(RankFailedError) as failure:
        rank_1_refuses.distributed()
    assert failure.value.rank == 1
    assert "ValueError: rank 1 refuses" in failure.value.traceback
    assert [rank.status for rank in rank_1_refuses.last_run.ranks] == ["stopped", "failed"]


def test_calling_the_function_runs_it_once_in_this_process():
    @distributed(np=2)
    def where_am_i(tag):
        """Says which process ran it."""
        return tag, os.getpid()

    before = ddl_magic.last_run()
    assert where_am_i("here") == ("here", os.getpid())
    assert ddl_magic.last_run() is before, "a run was started"
    assert where_am_i.__name__ == "where_am_i" and where_am_i.__doc__ == "Says which process ran it."


def test_gpus_without_a_gpu_are_refused_before_anything_starts():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for name in ("gpus", "num_accelerators"):
        train = distributed(**{name: 2})(ranks_and_sum.__wrapped__)
        before = ddl_magic.last_run()
        with pytest.raises(ValueError, match=rf"@distributed\({name}=2\) starts one rank per GPU, "
                                             r"but torch sees no CUDA GPUs .* use "
                                             r"@distributed\(np=2\)"):
            train.distributed(0)
        assert ddl_magic.last_run() is before


def test_remote_without_a_spark_session_is_refused_saying_what_to_do(tmp_path):
    # A fresh interpreter: in this one, another test module's session may still be active.
    code = ("from ddl_magic import distributed\n"
            "train = distributed(np=2, remote=True)(print)\n"
            "try:\n"
            "    train.distributed()\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "remote=True) runs the ranks as Spark barrier tasks on the active SparkSession, " \
           "and there is none" in result.stdout
    assert "drop remote=True" in result.stdout


@pytest.mark.parametrize("arguments, message", [
    ({}, r"exactly one of np= .* and gpus="),
    ({"np": 2, "gpus": 2}, r"exactly one of np= .*; got np=2, gpus=2"),
    ({"np": 0}, r"@distributed\(np=0\): give a positive number of ranks"),
    ({"gpus": 1.5}, r"@distributed\(gpus=1.5\): give a positive number of ranks"),
    ({"np": 2, "gpu_type": "A10"}, "gpu_type='A10' chooses a Databricks serverless GPU"),
])
def test_bad_arguments_say_what_to_write(arguments, message):
    with pytest.raises(ValueError, match=message):
        distributed(**arguments)


def test_the_bare_decorator_asks_for_the_number_of_ranks():
    with pytest.raises(TypeError, match=r"write @distributed\(np=2\)"):
        @distributed
        def train():
            pass


def test_an_unpicklable_argument_is_named_before_launch():
    with pytest.raises(CaptureError, match="argument 'offset'"):
        ranks_and_sum.distributed(offset=threading.Lock())


@pytest.mark.long_on_connect  # Spark Connect runs in CI: spark_launcher, estimator, inference
def test_remote_runs_the_ranks_as_spark_barrier_tasks(spark):
    with sent_by_value(sys.modules[__name__]):
        results = rank_and_world_size.distributed()
    assert results == [(0, 2, "2"), (1, 2, "2")]
    assert rank_and_world_size.last_run.where == "Spark barrier tasks"
