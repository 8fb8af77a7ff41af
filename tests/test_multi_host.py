"""ddl_magic on a real Spark standalone cluster of two hosts (`two_host_cluster.py`: each
worker in network and UTS namespaces of its own), 2 ranks per host: placement, collectives,
training and the timeline across hosts, then the failures only several hosts have: a rank
killed on one host, the link to a host cut (mid-training, and before a run starts), a
host's whole worker killed.

Needs root for the namespaces; skips with the reason elsewhere. The cluster starts once for
the module (~10 s, and ~12 s for the session).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.launch.spark import SparkLauncher
from ddl_magic.wire.tasks import FunctionTask
from spark_sessions import no_spark_job_active, sent_by_value
from test_spark_launcher import process_alive, wait_until

NP = 4
RUN_TIMEOUT_S = 120
PEER_TIMEOUT_S = 4  # DDL_MAGIC_PEER_TIMEOUT for the cut-link test: its deadline is this plus slack


@pytest.fixture(scope="module")
def spark(cluster):
    with pytest.MonkeyPatch.context() as patch, sent_by_value(sys.modules[__name__]):
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("SPARK_LOCAL_IP", cluster.driver_address)
        session = cluster.spark_session("ddl_magic two hosts", NP)
        yield session
        session.stop()


def run_on_cluster(function, np=NP, env=None, timeline=None, **kwargs):
    options = JobOptions(timeout_s=RUN_TIMEOUT_S, return_all=True, hide_output=True,
                         env=env or {}, timeline_path=timeline)
    return Job(FunctionTask(function, kwargs), np, SparkLauncher(), options).run()


def rank_processes_gone(run) -> bool:
    pids = [rank.pid for rank in run.ranks if rank.pid is not None]
    return bool(pids) and wait_until(lambda: not any(map(process_alive, pids)), timeout_s=10)


# ---- what the ranks run ----------------------------------------------------------------------

def batch(step: int, rank: int):
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


def train(steps: int, started_dir: str | None = None, kill_rank: int | None = None,
          kill_at: int = -1):
    """Average-gradient SGD on a linear model; returns where each rank is and the weights."""
    import socket

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        if step == 1 and started_dir:  # written whole, then named: a reader never sees it empty
            unnamed = Path(started_dir, f".rank-{hvd.rank()}")
            unnamed.write_text(socket.gethostname())
            unnamed.rename(Path(started_dir, f"rank-{hvd.rank()}"))
        if step == kill_at and hvd.rank() == kill_rank:
            print(f"KILL_AT step {step} at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = batch(step, hvd.rank())
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "host": socket.gethostname(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "sum": total,
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def weights_of_one_process(steps: int, np: int) -> list:
    """The same training in one process: each step's gradient averaged over the ranks' batches."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        for rank in range(np):
            inputs, targets = batch(step, rank)
            (torch.nn.functional.mse_loss(model(inputs), targets) / np).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


# ---- the tests ---------------------------------------------------------------------------------

