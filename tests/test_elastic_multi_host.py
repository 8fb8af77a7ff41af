"""An elastic run on a real Spark standalone cluster of two hosts (`two_host_cluster.py`),
2 ranks per host: a host's whole worker is killed mid-training (its JVM, its executor and
the ranks on it), training goes on on the other host from the last commit, and when the
worker comes back its executor takes the waiting replacement tasks, whose ranks join the
ring at the next commit. With the default peer timeout: what a user gets.

Needs root for the namespaces; skips with the reason elsewhere.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

import test_elastic_spark
from ddl_magic import HorovodRunner
from spark_sessions import no_spark_job_active, sent_by_value
from test_elastic_spark import assert_trained_as_committed, steps_logged, train_until_whole_again
from test_spark_launcher import wait_until

NP = 4
MAX_STEPS = 3000  # 0.05 s each: the bound on a run that never grows back


@pytest.fixture(scope="module")
def spark(cluster):
    with pytest.MonkeyPatch.context() as patch, sent_by_value(test_elastic_spark):
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("SPARK_LOCAL_IP", cluster.driver_address)
        session = cluster.spark_session("ddl_magic elastic, two hosts", NP)
        yield session
        session.stop()


def test_a_lost_host_leaves_training_on_the_other_and_its_return_grows_the_ring_back(
        spark, cluster, tmp_path):
    import psutil

    runner = HorovodRunner(np=NP, min_np=2, timeout=240,
                           driver_log_verbosity="log_callback_only")
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = runner.run(train_until_whole_again, log_dir=str(tmp_path),
                                           np=NP, max_steps=MAX_STEPS)
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(lambda: any(step >= 5 and size == NP
                                  for _, step, size in steps_logged(tmp_path)) or outcome,
                      timeout_s=120), "training did not start"
    assert not outcome, outcome
    host = cluster.hosts[1]
    worker = psutil.Process(host.worker.pid)
    for process in [worker, *worker.children(recursive=True)]:
        process.kill()
    killed_at = time.time()
    assert wait_until(lambda: any(when > killed_at and size == 2
                                  for when, _, size in steps_logged(tmp_path)) or outcome,
                      timeout_s=60), "training did not go on on the host that was left"
    next_step_at = min(when for when, _, size in steps_logged(tmp_path)
                       if when > killed_at and size == 2)
    print(f"\ntwo hosts, {host.name}'s worker killed: {next_step_at - killed_at:.2f} s from "
          "the kill to the next completed step (default peer timeout)")
    cluster.start_worker(host)
    returned_at = time.time()
    thread.join(timeout=180)
    assert not thread.is_alive(), "the run did not end"
    assert "error" not in outcome, outcome.get("error")
    weights, done, size = outcome["result"]
    assert done < MAX_STEPS, "the ring never grew back"
    assert size == NP
    assert_trained_as_committed(weights, done)
    lost, *grown = runner.last_run.resets
    assert len(lost.left) == 2 and lost.size == 2 and lost.joined == ()
    # The two replacements join at one commit, or at two when one's task started later.
    assert sum(len(reset.joined) for reset in grown) == 2 and grown[-1].size == NP
    assert all(reset.left == () for reset in grown), "a rank was lost after the host came back"
    print(f"the worker restarted: {grown[-1].at - returned_at:.2f} s to a world of {NP} ranks "
          "again")
    assert wait_until(no_spark_job_active, timeout_s=30), "a rank's job still holds its slot"
