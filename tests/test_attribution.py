"""Which failure the driver names as the cause, from the failures' kinds, times and exit
statuses (never their text): the cases the multi-host and kill tests meet, replayed as
events in the order a busy machine may deliver them, with the driver's stop in between."""

import queue
import time

import pytest

from ddl_magic.driver.attribution import (CAUSE_TIMEOUT_S, LAST_WORDS_TIMEOUT_S, RankFacts,
                                          failures_settled)
from ddl_magic.driver.events import FailureKind, ProcessExited, RankFailed, RankStarted
from ddl_magic.driver.failure_policies import FailFast, connection_lost
from ddl_magic.driver.watcher import RunWatcher
from ddl_magic.driver.run_result import RankFailedError, RunResult
from ddl_magic.launch.spark import SparkLauncher
from ddl_magic.wire.channel import ABORTED_EXIT_CODE
from ddl_magic.driver.records import RankStatus, new_records
from ddl_magic.driver.run_status import RunStatus

HOSTS = ["host-a", "host-b", "host-a", "host-b"]  # as Spark places 4 ranks on 2 hosts


class ShownFailures:
    """A display that keeps the failures it is shown, in order."""

    def __init__(self):
        self.failures = []

    def handle(self, event):
        if isinstance(event, RankFailed):
            self.failures.append(event)

    def finish(self, end):
        pass


def replay(tmp_path, events, abort_before: int, describe_lost=None):
    """Feed `events` (the driver stops the run before the `abort_before`-th) and return the
    error raised, the failures shown and the run's records."""
    run = RunResult("run", len(HOSTS), "test", ranks=new_records(len(HOSTS), str(tmp_path)))
    display = ShownFailures()
    watcher = RunWatcher(run, display, None, events=None, server=None)
    policy = FailFast(watcher, exits_follow_output=True,
                      describe_lost=describe_lost or connection_lost)
    for rank, host in enumerate(HOSTS):
        watcher.handle(RankStarted(rank, host, 100 + rank))
    for index, event in enumerate(events):
        if index == abort_before:
            watcher.aborted_at_ns = index * 10 - 5
        watcher.handle(event)
    failure = policy.failure()
    assert isinstance(failure, RankFailedError)
    return failure, display.failures, run.ranks


def failed(rank, kind, at, reason="", exit_code=None, lost_rank=None):
    return RankFailed(rank, HOSTS[rank], kind, "", reason or kind.value, exit_code, at,
                      lost_rank)


def test_an_executor_lost_after_a_peer_reported_it_is_the_cause_and_named_with_its_host(tmp_path):
    error, shown, ranks = replay(tmp_path, [
        failed(0, FailureKind.LOST_PEER, 0, lost_rank=3),  # the peer's report comes first
        failed(3, FailureKind.VANISHED, 10, "connection lost"),  # after the driver stopped the run
        failed(1, FailureKind.VANISHED, 20, "connection lost"),
    ], abort_before=1, describe_lost=SparkLauncher.describe_lost)
    assert (error.rank, error.host) == (3, "host-b")
    assert error.reason.startswith("the Spark executor on host-b was lost, and ranks 1 and 3 with it")
    assert [f.rank for f in shown] == [3, 1, 0]
    assert [r.status for r in ranks] == ["failed", "failed", "running", "failed"]  # until stopped


def test_a_rank_we_stopped_is_not_blamed_for_the_exception_that_stopped_it(tmp_path):
    error, shown, ranks = replay(tmp_path, [
        failed(1, FailureKind.RAISED, 0, "exception"),
        failed(0, FailureKind.VANISHED, 10, "connection lost"),
        ProcessExited(0, ABORTED_EXIT_CODE),
    ], abort_before=1)
    assert (error.rank, error.reason) == (1, "exception")
    assert [f.rank for f in shown] == [1]
    assert ranks[0].status is RankStatus.STOPPED and ranks[0].reason == ""


