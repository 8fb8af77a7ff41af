"""Liveness judged from the owner of a rank's process: the kernel's word on a real process,
and the verdicts drawn from reports, with the clock passed in."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ddl_magic.wire.liveness import (PF_EXITING, LivenessWatch, ProcessState, Verdict,
                                    exit_code_in_stat, exit_under_way,
                                    fields_after_command, process_state)

TIMEOUT_S = 10.0
LIMIT_S = TIMEOUT_S - TIMEOUT_S / 8  # a stop began up to one report interval before it was seen


def test_a_rank_stopped_for_the_peer_timeout_is_judged_stopped_once():
    watch = LivenessWatch(TIMEOUT_S)
    watch.reported(0, ProcessState.STOPPED, now=100.0)
    assert watch.verdicts(now=100.0 + LIMIT_S - 0.01) == []
    assert watch.verdicts(now=100.0 + LIMIT_S) == [(0, Verdict.STOPPED)]
    assert watch.verdicts(now=200.0) == []  # named once


def test_a_busy_or_sleeping_rank_is_alive_however_long_it_is_silent():
    watch = LivenessWatch(TIMEOUT_S)
    watch.reported(0, ProcessState.RUNNING, now=0.0)  # e.g. a native call holding the GIL
    watch.reported(1, ProcessState.SLEEPING, now=0.0)
    watch.reported(2, ProcessState.DISK_WAIT, now=0.0)
    assert watch.verdicts(now=3600.0) == []


def test_a_rank_resumed_before_the_timeout_is_not_judged_and_a_later_stop_counts_afresh():
    watch = LivenessWatch(TIMEOUT_S)
    watch.reported(0, ProcessState.STOPPED, now=0.0)
    watch.reported(0, ProcessState.SLEEPING, now=5.0)
    watch.reported(0, ProcessState.STOPPED, now=6.0)
    assert watch.verdicts(now=6.0 + LIMIT_S - 0.01) == []
    assert watch.verdicts(now=6.0 + LIMIT_S) == [(0, Verdict.STOPPED)]


def test_silence_means_a_lost_host_only_from_an_owner_that_reports_periodically():
    watch = LivenessWatch(TIMEOUT_S)
    watch.reported(0, ProcessState.SLEEPING, now=0.0)  # the local factory: reports changes only
    watch.reported(1, ProcessState.SLEEPING, now=0.0, periodic=True)  # a Spark task
    watch.reported(1, ProcessState.SLEEPING, now=4.0, periodic=True)
    assert watch.verdicts(now=4.0 + LIMIT_S - 0.01) == []
    assert watch.verdicts(now=4.0 + LIMIT_S) == [(1, Verdict.OWNER_SILENT)]


def test_between_a_pools_cells_only_silence_is_judged_and_a_stop_waits_for_the_next_cell():
    watch = LivenessWatch(TIMEOUT_S)
    watch.reported(0, ProcessState.STOPPED, now=0.0, periodic=True)
    watch.reported(1, ProcessState.SLEEPING, now=0.0, periodic=True)
    watch.reported(0, ProcessState.STOPPED, now=LIMIT_S, periodic=True)
    assert watch.verdicts(now=LIMIT_S, stopped_too=False) == [(1, Verdict.OWNER_SILENT)]
    assert watch.verdicts(now=LIMIT_S) == [(0, Verdict.STOPPED)]  # still there to judge


def test_a_hosts_ranks_fall_silent_together_and_are_judged_together():
    """Their tasks' last reports came a moment apart: both go at the first verdict (a pool
    then says "ranks 1 and 3 (host-b) were lost"), and a rank elsewhere, or one of the host
    heard since, stays."""
    interval = TIMEOUT_S / 8
    watch = LivenessWatch(TIMEOUT_S)
    hosts = ["a", "b", "a", "b", "b"]
    for rank, heard_at in ((0, 100.0), (1, 100.0), (2, 100.0), (3, 100.0 + interval * 0.5)):
        watch.reported(rank, ProcessState.RUNNING, now=heard_at, periodic=True)
    now = 100.0 + LIMIT_S
    watch.reported(0, ProcessState.RUNNING, now=now, periodic=True)  # host a still answers
    watch.reported(2, ProcessState.RUNNING, now=now, periodic=True)
    watch.reported(4, ProcessState.RUNNING, now=now - interval, periodic=True)  # just heard
    assert watch.verdicts(now=now, hosts=hosts) == [(1, Verdict.OWNER_SILENT),
                                                    (3, Verdict.OWNER_SILENT)]
    assert watch.verdicts(now=now + interval, hosts=hosts) == []


def test_a_finished_rank_is_judged_no_more():
    watch = LivenessWatch(TIMEOUT_S)
    watch.reported(0, ProcessState.STOPPED, now=0.0, periodic=True)
    watch.forget(0)
    assert watch.verdicts(now=100.0) == []


def wait_for_state(pid: int, expected: ProcessState, timeout_s: float = 10.0) -> ProcessState:
    deadline = time.monotonic() + timeout_s
    while (state := process_state(pid)) is not expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_kernel_tells_sleeping_stopped_resumed_zombie_and_gone(child):
    assert wait_for_state(child.pid, ProcessState.SLEEPING) is ProcessState.SLEEPING
    os.kill(child.pid, signal.SIGSTOP)
    assert wait_for_state(child.pid, ProcessState.STOPPED) is ProcessState.STOPPED
    os.kill(child.pid, signal.SIGCONT)
    assert wait_for_state(child.pid, ProcessState.SLEEPING) is ProcessState.SLEEPING
    os.kill(child.pid, signal.SIGKILL)
    assert wait_for_state(child.pid, ProcessState.ZOMBIE) is ProcessState.ZOMBIE  # not reaped yet
    child.wait(timeout=10)
    assert process_state(child.pid) is ProcessState.GONE


def test_a_process_name_with_spaces_and_parentheses_is_read_past():
    # PR_SET_NAME (15): the name /proc/PID/stat shows between parentheses, before the state
    rename = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) S (y', 0, 0, 0); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", rename])
    try:
        deadline = time.monotonic() + 10
        while b"x) S (y" not in open(f"/proc/{process.pid}/stat", "rb").read():
            assert time.monotonic() < deadline, "the process never renamed itself"
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGSTOP)
        assert wait_for_state(process.pid, ProcessState.STOPPED) is ProcessState.STOPPED
    finally:
        process.kill()
        process.wait(timeout=10)


def stat_fields(command: str, flags: int, status: int) -> list[str]:
    fields = ["R"] + ["0"] * 49
    fields[6], fields[49] = str(flags), str(status)
    return fields_after_command(f"42 ({command}) " + " ".join(fields))


def test_an_exit_under_way_is_read_with_its_code_and_a_signal_death_is_left_to_the_reaping():
    assert exit_code_in_stat(stat_fields("python (rank) 1", PF_EXITING, 3 << 8)) == 3
    assert exit_code_in_stat(stat_fields("python", PF_EXITING, 0)) == 0
    assert exit_code_in_stat(stat_fields("python", PF_EXITING, signal.SIGKILL)) is None
    assert exit_code_in_stat(stat_fields("python", 0, 0)) is None  # not exiting: running
    assert exit_code_in_stat(fields_after_command("42 (python) R 1 2")) is None  # kernel < 3.5
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exit_under_way(child.pid) is None  # alive
    finally:
        child.kill()
        child.wait(timeout=10)
    assert exit_under_way(child.pid) is None  # gone
