"""A pool (`ddl_magic.start`) on a real Spark standalone cluster of two hosts
(`two_host_cluster.py`), 2 ranks per host: state kept between cells and collectives across
hosts, then what only a pool across hosts meets: a rank killed in a cell, a host lost in a
cell, and a host lost between cells, each followed by what the next cell says.

Needs root for the namespaces; skips with the reason elsewhere. The cluster starts once for
the module. The peer timeout is short (`PEER_TIMEOUT_S`) so that a lost host is judged
within seconds; each test starts its own pool and stops it, whatever happens.
"""

from __future__ import annotations

import re
import time

import pytest

import ddl_magic
from ddl_magic.driver.capture import capture_cell
from ddl_magic.driver.pool import PoolBrokenError, PoolState
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.wire.channel import PEER_TIMEOUT_VARIABLE
from spark_sessions import no_spark_job_active
from test_spark_launcher import process_alive, wait_until

NP = 4
PEER_TIMEOUT_S = 4
CELL_TIMEOUT_S = 120
HVD = "import os, socket, time, torch\nimport ddl_magic.torch as hvd\nhvd.init()\n"
# Every rank adds rank + 1: with 4 ranks the sum is 10.0, whatever happened before.
SUM = "hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()"
# Allreduces until stopped; each rank first says, on a line of its own, that it is in the loop.
ALLREDUCE_FOR_EVER = ("print(f'LOOPING on {socket.gethostname()} at {time.time()}', flush=True)\n"
                      "while True:\n    " + SUM + "\n")


@pytest.fixture(scope="module")
def spark(cluster):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYSPARK_PYTHON", __import__("sys").executable)
        patch.setenv("SPARK_LOCAL_IP", cluster.driver_address)
        # The driver's and the ranks' (the pool passes it on): a lost host is judged in seconds.
        patch.setenv(PEER_TIMEOUT_VARIABLE, str(PEER_TIMEOUT_S))
        session = cluster.spark_session("ddl_magic pool, two hosts", NP)
        yield session
        session.stop()


@pytest.fixture
def pool(spark):
    """A pool of 4 ranks on the cluster, stopped after the test; nothing of it outlives it."""
    pool = ddl_magic.start(np=NP, spark=True, quiet=True)
    try:
        yield pool
    finally:
        pids = [pid for pid in pool.pids if pid is not None]
        pool.stop()
        assert wait_until(lambda: not any(map(process_alive, pids)), timeout_s=30), \
            "a rank outlived its pool"
        assert wait_until(no_spark_job_active, timeout_s=30), "the pool's stage still holds slots"


def cell(pool, source: str):
    """Run `source` on every rank of `pool`, as `%%horovod` does; rank 0's last expression."""
    captured = capture_cell(source, {}, pool.rank_names)
    return pool.run_cell(captured.payload, return_all=True, timeout_s=CELL_TIMEOUT_S, quiet=True)


def hosts_of(pool) -> dict[str, list[int]]:
    hosts: dict[str, list[int]] = {}
    for info in pool.status():
        hosts.setdefault(info.host, []).append(info.rank)
    return hosts


def when_looping(run_dir, rank: int) -> float | None:
    """When `rank` said it is in the loop (epoch time), from its log in the cell's folder."""
    try:
        text = (run_dir / f"rank-{rank}.log").read_text()
    except FileNotFoundError:
        return None
    found = re.search(r"LOOPING on \S+ at (\S+)", text)
    return float(found.group(1)) if found else None


def start_looping(pool, tmp_path):
    """Run `ALLREDUCE_FOR_EVER` on a thread; returns (outcome, thread, the cell's folder) once
    every rank is in the loop."""
    import threading
    from pathlib import Path

    outcome: dict = {}
    cells_before = pool.cells

    def run():
        try:
            outcome["result"] = cell(pool, ALLREDUCE_FOR_EVER)
        except BaseException as exc:  # handed to the test's thread
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    run_dir = Path(pool.log_dir, f"cell-{cells_before + 1}")
    assert wait_until(lambda: all(when_looping(run_dir, rank) for rank in range(NP)) or outcome,
                      timeout_s=60), "the ranks did not start looping"
    assert not outcome, f"the cell ended before looping: {outcome}"
    return outcome, thread, run_dir


# ---- the tests ---------------------------------------------------------------------------------

