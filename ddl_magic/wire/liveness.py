"""Is a rank alive? Asked of whatever owns its process, never of the rank itself.

A thread inside the rank cannot tell "busy" from "stopped": a rank that spends a minute in
one native call holding Python's GIL (`torch.save` of a large checkpoint, a C extension, a
gloo destructor) starves every Python thread it has, a heartbeat thread included. So the
owner of the rank's process reports on it instead, from a process of its own:

- the local rank factory, the parent of every local rank, reads each rank's state from the
  kernel (`process_state`) and reports it to the driver over its pipe (`RankState`);
- a Spark task, the parent of its rank's process, does the same over its relay connection
  (`TaskAlive`), every `report_interval_s(...)`. Those reports also say that the task's host
  is still there: when they stop, the host (or the link to it) is gone.

`LivenessWatch` turns the reports into verdicts, with the clock passed in:

    running, sleeping, in a disk wait      alive, however long (busy is alive)
    stopped (SIGSTOP, a debugger)          failed once seen stopped for the peer timeout
    reports stop coming (Spark)            its host stopped answering, after the peer timeout
    gone, a zombie                         not judged here: the process's exit is reported

What this deliberately does not judge: a rank alive but stuck for ever in a native call.
That is the collective timeout's job (`DDL_MAGIC_TIMEOUT`) for the ranks waiting on it, and
the stall report names it first.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field


class ProcessState(enum.Enum):
    """What the kernel says a process is doing (the state letter of ``/proc/PID/stat``)."""

    RUNNING = "running"
    SLEEPING = "sleeping"  # also waiting in a native call: a lock, a socket, a futex
    DISK_WAIT = "disk wait"
    STOPPED = "stopped"  # SIGSTOP, SIGTSTP, or stopped by a debugger (traced)
    ZOMBIE = "zombie"  # ended, not yet reaped by its parent
    GONE = "gone"

    @property
    def alive(self) -> bool:
        return self in (ProcessState.RUNNING, ProcessState.SLEEPING, ProcessState.DISK_WAIT)


_STATE_LETTERS = {"R": ProcessState.RUNNING, "S": ProcessState.SLEEPING,
                  "D": ProcessState.DISK_WAIT, "I": ProcessState.SLEEPING,
                  "T": ProcessState.STOPPED, "t": ProcessState.STOPPED,
                  "Z": ProcessState.ZOMBIE, "X": ProcessState.GONE, "x": ProcessState.GONE}


def process_state(pid: int) -> ProcessState:
    """The state of process `pid`, read from the kernel without disturbing it.

    Where there is no ``/proc`` (not Linux) a process that exists counts as running: only its
    exit is seen there, not a stop.
    """
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return ProcessState.GONE
    except OSError:
        return ProcessState.RUNNING
    return _STATE_LETTERS.get(fields[0] if fields else "", ProcessState.RUNNING)


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat from its state on (field 3), the command skipped."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return fields_after_command(stat.read().decode(errors="replace"))


def fields_after_command(stat: str) -> list[str]:
    """'PID (COMMAND) STATE ...' -> ['STATE', ...]: the command may hold spaces and
    parentheses itself, so it ends at the last ')'."""
    return stat[stat.rfind(")") + 2:].split()


PF_EXITING = 0x4  # a flag of /proc/PID/stat: the process is in its exit


def exit_under_way(pid: int) -> int | None:
    """The exit code of process `pid` where it has called `exit` itself and the kernel is
    still taking it down (unmapping its memory: ~10 ms for a process forked from one with
    torch imported); None where it has not, was killed by a signal, or its state cannot
    be read (not Linux). The code is the kernel's: it set it before taking the memory down.
    (The kernel shows it only to a reader allowed to trace the process, else 0: a rank, a
    fork of ours with our credentials, is, unless it made itself non-dumpable.)"""
    try:
        return exit_code_in_stat(_stat_fields(pid))
    except OSError:
        return None


def exit_code_in_stat(fields: list[str]) -> int | None:
    """`exit_under_way`, from the fields of /proc/PID/stat (`fields_after_command`): its
    flags (field 9) and its exit code (field 52, as `waitpid` reports it).

    >>> fields = ["R"] + ["0"] * 49
    >>> fields[6], fields[49] = str(PF_EXITING), str(3 << 8)
    >>> exit_code_in_stat(fields)
    3
    >>> fields[49] = "9"  # killed by SIGKILL: its reaping says more (the OOM killer's doing?)
    >>> exit_code_in_stat(fields) is None
    True
    """
    if len(fields) < 50 or not int(fields[6]) & PF_EXITING:
        return None
    status = int(fields[49])
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None


def report_interval_s(peer_timeout_s: float) -> float:
    """How often an owner reports on its rank: eight times per peer timeout, so that a stop
    or a silence is judged within the timeout, not a report interval after it."""
    return peer_timeout_s / 8


class Verdict(enum.Enum):
    STOPPED = "stopped"  # the process has been stopped for the peer timeout
    OWNER_SILENT = "owner silent"  # no report from its owner for the peer timeout: host or link gone


@dataclass
class _Rank:
    state: ProcessState
    heard_at: float
    stopped_since: float | None = None
    reports_periodically: bool = False


@dataclass
class LivenessWatch:
    """The driver's judgement of every rank's liveness, from its owner's reports.

    >>> watch = LivenessWatch(peer_timeout_s=10.0)
    >>> watch.reported(0, ProcessState.STOPPED, now=100.0)
    >>> watch.verdicts(now=105.0)
    []
    >>> watch.verdicts(now=108.8)
    [(0, <Verdict.STOPPED: 'stopped'>)]
    """

    peer_timeout_s: float
    _ranks: dict[int, _Rank] = field(default_factory=dict)

    @property
    def _limit_s(self) -> float:
        # A stop or a silence began up to one report interval before the report that shows it.
        return self.peer_timeout_s - report_interval_s(self.peer_timeout_s)

    def reported(self, rank: int, state: ProcessState, now: float,
                 periodic: bool = False) -> None:
        """The owner of `rank`'s process says it is in `state`. `periodic`: this owner reports
        every `report_interval_s`, so its silence means something (a Spark task's host)."""
        seen = self._ranks.get(rank)
        if seen is None:
            seen = self._ranks[rank] = _Rank(state, now)
        seen.state, seen.heard_at = state, now
        seen.reports_periodically |= periodic
        if state is ProcessState.STOPPED:
            seen.stopped_since = seen.stopped_since if seen.stopped_since is not None else now
        else:
            seen.stopped_since = None

    def forget(self, rank: int) -> None:
        """The rank has ended (or finished): nothing more to judge."""
        self._ranks.pop(rank, None)

    def verdicts(self, now: float, stopped_too: bool = True,
                 hosts: list[str] | None = None) -> list[tuple[int, Verdict]]:
        """The ranks that are failed by now, each named once. `stopped_too=False`: only those
        whose owner fell silent (a pool between cells: a stopped rank that runs nothing harms
        nobody, and the next cell judges it).

        `hosts` (each rank's): a host's ranks fall silent together, their owners' last reports
        a moment apart. When one is judged silent, those of its host that have missed a
        report since go with it, instead of a report interval later, one by one.

        >>> watch = LivenessWatch(peer_timeout_s=8.0)
        >>> for rank, heard_at in ((0, 100.0), (1, 100.4), (2, 100.9)):
        ...     watch.reported(rank, ProcessState.RUNNING, now=heard_at, periodic=True)
        >>> watch.verdicts(now=107.1, hosts=["b", "b", "a"])
        [(0, <Verdict.OWNER_SILENT: 'owner silent'>), (1, <Verdict.OWNER_SILENT: 'owner silent'>)]
        """
        failed = []
        for rank, seen in self._ranks.items():
            if seen.reports_periodically and now - seen.heard_at >= self._limit_s:
                failed.append((rank, Verdict.OWNER_SILENT))
            elif (stopped_too and seen.stopped_since is not None
                  and now - seen.stopped_since >= self._limit_s):
                failed.append((rank, Verdict.STOPPED))
        silent_hosts = {hosts[rank] for rank, verdict in failed  # ("": not known yet)
                        if hosts is not None and verdict is Verdict.OWNER_SILENT and hosts[rank]}
        missed_a_report_s = 1.5 * report_interval_s(self.peer_timeout_s)
        judged = {rank for rank, _ in failed}
        for rank, seen in self._ranks.items():
            if (silent_hosts and hosts[rank] in silent_hosts and seen.reports_periodically
                    and rank not in judged and now - seen.heard_at >= missed_a_report_s):
                failed.append((rank, Verdict.OWNER_SILENT))
        for rank, _ in failed:
            del self._ranks[rank]
        return failed
