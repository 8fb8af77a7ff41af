"""Ranks as Spark barrier tasks, on a real local SparkSession with 4 task slots: every test
runs on a classic session and again on a Spark Connect one.

Each test runs a whole `Job` through `SparkLauncher`: the barrier stage, the rank processes
its tasks start, the rendezvous through the driver's control server, and what comes back
when a rank, an executor's Python or the Spark job itself fails.
"""

import collections
import os
import subprocess
import sys
import threading
import time

import pytest

import ddl_magic
from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.launch.spark import SparkLauncher
from ddl_magic.wire.tasks import FunctionTask
from spark_sessions import classic_only, no_spark_job_active, sent_by_value, spark_context

RUN_TIMEOUT_S = 90
# Failures must come back as soon as the tasks end, well before the run's start timeout.
QUICK_FAILURE_S = 30


@pytest.fixture(scope="module", autouse=True)
def functions_travel_by_value():
    with sent_by_value(sys.modules[__name__]):
        yield


def run_on_spark(function, np, data=None, **kwargs):
    options = JobOptions(timeout_s=RUN_TIMEOUT_S, return_all=True, hide_output=True)
    if data is not None:  # a stage over the DataFrame, as a run given one has
        from ddl_magic.launch.shares import prepare_shares

        data = prepare_shares({"data": data}, np, on_spark=True).spark_stage
    return Job(FunctionTask(function, kwargs), np, SparkLauncher(data=data), options).run()


def allreduce_ranks():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
    return hvd.rank(), hvd.size(), total.item()


def append_rank_then_fail_on_rank_1(log_path):
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    with open(log_path, "a") as log:
        log.write(f"{hvd.rank()}\n")
    if hvd.rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    hvd.allreduce(torch.ones(1))  # waits for rank 1 until the driver stops this rank


def wait_until(condition, timeout_s: float) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes (Spark's job status lags a little)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # an exited orphan waiting for init to reap it is gone too


@pytest.mark.long_on_connect
@pytest.mark.parametrize("np", [2, 4])
def test_every_rank_allreduces_and_returns_its_value(spark, np):
    run = run_on_spark(allreduce_ranks, np)
    total = float(sum(range(1, np + 1)))
    assert run.results == [(rank, np, total) for rank in range(np)]
    assert run.where == "Spark barrier tasks"
    assert [rank.status for rank in run.ranks] == ["done"] * np
    # a barrier stage costs the driver a connection per rank and per task, served by one
    # thread, and 2 rendezvous messages per rank (Register in, Start out)
    assert run.control["connections"] == 2 * np and run.control["threads"] == 1
    assert run.control["rendezvous_messages"] == 2 * np


def test_more_ranks_than_task_slots_is_refused_at_once(spark):
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"np=5 needs 5 Spark task slots .* has 4 ") as refused:
        run_on_spark(allreduce_ranks, 5)
    assert time.monotonic() - started < 5
    assert "np=4 or fewer" in str(refused.value)
    assert no_spark_job_active()


@pytest.mark.long_on_connect
def test_a_failing_rank_stops_every_rank_and_spark_does_not_run_it_again(spark, tmp_path):
    log_path = tmp_path / "invocations.log"
    with pytest.raises(RankFailedError) as failure:
        run_on_spark(append_rank_then_fail_on_rank_1, 2, log_path=str(log_path))
    error = failure.value
    assert error.rank == 1
    assert "ValueError: rank 1 fails on purpose" in error.traceback
    assert "append_rank_then_fail_on_rank_1" in error.traceback
    invocations = collections.Counter(log_path.read_text().split())
    assert invocations["1"] == 1 and max(invocations.values()) == 1  # rank 0 may be stopped first
    assert wait_until(lambda: no_spark_job_active(), timeout_s=10)
    rank_pids = [rank.pid for rank in error.run.ranks if rank.pid is not None]
    assert rank_pids and wait_until(lambda: not any(map(process_alive, rank_pids)), timeout_s=10)

    assert run_on_spark(allreduce_ranks, 2).results == [(0, 2, 3.0), (1, 2, 3.0)]