def test_four_ranks_on_two_hosts_are_numbered_by_host_and_train_as_one_process(spark, tmp_path):
    timeline = tmp_path / "trace.json"
    run = run_on_cluster(train, timeline=str(timeline), steps=20)
    ranks = run.results
    hosts = {}
    for rank in ranks:
        hosts.setdefault(rank["host"], []).append(rank["rank"])
    assert len(hosts) == 2 and all(len(on_host) == 2 for on_host in hosts.values()), hosts
    cross = {host: index for index, host in enumerate(sorted(hosts, key=lambda h: min(hosts[h])))}
    for rank in ranks:
        on_host = sorted(hosts[rank["host"]])
        assert (rank["local_rank"], rank["local_size"]) == (on_host.index(rank["rank"]), 2)
        assert (rank["cross_rank"], rank["cross_size"]) == (cross[rank["host"]], 2)
        assert rank["sum"] == 6.0
        assert rank["weights"] == pytest.approx(weights_of_one_process(20, NP), abs=1e-6)
    assert [r.host for r in run.ranks] == [rank["host"] for rank in ranks]

    events = json.loads(timeline.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == set(range(NP))
    # Clocks aligned: every rank's last allreduce (the sum above, done together) overlaps
    # every other's on the driver's clock.
    last = {}
    for event in events:
        if event.get("ph") == "X" and "allreduce.noname" in json.dumps(event.get("args", {})) + event["name"]:
            last[event["pid"]] = event
    assert set(last) == set(range(NP)), sorted(last)
    latest_start = max(e["ts"] for e in last.values())
    earliest_end = min(e["ts"] + e["dur"] for e in last.values())
    assert latest_start <= earliest_end + 1000, "a rank's allreduce ends before another's begins"


def read_share(train):
    """Where this rank runs, what forked it and whose process that is (the one that handed it
    its share), and the ids in the share."""
    import socket

    import psutil

    import ddl_magic.torch as hvd

    hvd.init()
    ids = [int(i) for batch in train.loader(batch_size=10, columns=["id"], drop_last=False)
           for i in batch["id"]]
    factory = psutil.Process().parent()
    return {"host": socket.gethostname(), "ids": ids, "forked_by": " ".join(factory.cmdline()),
            "writer": " ".join(factory.parent().cmdline())}


def test_shares_are_written_on_each_hosts_executor_and_read_by_the_ranks_there(spark):
    from ddl_magic.launch.shares import prepare_shares

    frame = spark.range(0, 404, 1, 3)
    data = prepare_shares({"train": frame}, NP, on_spark=True)
    options = JobOptions(timeout_s=RUN_TIMEOUT_S, return_all=True, hide_output=True)
    run = Job(FunctionTask(read_share, {"train": data.shares["train"]}), NP,
              SparkLauncher(data=data.spark_stage), options).run()
    ranks = run.results
    assert len({rank["host"] for rank in ranks}) == 2
    assert [r.host for r in run.ranks] == [rank["host"] for rank in ranks]
    assert all("ddl_magic.rank.factory" in rank["forked_by"] for rank in ranks)
    assert all("pyspark" in rank["writer"] for rank in ranks)  # its Spark task, beside it
    assert sorted(i for rank in ranks for i in rank["ids"]) == list(range(404))


def test_more_ranks_than_the_clusters_slots_is_refused_at_once(spark):
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"np=5 needs 5 Spark task slots .* has 4 "):
        run_on_cluster(train, np=5, steps=1)
    assert time.monotonic() - started < 5
    assert no_spark_job_active()


def test_a_rank_killed_on_one_host_fails_the_run_within_seconds_naming_rank_and_host(spark):
    with pytest.raises(RankFailedError) as failure:
        run_on_cluster(train, steps=10_000, kill_rank=2, kill_at=20)
    noticed_at = time.time()
    error = failure.value
    assert (error.rank, error.reason) == (2, "killed by SIGKILL")
    log = Path(error.run.ranks[2].log_path).read_text()
    assert "KILL_AT step 20" in log
    killed_at = float(log.split("KILL_AT step 20 at ")[1].split()[0])
    assert noticed_at - killed_at < 5, f"noticed {noticed_at - killed_at:.1f} s after the kill"
    assert error.host == error.run.ranks[2].host and error.host.startswith("ddl-host-")
    assert f"rank 2 ({error.host})" in str(error)
    assert wait_until(no_spark_job_active, timeout_s=10)
    assert rank_processes_gone(error.run)
    assert [rank["sum"] for rank in run_on_cluster(train, steps=2).results] == [6.0] * NP


def start_training_in_background(tmp_path, **env):
    """Start a long training run on a thread; returns (started_dir, outcome, thread). Every rank
    writes its hostname to started_dir/rank-N once it is training."""
    started = tmp_path / "started"
    started.mkdir()
    outcome = {}

    def run():
        try:
            outcome["result"] = run_on_cluster(train, env=env, steps=1_000_000,
                                               started_dir=str(started))
        except BaseException as exc:  # handed to the test's thread
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(lambda: len(list(started.glob("rank-*"))) == NP or outcome, timeout_s=90), \
        "the ranks did not start training"
    assert not outcome, f"the run ended before training: {outcome}"
    return started, outcome, thread