def test_a_host_that_stopped_answering_is_named_with_every_rank_on_it(tmp_path):
    error, _, ranks = replay(tmp_path, [
        failed(3, FailureKind.UNREACHABLE, 0),
        failed(0, FailureKind.LOST_PEER, 10, lost_rank=1),
    ], abort_before=1)
    assert (error.rank, error.host) == (3, "host-b")
    assert "its host host-b stopped answering" in error.reason
    assert "with ranks 1 and 3: the network to that host is down" in error.reason
    assert [r.status for r in ranks] == ["failed", "failed", "running", "failed"]


def test_a_killed_rank_outranks_the_connection_errors_of_its_peers(tmp_path):
    error, shown, _ = replay(tmp_path, [
        failed(0, FailureKind.RAISED, 0, "exception"),  # gloo: "Connection reset by peer"
        failed(1, FailureKind.VANISHED, 10, "connection lost"),
        ProcessExited(1, -9),
    ], abort_before=1)
    assert (error.rank, error.reason, error.exit_code) == (1, "killed by SIGKILL", -9)
    assert [f.rank for f in shown] == [1, 0]


def test_a_stopped_rank_is_named_alone_even_when_its_hosts_other_ranks_stop_too(tmp_path):
    """Its owner on that host said it is stopped: the host answers, so the host is not lost
    (a host that stops answering is UNREACHABLE: its tasks' reports stopped coming)."""
    error, _, _ = replay(tmp_path, [
        failed(1, FailureKind.STOPPED, 0, "stopped"),
        failed(0, FailureKind.LOST_PEER, 10, lost_rank=1),
        failed(3, FailureKind.STOPPED, 20, "stopped"),
    ], abort_before=1)
    assert (error.rank, error.host, error.reason) == (1, "host-b", "stopped")


def test_the_cause_is_chosen_once_the_failed_ranks_exits_are_in_or_their_last_words_are_late():
    """Local ranks' exits come after their last words: the driver waits for them, briefly,
    but not for a rank whose host stopped answering, and not where exits come on their own."""
    vanished, unreachable = failed(1, FailureKind.VANISHED, 0), failed(3, FailureKind.UNREACHABLE, 0)
    running, killed = RankFacts("host-b", None, False), RankFacts("host-b", -9, False)
    no_exits, rank_1_killed = [running] * 4, [running, killed, running, running]
    assert not failures_settled([vanished], rank_1_killed, 0.1, exits_follow_output=True)
    assert not failures_settled([vanished], no_exits, 1.0, exits_follow_output=True)
    assert failures_settled([vanished], rank_1_killed, 1.0, exits_follow_output=True)
    assert failures_settled([vanished], no_exits, LAST_WORDS_TIMEOUT_S, exits_follow_output=True)
    assert failures_settled([unreachable], no_exits, 1.0, exits_follow_output=True)
    assert failures_settled([vanished], no_exits, 1.0, exits_follow_output=False)


def test_a_pool_waits_briefly_for_the_cause_of_ranks_that_only_lost_a_peer():
    """A pool's ranks outlive a failed cell: no exit settles the moment. While only lost
    peers are in (the ring timed out on a host the driver is about to judge silent), the
    cause is awaited, a little longer than a lost rank's failure waits for its exit status;
    once it is in, the moment settles at once."""
    symptom = failed(0, FailureKind.LOST_PEER, 0, lost_rank=1)
    cause = failed(1, FailureKind.UNREACHABLE, 10)
    ranks = [RankFacts("host-b", None, False)] * 4
    assert failures_settled([symptom], ranks, 1.0, exits_follow_output=False)  # one-shot runs
    assert not failures_settled([symptom], ranks, 1.0, exits_follow_output=False, await_cause=True)
    assert failures_settled([symptom, cause], ranks, 1.0, exits_follow_output=False,
                            await_cause=True)
    assert not failures_settled([symptom], ranks, LAST_WORDS_TIMEOUT_S,
                                exits_follow_output=False, await_cause=True)
    assert failures_settled([symptom], ranks, CAUSE_TIMEOUT_S, exits_follow_output=False,
                            await_cause=True)