def python_with(venv, *paths) -> str:
    """A new Python at `venv` that has nothing installed but `paths` on its path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    site_packages, = venv.glob("lib/python*/site-packages")
    (site_packages / "test_paths.pth").write_text("".join(f"{path}\n" for path in paths))
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def only_pyarrow(tmp_path_factory):
    """A directory holding pyarrow (which Spark's Arrow stages need) and nothing else."""
    import pyarrow

    directory = tmp_path_factory.mktemp("only-pyarrow")
    (directory / "pyarrow").symlink_to(os.path.dirname(pyarrow.__file__))
    return directory


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A Python with nothing installed: neither ddl_magic nor its dependencies."""
    return python_with(tmp_path_factory.mktemp("bare-venv"))


@pytest.fixture(scope="module")
def python_with_pyarrow_only(tmp_path_factory, only_pyarrow):
    """A Python with pyarrow, but not ddl_magic."""
    return python_with(tmp_path_factory.mktemp("pyarrow-venv"), only_pyarrow)


@pytest.fixture
def executors_use(spark, monkeypatch):
    """Run this test's Spark jobs with another Python on the executors, as a cluster might."""
    classic_only(spark, "a Connect server's executors use the Python it was started with")

    def use(python: str) -> None:
        context = spark_context()
        monkeypatch.setattr(context, "pythonExec", python)
        # An executor's working directory is no checkout of ddl_magic: don't import from it.
        monkeypatch.setitem(context.environment, "PYTHONSAFEPATH", "1")

    return use


def test_an_executor_python_without_ddl_magic_is_named_with_the_fix(
        spark, python_with_pyarrow_only, executors_use):
    executors_use(python_with_pyarrow_only)
    started = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_spark(allreduce_ranks, 2)
    assert time.monotonic() - started < QUICK_FAILURE_S
    assert failure.value.reason == (
        f"the executors' Python ({python_with_pyarrow_only}) cannot import ddl_magic: No "
        "module named 'ddl_magic'. Install ddl_magic on every executor, or set PYSPARK_PYTHON "
        "to a Python that has it")
    assert wait_until(lambda: no_spark_job_active(), timeout_s=10)


def test_an_executor_python_without_pyarrow_is_named_with_the_fix(spark, bare_python,
                                                                  executors_use):
    """A stage over a DataFrame (every stage on Connect) is an Arrow stage: it needs pyarrow."""
    executors_use(bare_python)
    started = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_spark(allreduce_ranks, 2, data=spark.range(4))
    assert time.monotonic() - started < QUICK_FAILURE_S
    assert failure.value.reason.startswith(
        "its Spark task failed: ModuleNotFoundError: No module named 'pyarrow'. The executors' "
        "Python lacks what ddl_magic needs: install ddl_magic on every executor, or set "
        "PYSPARK_PYTHON")
    assert wait_until(lambda: no_spark_job_active(), timeout_s=10)


def test_a_rank_that_dies_before_it_registers_shows_what_it_printed(spark, executors_use,
                                                                    only_pyarrow, tmp_path):
    # ddl_magic is on this Python's path, but not the packages it needs (torch, cloudpickle).
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(ddl_magic.__file__)))
    executors_use(python_with(tmp_path / "venv", checkout, only_pyarrow))

    started = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_spark(allreduce_ranks, 2)
    assert time.monotonic() - started < QUICK_FAILURE_S
    assert failure.value.reason == "exit code 1"
    assert "ModuleNotFoundError: No module named" in failure.value.traceback


def last_words_then_sigkill():
    import os
    import signal
    import sys

    import ddl_magic.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        print("KILL_AT the next line", flush=True)
        sys.stderr.write("a line it never finished")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.barrier()


def test_a_rank_killed_hard_keeps_its_last_words(spark):
    with pytest.raises(RankFailedError) as failure:
        run_on_spark(last_words_then_sigkill, 2)
    assert (failure.value.rank, failure.value.reason) == (1, "killed by SIGKILL")
    with open(os.path.join(ddl_magic.last_run().log_dir, "rank-1.log")) as log:
        assert log.read().splitlines()[-2:] == ["KILL_AT the next line", "a line it never finished"]
    assert wait_until(lambda: no_spark_job_active(), timeout_s=10)


def rank_and_what_forked_it():
    import psutil

    import ddl_magic.torch as hvd

    hvd.init()
    factory = psutil.Process().parent()
    return (hvd.rank(), factory.pid, " ".join(factory.cmdline()),
            " ".join(factory.parent().cmdline()))