@pytest.mark.long  # the default run keeps one fault across hosts: a rank killed
def test_a_host_cut_off_mid_training_fails_the_run_naming_that_host(spark, cluster, tmp_path,
                                                                   monkeypatch):
    from ddl_magic.wire.channel import PEER_TIMEOUT_VARIABLE

    monkeypatch.setenv(PEER_TIMEOUT_VARIABLE, str(PEER_TIMEOUT_S))  # the driver's connections
    started, outcome, thread = start_training_in_background(
        tmp_path, **{PEER_TIMEOUT_VARIABLE: str(PEER_TIMEOUT_S)})
    name = (started / "rank-1").read_text()
    host = next(h for h in cluster.hosts if h.name == name)
    cluster.cut_link(host)
    cut_at, cut_at_epoch = time.monotonic(), time.time()  # (the ranks' records keep epoch time)
    try:
        thread.join(timeout=PEER_TIMEOUT_S + 60)
    finally:
        cluster.restore_link(host)
    assert not thread.is_alive(), "the run did not end"
    error = outcome.get("error")
    assert isinstance(error, RankFailedError), outcome
    cut_off = sorted(r.rank for r in error.run.ranks if r.host == name)
    # When the driver judged the host lost (it shows so at once), and when the run had ended,
    # its ranks elsewhere stopped and the Spark job cancelled.
    named_after = min(error.run.ranks[rank].ended_at for rank in cut_off) - cut_at_epoch
    ended_after = outcome["at"] - cut_at
    print(f"the cut link was named {named_after:.2f} s after the cut, and the run had ended "
          f"{ended_after:.2f} s after it (peer timeout {PEER_TIMEOUT_S} s)")
    assert named_after < PEER_TIMEOUT_S, f"noticed too late: {named_after:.2f} s"
    assert ended_after < PEER_TIMEOUT_S + 6, f"ended too late: {ended_after:.2f} s"
    assert error.rank in cut_off and error.host == name
    assert (f"its host {name} stopped answering (no reply within {PEER_TIMEOUT_S} s), with "
            f"ranks {cut_off[0]} and {cut_off[1]}") in error.reason
    assert wait_until(no_spark_job_active, timeout_s=30)
    assert [rank["sum"] for rank in run_on_cluster(train, steps=2).results] == [6.0] * NP


@pytest.mark.long  # the default run keeps one fault across hosts: a rank killed
def test_a_run_started_while_a_host_is_cut_off_fails_naming_that_host(spark, cluster,
                                                                      monkeypatch):
    """Spark still places ranks on a host it cannot reach (its executor's heartbeat has not
    timed out yet): nothing ever comes from them, and the driver names the host that does
    not answer instead of waiting for the start timeout."""
    from ddl_magic.wire.channel import PEER_TIMEOUT_VARIABLE

    monkeypatch.setenv(PEER_TIMEOUT_VARIABLE, str(PEER_TIMEOUT_S))  # the driver's probes
    host = cluster.hosts[1]
    cluster.cut_link(host)
    started_at = time.monotonic()
    try:
        with pytest.raises(RankFailedError) as failed:
            run_on_cluster(train, env={PEER_TIMEOUT_VARIABLE: str(PEER_TIMEOUT_S)}, steps=2)
        failed_at = time.monotonic()
    finally:
        cluster.restore_link(host)
    error = failed.value
    assert failed_at - started_at < PEER_TIMEOUT_S + 10, "noticed too late"
    cut_off = sorted(r.rank for r in error.run.ranks if r.host == host.address)
    assert len(cut_off) == 2 and error.rank in cut_off and error.host == host.address
    assert (f"its host {host.address} stopped answering (no reply within {PEER_TIMEOUT_S} s), "
            f"with ranks {cut_off[0]} and {cut_off[1]}") in error.reason
    assert all(r.status == "stopped" for r in error.run.ranks if r.rank not in cut_off)
    assert wait_until(no_spark_job_active, timeout_s=30)
    assert [rank["sum"] for rank in run_on_cluster(train, steps=2).results] == [6.0] * NP


@pytest.mark.long  # the default run keeps one fault across hosts: a rank killed
def test_a_hosts_worker_killed_fails_the_run_naming_the_host_and_its_ranks(spark, cluster,
                                                                           tmp_path):
    import psutil

    started, outcome, thread = start_training_in_background(tmp_path)
    name = (started / "rank-1").read_text()
    host = next(h for h in cluster.hosts if h.name == name)
    worker = psutil.Process(host.worker.pid)
    for process in [worker, *worker.children(recursive=True)]:
        process.kill()
    killed_at = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the run did not end"
    error = outcome.get("error")
    assert isinstance(error, RankFailedError), outcome
    assert outcome["at"] - killed_at < 10, "noticed too late"
    lost = sorted(r.rank for r in error.run.ranks if r.host == name)
    assert error.rank in lost and error.host == name
    assert (f"the Spark executor on {name} was lost, and ranks {lost[0]} and {lost[1]} with it"
            in error.reason)
    assert wait_until(no_spark_job_active, timeout_s=30)
    assert rank_processes_gone(error.run)
