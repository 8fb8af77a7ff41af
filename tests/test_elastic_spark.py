"""Elastic runs on Spark `local[4]`, classic and Connect: every rank is a Spark job of one
task, so a lost rank fails no other; the ranks left go on at once from their last commit, and
the replacement's task, once it has a slot, joins the world at the ranks' next commit
(a host-update notice, nothing rolled back). The two-host cluster's lost and returning host
is in `test_multi_host.py`."""

import os
import sys

import pytest

from ddl_magic import HorovodRunner
from spark_sessions import no_spark_job_active, sent_by_value
from test_elastic_runs import expected_weights
from test_spark_launcher import process_alive, wait_until


@pytest.fixture(autouse=True)
def functions_travel_by_value():
    """The executors' Python cannot import this test module: its functions go by value."""
    with sent_by_value(sys.modules[__name__]):
        yield


def train_until_whole_again(log_dir, np, max_steps, kill=None):
    """SGD on data that depends on the step only, a commit after every step, until the world
    has shrunk below `np` ranks and grown back to it (or `max_steps`, the bound). `kill`:
    (rank, step): that rank SIGKILLs itself after that step's update, once. Returns the
    weights, the steps done and the world's size, and logs each step's time and size."""
    import signal
    import time

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, shrank=False)
    marker = os.path.join(log_dir, "killed")

    @hvd.elastic.run
    def train(state):
        while state.step < max_steps and not (state.shrank and hvd.size() == np):
            state.shrank = state.shrank or hvd.size() < np
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(state.step))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
            if kill is not None and (hvd.rank(), state.step) == kill and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            state.commit()
            with open(os.path.join(log_dir, "steps"), "a") as f:
                f.write(f"{time.time()} {state.step} {hvd.size()}\n")
            time.sleep(0.05)
        return {name: value.clone() for name, value in model.state_dict().items()}, state.step

    weights, done = train(state)
    return weights, done, hvd.size()


def steps_logged(log_dir) -> list[tuple[float, int, int]]:
    """(when, step, world size) of every step a rank completed."""
    try:
        with open(os.path.join(log_dir, "steps")) as f:
            return [(float(t), int(step), int(size)) for t, step, size in
                    (line.split() for line in f if line.count(" ") == 2)]
    except FileNotFoundError:
        return []


def assert_trained_as_committed(weights, done):
    """Every committed step applied once, as one process would, whatever the worlds were."""
    import torch

    for name, value in expected_weights(done).items():
        assert torch.allclose(weights[name], value, atol=1e-6), name


@pytest.mark.long_on_connect
def test_a_killed_rank_is_replaced_by_a_new_task_that_joins_at_a_commit(spark, tmp_path):
    runner = HorovodRunner(np=2, min_np=1, timeout=180, driver_log_verbosity="log_callback_only")
    weights, done, size = runner.run(train_until_whole_again, log_dir=str(tmp_path), np=2,
                                     max_steps=2000, kill=(1, 3))
    assert done < 2000, "the replacement never joined"
    assert size == 2
    assert_trained_as_committed(weights, done)
    lost, grown = runner.last_run.resets
    # Rank 1 died after step 3's update: rank 0 goes on alone from its fourth commit...
    assert lost.left == (1,) and "SIGKILL" in lost.reasons[0] and lost.joined == ()
    assert lost.size == 1 and lost.resumed_from_commit == 4
    # ...and the replacement, once its task started, joins without a loss.
    assert grown.left == () and grown.joined == (1,) and grown.size == 2
    assert grown.slots == (0, 1)
    assert [rank.status for rank in runner.last_run.ranks] == ["done", "done"]
    assert runner.last_run.where == "Spark tasks, one job per rank"
    with open(tmp_path / "killed") as f:
        killed_at = float(f.read())
    after = [when for when, _, _ in steps_logged(tmp_path) if when > killed_at]
    print(f"\nSpark local[4], rank 1 SIGKILLed: {min(after) - killed_at:.2f} s from the kill "
          "to the next completed step")
    assert wait_until(no_spark_job_active, timeout_s=30), "a rank's job still holds its slot"


@pytest.mark.long_on_connect  # Spark Connect runs in CI: spark_launcher, estimator, inference
def test_a_non_elastic_spark_run_still_fails_fast(spark, tmp_path):
    from ddl_magic.driver.run_result import RankFailedError

    runner = HorovodRunner(np=2, timeout=120, driver_log_verbosity="log_callback_only")
    with pytest.raises(RankFailedError) as failed:
        runner.run(train_until_whole_again, log_dir=str(tmp_path), np=2, max_steps=50,
                   kill=(1, 2))
    assert failed.value.rank == 1 and "SIGKILL" in failed.value.reason
    from ddl_magic import last_run

    assert last_run().resets is None and last_run().status == "failed"


def test_an_elastic_run_over_a_dataframe_is_refused_saying_what_to_do(spark):
    from ddl_magic.launch.spark import SparkLauncher

    from ddl_magic.launch.shares import prepare_shares

    stage = prepare_shares({"train": spark.range(8)}, 2, on_spark=True).spark_stage
    launcher = SparkLauncher(spark, data=stage)
    with pytest.raises(ValueError, match="cannot be given a Spark DataFrame.*Write the "
                                         "DataFrame to Parquet and give the path"):
        launcher.check_elastic(2, 2)


@pytest.mark.long_on_connect
def test_a_rank_stopped_on_spark_is_killed_with_its_task_and_replaced(spark, tmp_path,
                                                                        monkeypatch):
    """A SIGSTOPped rank cannot be signalled from the driver: its job is cancelled, and the
    rank's process dies with its task (a parent-death signal)."""
    monkeypatch.setenv("DDL_MAGIC_PEER_TIMEOUT", "2")
    runner = HorovodRunner(np=2, min_np=1, timeout=180, driver_log_verbosity="log_callback_only")
    stopped = tmp_path / "stopped.pid"
    result = runner.run(stop_once_then_train, log_dir=str(tmp_path), pid_file=str(stopped))
    assert result == 2
    lost = runner.last_run.resets[0]
    assert lost.left == (1,)
    pid = int(stopped.read_text())
    assert wait_until(lambda: not process_alive(pid), timeout_s=20), "the stopped rank lives on"


def stop_once_then_train(log_dir, pid_file):
    """Rank 1 stops itself once, in its first world; the run ends when two ranks are back."""
    import signal

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, shrank=False)

    @hvd.elastic.run
    def train(state):
        while not (state.shrank and hvd.size() == 2) and state.step < 2000:
            state.shrank = state.shrank or hvd.size() < 2
            hvd.allreduce(torch.ones(1))
            if hvd.rank() == 1 and state.step == 3 and not os.path.exists(pid_file):
                with open(pid_file, "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            state.step += 1
            state.commit()
            __import__("time").sleep(0.05)
        return hvd.size()

    return train(state)