def test_a_pool_across_two_hosts_keeps_state_and_reduces_across_hosts(pool):
    hosts = hosts_of(pool)
    assert len(hosts) == 2 and all(name.startswith("ddl-host-") for name in hosts), hosts
    assert all(len(ranks) == 2 for ranks in hosts.values()), hosts
    assert all(info.state == "idle" and info.pid for info in pool.status())

    first = cell(pool, HVD + "steps = 0\nhere = socket.gethostname()\n(hvd.rank(), here)")
    assert {host: sorted(r for r, h in first.results if h == host) for host in hosts} == hosts
    cell(pool, "steps += 1\nweight = torch.full((2,), float(hvd.rank()))")
    kept = cell(pool, "steps += 1\n(steps, here, hvd.allreduce(weight, op=hvd.Sum).tolist(), "
                      + SUM + ")")
    assert [value[0] for value in kept.results] == [2] * NP
    assert [value[1] for value in kept.results] == [pool.hosts[rank] for rank in range(NP)]
    assert all(value[2] == [6.0, 6.0] and value[3] == 10.0 for value in kept.results)
    assert pool.pull("steps", all_ranks=True) == [2] * NP


def test_a_rank_killed_in_a_cell_breaks_the_pool_and_a_restart_gives_a_working_one(pool):
    cell(pool, HVD)
    killed_at = {}
    with pytest.raises(RankFailedError) as failure:
        began = time.monotonic()
        cell(pool, "print('last words', flush=True)\n"
                   "if hvd.rank() == 2:\n"
                   "    time.sleep(1)\n"
                   "    print(f'KILLED at {time.time()}', flush=True)\n"
                   "    os.kill(os.getpid(), 9)\n"
                   "while True:\n    " + SUM + "\n")
    noticed_at = time.time()
    error = failure.value
    log = (error.run.ranks[2].log_path and open(error.run.ranks[2].log_path).read())
    killed_at["epoch"] = float(log.split("KILLED at ")[1].split()[0])
    print(f"the killed rank was named {noticed_at - killed_at['epoch']:.2f} s after the kill "
          f"({time.monotonic() - began:.1f} s into the cell)")
    assert (error.rank, error.reason) == (2, "killed by SIGKILL")
    assert error.host == pool.hosts[2] and f"rank 2 ({error.host})" in str(error)
    assert "last words" in log
    assert noticed_at - killed_at["epoch"] < 5, "noticed too late"

    assert pool.state is PoolState.BROKEN
    assert [info.state for info in pool.status()] == ["gone"] * NP
    pids = [pid for pid in pool.pids if pid is not None]
    assert wait_until(lambda: not any(map(process_alive, pids)), timeout_s=15), \
        "the other ranks were left running"
    assert wait_until(no_spark_job_active, timeout_s=30), "the broken pool still holds its slots"
    with pytest.raises(PoolBrokenError) as broken:
        cell(pool, "1")
    said = str(broken.value)
    assert f"rank 2 ({pool.hosts[2]}) was lost (killed by SIGKILL)" in said, said
    assert "%horovod restart" in said and "pool.restart()" in said

    pool.restart()
    assert pool.state is PoolState.READY and len(hosts_of(pool)) == 2
    again = cell(pool, HVD + "(" + SUM + ", socket.gethostname())")
    assert [value[0] for value in again.results] == [10.0] * NP
    assert [value[1] for value in again.results] == pool.hosts


@pytest.mark.long  # the default run keeps one fault of a pool across hosts: a rank killed
def test_a_host_cut_off_in_a_cell_fails_it_naming_the_host_and_breaks_the_pool(pool, cluster,
                                                                               tmp_path):
    cell(pool, HVD)
    outcome, thread, run_dir = start_looping(pool, tmp_path)
    name = pool.hosts[1]
    host = next(h for h in cluster.hosts if h.name == name)
    lost = sorted(rank for rank in range(NP) if pool.hosts[rank] == name)
    pids = [pid for pid in pool.pids if pid is not None]
    cluster.cut_link(host)
    cut_at, cut_at_epoch = time.monotonic(), time.time()
    try:
        thread.join(timeout=PEER_TIMEOUT_S + 60)
        assert not thread.is_alive(), "the cell did not end"
        error = outcome.get("error")
        assert isinstance(error, RankFailedError), outcome
        named_after = min(error.run.ranks[rank].ended_at for rank in lost) - cut_at_epoch
        ended_after = outcome["at"] - cut_at
        print(f"the cut-off host was named {named_after:.2f} s after the cut, and the cell had "
              f"ended {ended_after:.2f} s after it (peer timeout {PEER_TIMEOUT_S} s)")
        assert error.rank in lost and error.host == name
        assert (f"its host {name} stopped answering (no reply within {PEER_TIMEOUT_S} s), with "
                f"ranks {lost[0]} and {lost[1]}") in error.reason
        assert named_after < PEER_TIMEOUT_S + 1, f"named too late: {named_after:.2f} s"
        for rank in range(NP):  # a ring connection the kernel gave up on is not the op timeout
            assert "timed out after 300 s" not in (run_dir / f"rank-{rank}.log").read_text()
        assert ended_after < PEER_TIMEOUT_S + 6, f"ended too late: {ended_after:.2f} s"
        assert pool.state is PoolState.BROKEN
        with pytest.raises(PoolBrokenError) as broken:
            cell(pool, "1")
        said = str(broken.value)
        assert (f"ranks {lost[0]} and {lost[1]} ({name}) were lost (its host {name} stopped "
                "answering") in said, said
        assert "in cell 2" in said and "%horovod restart" in said, said
    finally:
        cluster.restore_link(host)
    assert wait_until(lambda: not any(map(process_alive, pids)), timeout_s=PEER_TIMEOUT_S + 20), \
        "ranks were left running"
    pool.stop()
    assert wait_until(no_spark_job_active, timeout_s=30), "the pool's stage still holds slots"


