"""Every message that crosses a connection between the driver and the ranks, and between
ranks as they negotiate: one frozen dataclass each, sent whole over an authenticated
`protocol.Channel`; and those between the driver and its local rank factory, over the
factory's own pipes.

Who sends what:

    rank ──► driver      ClockProbe, Register, Output, TimelineEvents, TimelineStart,
                         Finished, Failed
    driver ──► rank      ClockReading, Start (with the run's RunSettings), Abort
    task ──► driver      TaskStarted, TaskAlive, TaskOutput, TaskExited
                         (what started the rank, e.g. a Spark task)
    rank ──► rank 0      Submit, Bye   (negotiation over TCP, `op_queue_tcp.py`)
    rank 0 ──► ranks     CycleToRun, Abort, CollectiveTimedOut
    driver ──► factory   ForkRank      (the local rank factory, over its stdin and stdout:
    factory ──► driver   RankForked, RankWrote, RankState, RankReaped   `launch/rank_factory.py`)

A receiver matches on the class (`match message: case Output(stream, lines): ...`); anything
else is a malformed message, which ends that connection without disturbing the run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


# ---- driver and ranks --------------------------------------------------------------------------


class FailureKind(enum.Enum):
    """How a rank failed. The driver picks the failure that caused the others by kind and
    time, never by the words shown to the user (`RankFailed.reason`)."""

    DIED = "died"  # its process ended on its own: a signal, an exit code, os._exit
    FAILED_TO_START = "failed to start"  # it ended, or could not start, before it connected
    TASK_FAILED = "task failed"  # Spark reported its task (or the job) failing
    VANISHED = "vanished"  # its connection closed with no report, and no exit status came
    UNREACHABLE = "unreachable"  # its connection timed out: its host stopped answering
    STOPPED = "stopped"  # its process has been stopped (SIGSTOP, a debugger) for the peer timeout
    RAISED = "raised"  # its code raised (or exited with a non-zero status)
    LOST_PEER = "lost a peer"  # it raised because another rank or host was lost: a consequence


@dataclass(frozen=True, slots=True)
class ClockProbe:
    """A rank asks for the driver's monotonic clock, to put its timeline on the driver's."""


@dataclass(frozen=True, slots=True)
class ClockReading:
    driver_ns: int


@dataclass(frozen=True, slots=True)
class Register:
    """A rank says who and where it is: its host, its ring listener, and (rank 0) the port it
    keeps for torch.distributed's store."""

    rank: int
    host: str
    ring_address: tuple[str, int]
    pid: int
    torch_master: tuple[str, int] | None


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What every rank of a run is told with its task, written by the driver (`driver/job.py`)
    and read by the rank (`rank/worker.py`)."""

    run_id: str  # the run's name; torch.distributed's too (TORCHELASTIC_RUN_ID)
    env: dict[str, str]  # set in the rank's environment before its task runs
    timeline: bool  # the rank records its timeline from the start and ships it to the driver
    return_all: bool  # every rank sends back its task's return value, not only rank 0


@dataclass(frozen=True, slots=True)
class Start:
    """Every rank registered: the peer table (rank, host, ring address), the task and the
    run's settings, and where torch.distributed's store listens."""

    peers: list[tuple[int, str, tuple[str, int]]]
    task: bytes
    settings: RunSettings
    torch_master: tuple[str, int] | None


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop now (driver to ranks; rank 0 to the others when negotiation fails)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Output:
    """Lines a rank wrote: (text, replace) pairs, `replace` for a line ended by a carriage return."""

    stream: str  # "stdout" or "stderr"
    lines: list[tuple[str, bool]]


@dataclass(frozen=True, slots=True)
class TimelineEvents:
    events: list


@dataclass(frozen=True, slots=True)
class TimelineStart:
    """The rank called hvd.start_timeline(path)."""

    path: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The task returned; `result` is its cloudpickled value (None where not asked for)."""

    result: bytes | None


@dataclass(frozen=True, slots=True)
class Failed:
    """The task failed on this rank: `kind` for attribution, the rest for the user."""

    kind: FailureKind
    traceback: str
    reason: str
    exit_code: int
    at_ns: int  # on the driver's clock
    lost_rank: int | None = None  # FailureKind.LOST_PEER: the rank it lost


@dataclass(frozen=True, slots=True)
class TaskStarted:
    """A task is starting its rank's process. `executors` is where the stage placed every
    rank: the address (``host:port``) of the executor that runs it, in rank order."""

    rank: int
    executors: list[str]


@dataclass(frozen=True, slots=True)
class TaskAlive:
    """The task is there, and the kernel says its rank's process is in `state` (a
    `liveness.ProcessState` value): sent every `liveness.report_interval_s`."""

    rank: int
    state: str


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """Lines a rank's process wrote, relayed by the task that started it."""

    rank: int
    stream: str
    lines: list[tuple[str, bool]]


@dataclass(frozen=True, slots=True)
class TaskExited:
    """A rank's process ended (`returncode` None: it could not start, `output` says why)."""

    rank: int
    host: str
    returncode: int | None
    output: str


# ---- negotiation (rank 0 coordinates the others over TCP) --------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Requests submitted since the last message (cache ids for known ones), and the names
    some thread of this rank now waits for."""

    requests: list
    waited: list


@dataclass(frozen=True, slots=True)
class Bye:
    """This rank has shut down."""


@dataclass(frozen=True, slots=True)
class CycleToRun:
    """What every rank runs next, in this order."""

    cycle: object  # negotiation.Cycle


@dataclass(frozen=True, slots=True)
class CollectiveTimedOut:
    """A collective waited past `DDL_MAGIC_TIMEOUT` for ranks that never submitted it."""

    reason: str


# ---- the local rank factory (a pipe only the driver holds, `launch/rank_factory.py`) ----------


@dataclass(frozen=True, slots=True)
class ForkRank:
    """Fork a rank and run it as if freshly started, with the kernel's environment, working
    directory and ``sys.path``; `id` pairs the request with its `RankForked`."""

    rank: int
    control: tuple[str, int]  # the driver's control server
    secret: bytes
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    id: int = 0


@dataclass(frozen=True, slots=True)
class RankForked:
    id: int
    pid: int


@dataclass(frozen=True, slots=True)
class RankWrote:
    """Lines the rank `pid` wrote, read by the factory from the rank's own pipe."""

    pid: int
    stream: str
    lines: list[tuple[str, bool]]


@dataclass(frozen=True, slots=True)
class RankState:
    """The kernel says the rank `pid` is now in `state` (a `liveness.ProcessState` value);
    sent when it changes."""

    pid: int
    state: str


@dataclass(frozen=True, slots=True)
class RankReaped:
    """The rank `pid` ended, and everything it wrote was sent before this."""

    pid: int
    returncode: int
