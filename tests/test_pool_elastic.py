"""An elastic pool (`%horovod start -np N --min-np M`, `ddl_magic.start(np, min_np=)`): a lost
rank is replaced by a fresh one instead of breaking the pool; the survivors keep their
namespaces, the user is told which rank starts empty, and the next cell runs on the whole
ring again. Below min_np the pool breaks as a plain one does. In a real kernel, through the
Python API, and on Spark `local[4]` (one job per rank)."""

import os
import re
import signal
import sys

import pytest

import ddl_magic
from ddl_magic.driver.capture import capture_cell
from ddl_magic.driver.pool import PoolBrokenError
from ddl_magic.driver.run_result import RankFailedError
from kernel import Kernel
from spark_sessions import no_spark_job_active
from test_pool import HVD, _cell, _gone_within
from test_spark_launcher import wait_until

# Every rank adds rank + 1: with 3 ranks the sum is 6.0, whatever happened before.
SUM = "hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()"
KILL_RANK_1 = ("import os, signal, time\n"
               "if hvd.rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(0.5)\n" + SUM)


def test_a_rank_killed_in_a_cell_is_replaced_and_the_others_keep_their_state():
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"})
    try:
        _cell(kernel, "%load_ext ddl_magic")
        started = _cell(kernel, "%horovod start -np 3 --min-np 2", timeout=180)
        assert "elastic: a lost rank is replaced" in started.stdout
        pids = [int(pid) for pid in re.findall(r"^\d+\s+\S+\s+(\d+)\s+idle", started.stdout, re.M)]
        _cell(kernel, "%%horovod --quiet\n" + HVD + "kept = hvd.rank()")
        killed = kernel.run("%%horovod --quiet\n" + KILL_RANK_1, timeout=60)
        assert killed.error is not None and killed.error["ename"] == "RankFailedError"
        assert "rank 1" in killed.error["evalue"] and "SIGKILL" in killed.error["evalue"]
        # Told at once, in the cell's output: which rank starts empty, and what it lost.
        assert "rank 1 replaced by a fresh rank, which starts empty" in killed.text, killed.text
        assert "(hvd, kept, os, signal, time, torch) is gone" in killed.text, killed.text
        assert not _gone_within(pids[0], 0.5) and not _gone_within(pids[2], 0.1)
        # The fresh rank has none of the earlier cells' names; the others have theirs.
        after = _cell(kernel, "%%horovod --all-ranks\n" + HVD + "(globals().get('kept'), " + SUM + ")")
        assert after.result == "[(0, 6.0), (None, 6.0), (2, 6.0)]"
        status = _cell(kernel, "%horovod status")
        assert "ready" in status.stdout and status.stdout.count(" idle ") == 3, status.stdout
        replaced_pid = int(re.search(r"^1\s+\S+\s+(\d+)\s+idle", status.stdout, re.M).group(1))
        _cell(kernel, "%horovod stop")
        for pid in (pids[0], pids[2], replaced_pid):
            assert _gone_within(pid, 10), "a rank outlived its pool"
    finally:
        kernel.close()


def test_a_rank_lost_while_idle_is_replaced_before_the_next_cell():
    with ddl_magic.start(np=3, min_np=2, quiet=True) as pool:
        assert pool.run(_sum_of_ranks) == 6.0
        os.kill(pool.pids[2], signal.SIGKILL)
        assert wait_until(lambda: pool.replaced, timeout_s=30), "the lost rank was not replaced"
        assert "rank 2" in pool.replaced[0] and "while the pool was idle" in pool.replaced[0]
        assert pool.run(_sum_of_ranks) == 6.0
        assert pool.state.value == "ready"


def test_below_min_np_a_lost_rank_breaks_the_pool_saying_so():
    with ddl_magic.start(np=2, min_np=2, quiet=True) as pool:
        assert pool.run(_sum_of_ranks) == 3.0
        with pytest.raises(RankFailedError):
            pool.run(_kill_rank_1)
        with pytest.raises(PoolBrokenError, match="1 rank left, fewer than min_np=2"):
            pool.run(_sum_of_ranks)


def test_min_np_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match="1 <= min_np <= np"):
        ddl_magic.start(np=2, min_np=3)


@pytest.mark.long_on_connect
def test_an_elastic_pool_on_spark_replaces_a_killed_rank_with_a_new_task(spark):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with ddl_magic.start(np=2, min_np=1, spark=True, quiet=True) as pool:
            cell(pool, HVD + "kept = hvd.rank()")
            with pytest.raises(RankFailedError, match="rank 1"):
                cell(pool, KILL_RANK_1)
            assert "rank 1 replaced by a fresh rank" in pool.replaced[0]
            assert cell(pool, HVD + "(globals().get('kept'), " + SUM + ")") == [(0, 3.0),
                                                                               (None, 3.0)]
        assert wait_until(no_spark_job_active, timeout_s=30), "a rank's job still holds its slot"
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def cell(pool, source: str):
    """Run `source` on every rank of `pool`, as `%%horovod --all-ranks` does: every rank's
    last expression."""
    captured = capture_cell(source, {}, pool.rank_names)
    return pool.run_cell(captured.payload, return_all=True, timeout_s=120, quiet=True).results


def _sum_of_ranks():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    return hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()


def _kill_rank_1():
    import ddl_magic.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _sum_of_ranks()
