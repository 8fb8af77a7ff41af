"""Hosts that ranks were placed on are probed once per run: a host that gives no answer
within the peer timeout fails the ranks placed there, unless something came from them."""

import queue
import socket

import pytest

from ddl_magic.driver.events import HostUnanswered, RanksPlaced, RankStarted
from ddl_magic.driver.host_probe import HostProbes, answers
from ddl_magic.driver.failure_policies import FailFast
from ddl_magic.driver.watcher import RunWatcher
from ddl_magic.driver.run_result import RankFailedError, RunResult
from ddl_magic.driver.records import RankStatus, new_records
from test_attribution import ShownFailures

PROBE_TIMEOUT_S = 0.5


@pytest.fixture
def silent_port():
    """A real port that answers no connection: its listener's backlog is full, so the kernel
    drops every new SYN, as it would never reach a host whose link is down."""
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(0)
    queued = socket.create_connection(listener.getsockname(), timeout=5)
    with listener, queued:
        yield listener.getsockname()


def test_a_host_answers_with_a_connection_or_a_refusal_and_not_when_silent(silent_port):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        address = listening.getsockname()
        assert answers(*address, PROBE_TIMEOUT_S) is True
    assert answers(*address, PROBE_TIMEOUT_S) is True  # nothing listens there now: refused
    assert answers(*silent_port, PROBE_TIMEOUT_S) is False


def test_only_the_silent_host_is_reported_with_the_ranks_placed_on_it(silent_port):
    events = queue.Queue()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(4)
        up = "127.0.0.1:%d" % listening.getsockname()[1]
        down = "127.0.0.2:%d" % silent_port[1]
        probes = HostProbes(events, timeout_s=PROBE_TIMEOUT_S)
        probes.start([up, down, up, down])
        probes.start([down] * 4)  # once per run: a second placement is not probed again
        unanswered = events.get(timeout=30)
    assert (unanswered.host, unanswered.ranks) == ("127.0.0.2", [1, 3])
    assert events.empty()


def watch_four_ranks(tmp_path):
    run = RunResult("run", 4, "test", ranks=new_records(4, str(tmp_path)))
    watcher = RunWatcher(run, ShownFailures(), None, events=None, server=None)
    for rank in (0, 2):
        watcher.handle(RankStarted(rank, "host-a", 100 + rank))
    return watcher, run


def test_ranks_on_a_host_that_never_answered_fail_naming_it(tmp_path):
    watcher, run = watch_four_ranks(tmp_path)
    watcher.handle(RanksPlaced(0, ["10.0.0.2:1", "10.0.0.3:1", "10.0.0.2:1", "10.0.0.3:1"]))
    watcher.handle(HostUnanswered("10.0.0.3", [1, 3], at_ns=10))
    failure = FailFast(watcher).failure()
    assert isinstance(failure, RankFailedError)
    assert (failure.rank, failure.host) == (1, "10.0.0.3")
    assert "its host 10.0.0.3 stopped answering" in failure.reason
    assert "with ranks 1 and 3" in failure.reason
    assert [r.status for r in run.ranks] == ["running", "failed", "running", "failed"]


@pytest.mark.parametrize("spoke", [RanksPlaced(3, ["10.0.0.3:1"] * 4), RankStarted(1, "b", 7)])
def test_a_silent_host_whose_ranks_spoke_is_only_slow(tmp_path, spoke):
    watcher, run = watch_four_ranks(tmp_path)
    watcher.handle(spoke)
    watcher.handle(HostUnanswered("10.0.0.3", [1, 3], at_ns=10))
    assert watcher.failures == [] and run.ranks[3].status is RankStatus.STARTING