def stop_rank_1():
    import os
    import signal

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == 1:
        print("STOPPING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, its sockets answered by the kernel
    hvd.allreduce(torch.ones(1))  # rank 0 waits here for rank 1


def test_a_rank_that_stops_is_named_within_the_peer_timeout(monkeypatch):
    """SIGSTOP leaves a process whose connections look healthy (the kernel answers for it):
    its owner (the rank factory) sees it stopped, within DDL_MAGIC_PEER_TIMEOUT, and it is
    then killed."""
    from ranks import run_on_ranks

    from ddl_magic.wire.channel import PEER_TIMEOUT_VARIABLE

    monkeypatch.setenv(PEER_TIMEOUT_VARIABLE, "3")
    started = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(stop_rank_1, 2, timeout_s=60)
    assert failure.value.rank == 1
    assert failure.value.reason.startswith("stopped: its process has been stopped for 3 s")
    assert time.monotonic() - started < 30  # the op timeout (300 s) would be later still
    assert failure.value.run.ranks[0].status == "stopped"


def test_attribution_is_a_pure_function_of_failures_ranks_and_the_stop():
    """No processes, no run loop: the same rules, called directly."""
    from ddl_magic.driver.attribution import RankFacts, attribute

    ranks = [RankFacts(host, None, done=False) for host in HOSTS]
    verdict = attribute([failed(0, FailureKind.LOST_PEER, 0, lost_rank=3),
                         failed(3, FailureKind.VANISHED, 10, "connection lost"),
                         failed(1, FailureKind.VANISHED, 20, "connection lost")],
                        ranks, aborted_at_ns=5, describe_lost=SparkLauncher.describe_lost,
                        peer_timeout_s=10)
    assert (verdict.cause.rank, verdict.cause.host) == (3, "host-b")
    assert [f.rank for f in verdict.failures] == [3, 1, 0]
    assert verdict.stopped == [1]  # vanished after the stop, but its host was lost with rank 3
    assert verdict.failed[1].startswith("the Spark executor on host-b was lost, and ranks 1 and 3")


def test_a_run_whose_every_failure_came_after_the_stop_still_names_a_rank():
    from ddl_magic.driver.attribution import RankFacts, attribute

    ranks = [RankFacts("host-a", None, done=False), RankFacts("host-a", ABORTED_EXIT_CODE, done=False)]
    verdict = attribute([failed(0, FailureKind.VANISHED, 10, "connection lost"),
                         failed(1, FailureKind.VANISHED, 20, "connection lost")],
                        ranks, aborted_at_ns=5, describe_lost=SparkLauncher.describe_lost,
                        peer_timeout_s=10)
    assert verdict.cause.rank == 0 and verdict.stopped == [1]
    assert verdict.failed == {0: verdict.cause.reason}


def test_a_failure_that_comes_after_the_stop_is_kept_in_its_ranks_log(tmp_path):
    # A rank whose collective ended because a peer failed, heard only once the run was being
    # stopped: not shown, not blamed, but its log says how its code ended.
    run = RunResult("run", len(HOSTS), "test", ranks=new_records(len(HOSTS), str(tmp_path)))
    watcher = RunWatcher(run, ShownFailures(), None, events=queue.Queue(), server=None)
    for rank, host in enumerate(HOSTS):
        watcher.handle(RankStarted(rank, host, 100 + rank))
    watcher.handle(failed(0, FailureKind.RAISED, 0, "ValueError: boom"))
    watcher.drain()  # the run is being stopped
    watcher.handle(RankFailed(1, HOSTS[1], FailureKind.LOST_PEER,
                              "CollectiveAbortedError: rank 0 failed\n", "rank 0 failed", 1, 10))
    watcher.close(RunStatus.FAILED)
    assert run.ranks[1].status is RankStatus.STOPPED
    assert "CollectiveAbortedError: rank 0 failed" in run.log(1)
