"""Every message that crosses a connection between the driver and the ranks, and between
ranks as they negotiate: one frozen dataclass each, sent whole over an authenticated
`channel.Channel`; and those between the driver and its local rank factory, over the
factory's own pipes.

Who sends what:

    rank ──► driver      ClockProbe, Register, Output, TimelineEvents, TimelineStart,
                         Finished, Failed
    driver ──► rank      ClockReading, Start (with the run's RunSettings), Abort
    rank ──► driver      AskNextWorld   (an elastic run's reset, `driver/elastic.py`)
    driver ──► rank      NextWorld, RunCannotGoOn, HostsUpdated
    task ──► driver      TaskStarted, TaskAlive, TaskOutput, TaskExited
                         (what started the rank, e.g. a Spark task)
    rank ──► rank 0      Announcement  (negotiation over TCP when the cache cannot answer,
    rank 0 ──► ranks     Decision       up and down a binomial tree: `runtime/lockstep.py`)
    driver ──► factory   ForkRank      (the local rank factory, over its stdin and stdout:
    factory ──► driver   RankForked, RankWrote, RankState, RankExited   `rank/factory.py`)
    driver ──► pool rank FormRing, RunCell, CancelCell, Pull, Probe   (a pool, `rank/cells.py`:
    pool rank ──► driver CellEnded, Pulled, ProbeReply                 after Start, cell by cell)

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
    pool: bool = False  # no task: the rank serves a pool's cells until stopped (`rank/cells.py`)
    elastic: bool = False  # a lost rank resets the world instead of ending the run
    # A run with max_restarts: this group's restart (0: the first attempt) and the most there
    # may be; each rank's TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS.
    restart_count: int = 0
    max_restarts: int = 0


@dataclass(frozen=True, slots=True)
class Start:
    """Every rank registered: the peer table (rank, host, ring address), the task and the
    run's settings, and where torch.distributed's store listens."""

    peers: list[tuple[int, str, tuple[str, int]]]
    task: bytes
    settings: RunSettings
    torch_master: tuple[str, int] | None
    # An elastic run's replacement joins a world that was re-formed: its rank there (None: the
    # rank it registered as) and that world's generation (an elastic pool's: the epoch of the
    # fresh ring it forms with the survivors).
    rank: int | None = None
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop now (driver to ranks; rank 0 to the others when negotiation fails)."""

    reason: str


@dataclass(frozen=True, slots=True)
class AskNextWorld:
    """An elastic rank left its world (`generation`, where it was `rank`) and waits for the
    next one: `reason` a `ResetReason` value, `error` what ended it, `commits` how many
    commits its state has made."""

    generation: int
    rank: int
    reason: str
    error: str
    commits: int


@dataclass(frozen=True, slots=True)
class NextWorld:
    """The world the driver formed after a reset: this rank's number in it (None: it is
    left out) and the peer table."""

    generation: int
    rank: int | None
    peers: list[tuple[int, str, tuple[str, int]]]
    formed_at: float  # the driver's time.time(): notices stamped earlier are in this world


@dataclass(frozen=True, slots=True)
class HostsUpdated:
    """An elastic run's ranks changed without a failure (a replacement that waited for a
    free Spark slot is ready to join): the world re-forms at the ranks' next `commit()` or
    `check_host_updates()`, nothing rolled back. `timestamp` grows with each notice."""

    timestamp: float
    added: bool
    removed: bool


@dataclass(frozen=True, slots=True)
class RunCannotGoOn:
    """The driver cannot form a next world (too few ranks, too many resets): why."""

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


# ---- a pool: ranks that live between cells (`driver/pool.py`, `rank/cells.py`) --------------
# Every cell has an epoch (1, 2, ...; forming the ring is an epoch of its own): what a rank
# says about a cell names its epoch, so nothing late from one cell is taken for the next.