@pytest.mark.long  # the default run keeps one fault of a pool across hosts: a rank killed
def test_a_host_lost_between_cells_breaks_the_pool_saying_so(pool, cluster):
    cell(pool, HVD + "kept = hvd.rank()")
    name = pool.hosts[1]
    host = next(h for h in cluster.hosts if h.name == name)
    lost = sorted(rank for rank in range(NP) if pool.hosts[rank] == name)
    pids = [pid for pid in pool.pids if pid is not None]
    cluster.cut_link(host)
    cut_at = time.monotonic()
    try:
        # Nobody runs a cell: the pool itself notices, within the peer timeout and a report,
        # and then stops its other ranks and its stage.
        assert wait_until(lambda: pool.broken_reason, timeout_s=PEER_TIMEOUT_S + 10), \
            "the idle pool did not notice its lost host"
        noticed_after = time.monotonic() - cut_at
        assert wait_until(lambda: pool.state is PoolState.BROKEN, timeout_s=40)
        print(f"the idle pool judged its host lost {noticed_after:.2f} s after the cut, and was "
              f"broken {time.monotonic() - cut_at:.2f} s after it (peer timeout {PEER_TIMEOUT_S} s)")
        assert noticed_after < PEER_TIMEOUT_S + 1.5, f"noticed too late: {noticed_after:.2f} s"
        with pytest.raises(PoolBrokenError) as broken:
            cell(pool, "kept")
        said = str(broken.value)
        assert f"ranks {lost[0]} and {lost[1]} ({name}) were lost ({name} stopped answering" \
            in said, said
        assert "while the pool was idle" in said and "%horovod restart" in said, said
        assert [info.state for info in pool.status()] == ["gone"] * NP
    finally:
        cluster.restore_link(host)
    assert wait_until(lambda: not any(map(process_alive, pids)), timeout_s=PEER_TIMEOUT_S + 20), \
        "ranks were left running"
    assert wait_until(no_spark_job_active, timeout_s=30), "the broken pool still holds its slots"


@pytest.mark.long  # the default run keeps one fault of a pool across hosts: a rank killed
def test_a_hosts_worker_killed_in_a_cell_fails_it_naming_the_host_and_breaks_the_pool(pool,
                                                                                     cluster,
                                                                                     tmp_path):
    """(Last: the cluster keeps one worker after it.)"""
    import psutil

    cell(pool, HVD)
    outcome, thread, _ = start_looping(pool, tmp_path)
    name = pool.hosts[1]
    host = next(h for h in cluster.hosts if h.name == name)
    lost = sorted(rank for rank in range(NP) if pool.hosts[rank] == name)
    pids = [pid for pid in pool.pids if pid is not None]
    worker = psutil.Process(host.worker.pid)
    for process in [worker, *worker.children(recursive=True)]:
        process.kill()
    killed_at = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the cell did not end"
    error = outcome.get("error")
    assert isinstance(error, RankFailedError), outcome
    print(f"the lost executor was named, and the cell ended, {outcome['at'] - killed_at:.2f} s "
          "after its worker was killed")
    assert outcome["at"] - killed_at < 10, "noticed too late"
    assert error.rank in lost and error.host == name
    # A rank whose process died with the executor vanished; one whose process outlived its
    # task (orphaned, until the pool stops it) went silent: either names the host.
    assert (f"the Spark executor on {name} was lost" in error.reason
            or f"its host {name} stopped answering" in error.reason), error.reason
    with pytest.raises(PoolBrokenError) as broken:
        cell(pool, "1")
    said = str(broken.value)
    assert f"ranks {lost[0]} and {lost[1]} ({name}) were lost" in said, said
    assert "%horovod restart" in said, said
    assert wait_until(lambda: not any(map(process_alive, pids)), timeout_s=20), \
        "ranks were left running"
    assert wait_until(no_spark_job_active, timeout_s=30), "the broken pool still holds its slots"