def test_a_ranks_factory_outlives_its_task_in_the_python_worker_spark_keeps(spark):
    classic_only(spark, "Spark Connect gives each job Python workers of their own: no worker "
                        "outlives a run to keep a factory")
    ranks = run_on_spark(rank_and_what_forked_it, 2).results
    for _, _, forked_by, worker in ranks:
        assert "ddl_magic.rank.factory" in forked_by and "pyspark" in worker
    # Spark keeps its idle Python workers for later tasks, and each keeps its factory for
    # their ranks (Spark hands idle workers out in turn, so which one a task gets varies).
    assert all(process_alive(factory) for _, factory, _, _ in ranks)


def note_the_process_chain_then_wait(path):
    import os
    import threading

    import psutil

    import ddl_magic.torch as hvd

    hvd.init()
    factory = psutil.Process().parent()
    with open(f"{path}-{hvd.rank()}.tmp", "w") as note:
        note.write(f"{os.getpid()} {factory.pid} {factory.ppid()}")
    os.rename(f"{path}-{hvd.rank()}.tmp", f"{path}-{hvd.rank()}")
    threading.Event().wait(120)


@pytest.mark.long_on_connect
def test_a_python_worker_that_dies_takes_its_factory_and_its_rank_along(spark, tmp_path):
    import signal

    notes = str(tmp_path / "chain")
    outcome = {}

    def run():
        try:
            run_on_spark(note_the_process_chain_then_wait, 2, path=notes)
        except RankFailedError as failure:
            outcome["failure"] = failure

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    assert wait_until(lambda: os.path.exists(f"{notes}-1"), timeout_s=RUN_TIMEOUT_S)
    rank, factory, worker = (int(pid) for pid in open(f"{notes}-1").read().split())
    os.kill(worker, signal.SIGKILL)  # as Spark's end of a killed task, or the OOM killer
    assert wait_until(lambda: not process_alive(rank) and not process_alive(factory), 10)
    runner.join(timeout=QUICK_FAILURE_S)
    assert not runner.is_alive() and outcome["failure"].rank == 1
    assert wait_until(lambda: no_spark_job_active(), timeout_s=10)


def test_a_failed_spark_task_is_reported_as_its_rank_failing(spark, executors_use):
    executors_use("/nonexistent/python3")
    started = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_spark(allreduce_ranks, 2)
    assert time.monotonic() - started < QUICK_FAILURE_S
    assert failure.value.rank in (0, 1)
    assert failure.value.reason.startswith("its Spark task failed: ")
    assert 'Cannot run program "/nonexistent/python3"' in failure.value.reason
    assert wait_until(lambda: no_spark_job_active(), timeout_s=10)


def test_without_an_active_session_the_error_says_what_to_do(monkeypatch):
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    def none_active(cls):
        raise PySparkRuntimeError(errorClass="NO_ACTIVE_OR_DEFAULT_SESSION",
                                  messageParameters={})

    for kind in (SparkSession, ConnectSession):
        monkeypatch.setattr(kind, "active", classmethod(none_active))
    with pytest.raises(RuntimeError, match=r"SparkSession.builder.getOrCreate\(\).*--local"):
        SparkLauncher()


def test_a_run_started_from_another_thread_finds_the_notebooks_session(spark):
    """pyspark's active session is per thread; the default one serves every thread."""
    from ddl_magic.frontends.runner import make_launcher

    outcome = {}

    def run_elsewhere():
        try:
            outcome["launcher"] = type(make_launcher(spark=None)).__name__
            outcome["ranks"] = run_on_spark(allreduce_ranks, 2).results
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run_elsewhere)
    thread.start()
    thread.join(timeout=RUN_TIMEOUT_S)
    assert "error" not in outcome, outcome
    assert outcome["launcher"] == "SparkLauncher"
    assert sorted(outcome["ranks"]) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_gpus_without_spark_gpu_resources_is_an_error_before_launch(spark):
    from ddl_magic import HorovodRunner

    with pytest.raises(ValueError, match="spark.task.resource.gpu.amount"):
        HorovodRunner(np=2, use_gpu=True).run(len, obj=[])