# A pool rank writes this line to stdout and to stderr once a cell's output is all written,
# followed by the cell's epoch: the driver knows it has every line of the cell when both came,
# whichever way its output travels (the rank factory's pipes, a Spark task's relay).
CELL_END_MARK = "\x1b[ddl_magic cell end]"


@dataclass(frozen=True, slots=True)
class FormRing:
    """Close whatever ring this rank has and form a fresh one with every rank (the pool's
    start, and after a cell that left the ring unusable). `peers`: the new peer table, when
    an elastic pool replaced lost ranks (None: the same peers)."""

    epoch: int
    peers: list[tuple[int, str, tuple[str, int]]] | None = None


@dataclass(frozen=True, slots=True)
class RunCell:
    """Run a cell's task in the rank's own namespace. `only_ranks`: the cell runs on these
    ranks alone, so collectives are refused in it (the others would never join)."""

    epoch: int
    task: bytes
    return_all: bool
    only_ranks: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class CancelCell:
    """Stop the cell of `epoch` (another rank failed, the user interrupted, it timed out):
    its collectives end with an error saying `reason`, its code gets KeyboardInterrupt."""

    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class CellEnded:
    """The cell of `epoch` ended on this rank: `outcome` is a Finished or a Failed (a Failed
    with `ABORTED_EXIT_CODE`: it was stopped). `ring_ok`: its ring can run the next cell's
    collectives (formed, nothing failed, nothing left in flight). `names`: the names cells
    have assigned in this rank's namespace, which notebook names never overwrite."""

    epoch: int
    outcome: object  # Finished | Failed
    ring_ok: bool
    names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Pull:
    """Send back the value of `name` in the rank's namespace."""

    id: int
    name: str


@dataclass(frozen=True, slots=True)
class Pulled:
    """`value` cloudpickled, or `error` saying why not: the rank has no such name
    (`missing`), or its value cannot be pickled."""

    id: int
    value: bytes | None
    error: str = ""
    missing: bool = False


@dataclass(frozen=True, slots=True)
class Probe:
    """How is the rank? Answered by its control thread, also while a cell runs."""

    id: int


@dataclass(frozen=True, slots=True)
class ProbeReply:
    id: int
    rss_bytes: int
    uptime_s: float


# ---- negotiation over TCP, when the response cache cannot answer (`runtime/lockstep.py`) ------


@dataclass(frozen=True, slots=True)
class Announcement:
    """One rank's pending requests that its cache could not settle this cycle (cache ids for
    known ones), and how long each has waited on that rank, in seconds."""

    rank: int
    requests: list
    waited_s: list


@dataclass(frozen=True, slots=True)
class Decision:
    """Rank 0's answer to a cycle's announcements: what every rank runs next, in this order
    (with new cache ids), or why a collective that some ranks never submitted timed out."""

    cycle: object  # negotiation.Cycle
    timed_out: str | None = None


# ---- the local rank factory (a pipe only the driver holds, `rank/factory.py`) ------------------


@dataclass(frozen=True, slots=True)
class ForkRank:
    """Fork a rank and run it as if freshly started, with the parent's environment, working
    directory and ``sys.path``; `id` pairs the request with its `RankForked`.

    `fds`: descriptors the parent hands the rank (a Spark task's share files), sent beside
    the request and open in the rank under these same numbers. `parent_forwards_output`:
    the parent relays all the rank writes; else the rank sends its own output to the driver
    once registered and its parent sees only what came before."""

    rank: int
    control: tuple[str, int]  # the driver's control server
    secret: bytes
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    id: int = 0
    fds: tuple[int, ...] = ()
    parent_forwards_output: bool = True


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
class RankExited:
    """The rank `pid` ended, and everything it wrote was sent before this: sent as soon as it
    exits on its own with its output closed (the kernel then still takes its memory down),
    else when the factory reaps it."""

    pid: int
    returncode: int
    out_of_memory: str = ""  # why, with its peak memory, where the OOM killer killed it
