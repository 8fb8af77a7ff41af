"""The driver's control server: rendezvous, then the channel every rank reports through.

Each rank connects, proves the run's secret, answers a few clock probes and registers its
host and ring listener (rank 0 also a port it keeps for torch.distributed's store). Once all
`np` ranks have registered, every rank receives the peer table, the task and that port. From
then on the server turns what ranks send into `ddl_magic.driver.events` on one queue, which the
driver's main thread drains. A connection that fails the handshake is dropped without
disturbing the run.

Whatever starts a rank on another machine (a Spark task) may also connect, with the purpose
``"task"`` (`rank/spark_task.TaskRelay`): it forwards what the rank's process writes, line by line, says
every `liveness.report_interval_s` what state the process is in, and then says that the
process ended, after all of its output. The driver so hears a rank's last words even when it
was killed, at once of a rank that died before it could register, and of a host that
stopped answering when those reports stop.

One thread serves every connection. A barrier stage of 512 tasks is 1024 connections (each
rank's and its task's); a thread for each would be 1024 threads in the notebook's kernel, so
the server reads them all from one `selectors` loop instead, each connection a small state
machine: the handshake (`ServerHandshake`, its frames capped until the peer proved the
secret), then registration (clock probes, `Register`), then relaying. What the server costs
per rank is counted (`ControlCounters`): a rank's rendezvous is O(1) messages (Register in,
Start out, plus the handshake and its clock probes), the run's O(N).

Why every wait ends: a connection that has not proved the secret, or has not registered,
`HANDSHAKE_TIMEOUT_S` after it connected is dropped; the loop sleeps no longer than until
the next such deadline. Sends go out on the calling thread with the socket's own blocking
`sendall`, and the kernel keeps every peer's connection alive or fails it within the peer
timeout (`channel.tune_socket`).
"""

from __future__ import annotations

import enum
import errno
import pickle
import queue
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from .events import (FailureKind, ProcessExited, RankFailed, RankFinished, RankOutput,
                     RankProcessState, RanksPlaced, RankStarted, ResetAsked, TimelineBatch,
                     TimelineStarted)
from ..wire.liveness import ProcessState
from ..wire.messages import (Abort, AskNextWorld, ClockProbe, ClockReading, Failed, Finished,
                             Output, Register, RunSettings, Start, TaskAlive, TaskExited,
                             TaskOutput, TaskStarted, TimelineEvents, TimelineStart)
from ..wire.channel import (HANDSHAKE_FRAME_LIMIT, HANDSHAKE_TIMEOUT_S, AuthenticationError, Channel,
                            FrameBuffer, ServerHandshake, tune_socket)

_PROCESS_STATES = {state.value for state in ProcessState}
_READ_BYTES = 1 << 16


class _Stage(enum.Enum):
    """Where a connection is: proving the secret, registering (a rank), relaying."""

    HANDSHAKE = "handshake"
    REGISTERING = "registering"
    RANK = "rank"
    TASK = "task"


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    handshake: ServerHandshake
    deadline: float  # to prove the secret and (a rank) register: dropped after
    frames: FrameBuffer = field(default_factory=lambda: FrameBuffer(HANDSHAKE_FRAME_LIMIT))
    stage: _Stage = _Stage.HANDSHAKE
    channel: Channel | None = None
    rank: int | None = None  # the rank it registered as, or the rank a task speaks for


class _EndConnection(Exception):
    """This connection is done (a task said its process ended, a stranger, a malformed message)."""


@dataclass
class ControlCounters:
    """What the control server did: per connection, per message kind, per second of reports.

    `messages_received` counts every frame in after the handshake; `rendezvous_messages`
    only Register in and Start out, the rendezvous itself; `handshake_frames` and the clock
    probes come on top, a fixed number per connection.
    """

    connections: int = 0
    refused: int = 0  # handshakes failed, registrations refused, malformed messages
    open_connections: int = 0
    peak_open_connections: int = 0
    handshake_frames: int = 0
    clock_probes: int = 0
    rendezvous_messages: int = 0
    messages_received: int = 0
    messages_sent: int = 0
    liveness_reports: int = 0
    first_report_at: float | None = None
    last_report_at: float | None = None
    threads: int = 1  # one loop serves every connection

    def summary(self) -> dict:
        span = (self.last_report_at or 0.0) - (self.first_report_at or 0.0)
        counts = {name: value for name, value in vars(self).items()
                  if name not in ("first_report_at", "last_report_at")}
        return counts | {"liveness_reports_per_s": self.liveness_reports / span if span > 0 else 0.0}


class ControlServer:
    """Listens for the ranks of one run and relays their messages as events.

    `bind_host` is where to listen (loopback for local ranks, where Spark's driver binds for
    Spark) and `advertised_host` the address ranks connect to.
    """

    def __init__(self, secret: bytes, np: int, task: bytes, settings: RunSettings,
                 events: queue.Queue, bind_host: str = "127.0.0.1",
                 advertised_host: str = "127.0.0.1"):
        self.np = np
        self.events = events
        self.counters = ControlCounters()
        self._secret = secret
        self._task = task
        self._settings = settings
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        # The task that speaks for each rank: an elastic run's replacement's task takes over
        # from the lost rank's, which may still report (late) over its own channel.
        self._task_of: dict[int, Channel] = {}
        self._registrations: dict[int, tuple] = {}
        self._torch_master: tuple[str, int] | None = None  # rank 0's port for torch's store
        self._finished: set[int] = set()
        self._started = False  # every rank of the launch registered and was sent its Start
        self._closed = False
        self._connections: dict[socket.socket, _Connection] = {}
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(max(16, 2 * np))
        self._listener.setblocking(False)
        self.address = (advertised_host, self._listener.getsockname()[1])
        self._wake_receiver, self._wake_sender = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_receiver, selectors.EVENT_READ)
        self._loop = threading.Thread(target=self._serve, name="ddl-control", daemon=True)
        self._loop.start()

    @property
    def registered(self) -> set[int]:
        with self._lock:
            return set(self._registrations)

    def abort(self, reason: str) -> None:
        """Tell every connected rank to stop now."""
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            try:
                channel.send(Abort(reason))
            except OSError:
                pass  # already gone

    def close(self) -> None:
        with self._lock:
            self._closed = True
        try:
            self._wake_sender.send(b"\0")
        except OSError:
            pass
        self._loop.join(timeout=5)

    # ---- the loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._closed:
                deadlines = [c.deadline for c in self._connections.values()
                             if c.stage in (_Stage.HANDSHAKE, _Stage.REGISTERING)]
                timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_receiver:
                        self._wake_receiver.recv(4096)
                    else:
                        self._readable(self._connections[key.fileobj])
                now = time.monotonic()
                for connection in list(self._connections.values()):
                    if (connection.stage in (_Stage.HANDSHAKE, _Stage.REGISTERING)
                            and now >= connection.deadline):
                        self.counters.refused += 1
                        self._drop(connection)  # silent, or slow to register: refused
        finally:
            for connection in list(self._connections.values()):
                self._drop(connection, ended=False)
            self._selector.close()
            self._listener.close()
            self._wake_receiver.close()
            self._wake_sender.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors, say: the next readiness retries
            sock.setblocking(True)
            tune_socket(sock)
            connection = _Connection(sock, ServerHandshake(self._secret, {"control", "task"}),
                                     time.monotonic() + HANDSHAKE_TIMEOUT_S)
            try:
                sock.sendall(connection.handshake.hello())
            except OSError:
                sock.close()
                continue
            self.counters.connections += 1
            self.counters.handshake_frames += 1
            self.counters.open_connections += 1
            self.counters.peak_open_connections = max(self.counters.peak_open_connections,
                                                      self.counters.open_connections)
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ)

    def _readable(self, connection: _Connection) -> None:
        timed_out = False
        try:
            data = connection.sock.recv(_READ_BYTES)
            if not data:
                raise _EndConnection("closed by the peer")
            for payload in connection.frames.feed(data):
                self._handle(connection, payload)
            return
        except _EndConnection:
            pass
        except AuthenticationError:
            self.counters.refused += 1  # a stranger: refused, and the run goes on
        except OSError as exc:
            # ETIMEDOUT: keepalive or TCP_USER_TIMEOUT gave up on a host that stopped answering
            timed_out = isinstance(exc, TimeoutError) or exc.errno == errno.ETIMEDOUT
        except Exception:  # a malformed message (it passed the handshake): the connection ends
            self.counters.refused += 1
        self._drop(connection, timed_out=timed_out)

    def _drop(self, connection: _Connection, timed_out: bool = False, ended: bool = True) -> None:
        if self._connections.pop(connection.sock, None) is None:
            return
        self.counters.open_connections -= 1
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        if connection.channel is not None:
            connection.channel.close()
        else:
            connection.sock.close()
        if ended and connection.stage is _Stage.RANK:
            self._connection_ended(connection.rank, timed_out, connection.channel)

    # ---- one connection's messages ---------------------------------------------------------

    def _handle(self, connection: _Connection, payload: bytes) -> None:
        if connection.stage is _Stage.HANDSHAKE:
            purpose, proof = connection.handshake.answer(payload)
            self.counters.handshake_frames += 2
            connection.sock.sendall(proof)
            connection.channel = Channel(connection.sock)
            connection.frames.limit = None
            connection.deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S  # to register
            connection.stage = _Stage.REGISTERING if purpose == "control" else _Stage.TASK
            if connection.stage is _Stage.TASK:
                with self._lock:
                    if self._closed:
                        raise _EndConnection("closed")
            return
        message = pickle.loads(payload)
        self.counters.messages_received += 1
        if connection.stage is _Stage.REGISTERING:
            self._register(connection, message)
        elif connection.stage is _Stage.RANK:
            self._relay(connection.rank, message)
        else:
            self._relay_task(connection, message)

    def _reply(self, channel: Channel, message: object) -> None:
        self.counters.messages_sent += 1
        channel.send(message)

    def _register(self, connection: _Connection, message: object) -> None:
        channel = connection.channel
        if isinstance(message, ClockProbe):
            self.counters.clock_probes += 1
            self._reply(channel, ClockReading(time.monotonic_ns()))
            return
        if not isinstance(message, Register):
            raise ValueError(f"expected Register, got {type(message).__name__}")
        self.counters.rendezvous_messages += 1
        rank, host, ring_address, pid, torch_master = (message.rank, message.host,
                                                       message.ring_address, message.pid,
                                                       message.torch_master)
        with self._lock:
            if self._closed or not 0 <= rank < self.np or rank in self._registrations:
                self._reply(channel, Abort(f"rank {rank} is not expected in this run"))
                raise _EndConnection("refused")
            self._channels[rank] = channel
            # Interned, so that the peer table pickles each host's name once.
            self._registrations[rank] = (rank, _interned(host), tuple(ring_address))
            if rank == 0:
                self._torch_master = tuple(torch_master)
            everyone_here = len(self._registrations) == self.np and not self._started
            self._started = self._started or everyone_here
        connection.stage, connection.rank = _Stage.RANK, rank
        self.events.put(RankStarted(rank, host, pid))
        if everyone_here:
            self._start_all()

    def _start_all(self) -> None:
        with self._lock:
            peers = [self._registrations[rank] for rank in range(self.np)]
            channels = dict(self._channels)
        start = pickle.dumps(Start(peers, self._task, self._settings, self._torch_master),
                             protocol=pickle.HIGHEST_PROTOCOL)  # once, for every rank
        for channel in channels.values():
            self.counters.rendezvous_messages += 1
            self.counters.messages_sent += 1
            try:
                channel.send_pickled(start)
            except OSError:
                pass  # its connection's end says what became of it

    def expect_again(self, rank: int) -> None:
        """An elastic run starts a new process as `rank` (the run's slot of a lost one): it
        may register, and its end is reported as any rank's."""
        with self._lock:
            self._registrations.pop(rank, None)
            self._channels.pop(rank, None)  # the lost process's: its end is old news now
            self._finished.discard(rank)

    def registration(self, rank: int) -> tuple[str, tuple[str, int]] | None:
        """(host, ring listener) of the process registered as `rank`, if one is."""
        with self._lock:
            registered = self._registrations.get(rank)
        return None if registered is None else (registered[1], registered[2])

    def start_joined(self, rank: int, peers: list[tuple[int, str, tuple[str, int]]],
                     world_rank: int, generation: int) -> bool:
        """Send an elastic run's replacement its Start: it joins world `generation` as its
        rank `world_rank`. False if it is not connected."""
        return self.send(rank, Start(peers, self._task, self._settings, self._torch_master,
                                     world_rank, generation))

    def _relay(self, rank: int, message: object) -> None:
        host = self._registrations[rank][1]
        match message:
            case Output(stream, lines):
                for text, replace in lines:
                    self.events.put(RankOutput(rank, stream, text, replace))
            case TimelineEvents(events):
                self.events.put(TimelineBatch(rank, events))
            case TimelineStart(path):
                self.events.put(TimelineStarted(rank, path))
            case Finished(result):
                self._finished.add(rank)
                self.events.put(RankFinished(rank, result))
            case AskNextWorld(generation, world_rank, reason, error, commits):
                self.events.put(ResetAsked(rank, generation, world_rank, reason, error, commits))
            case Failed(kind, text, reason, exit_code, at_ns, lost_rank):
                self._finished.add(rank)
                self.events.put(RankFailed(rank, host, FailureKind(kind), text, reason,
                                           exit_code, at_ns, lost_rank))
            case other if not self._relay_other(rank, other):
                raise ValueError(f"unexpected message from rank {rank}: {type(other).__name__}")

    def _relay_other(self, rank: int, message: object) -> bool:
        """Relay a message that only a server of another kind expects (a pool's,
        `pool.py`); False: it is malformed here."""
        return False

    def send(self, rank: int, message: object) -> bool:
        """Send `message` to one connected rank; False if it is not connected (any more)."""
        with self._lock:
            channel = self._channels.get(rank)
        if channel is None:
            return False
        try:
            self.counters.messages_sent += 1
            channel.send(message)
            return True
        except OSError:
            return False

    def _relay_task(self, connection: _Connection, message: object) -> None:
        """What a task relays for its rank: where the ranks run, output lines, then the
        process's end. Only the newest task of a rank is heard."""
        channel = connection.channel
        rank = getattr(message, "rank", None)
        with self._lock:
            if isinstance(message, TaskStarted) and isinstance(rank, int):
                self._task_of[rank] = channel
            if self._task_of.get(rank) is not channel:
                raise _EndConnection("a lost rank's task, replaced: old news")
        match message:
            case TaskStarted(rank, executors) if 0 <= rank < self.np and isinstance(
                    executors, list) and len(executors) in (0, self.np) and all(
                    isinstance(executor, str) for executor in executors):
                connection.rank = rank
                if executors:  # an elastic rank's task knows no other: none
                    self.events.put(RanksPlaced(rank, executors))
            case TaskAlive(rank, state) if 0 <= rank < self.np and state in _PROCESS_STATES:
                now = time.monotonic()
                self.counters.liveness_reports += 1
                self.counters.first_report_at = self.counters.first_report_at or now
                self.counters.last_report_at = now
                self.events.put(RankProcessState(rank, state, periodic=True))
            case TaskOutput(rank, stream, lines) if 0 <= rank < self.np:
                for text, replace in lines:
                    self.events.put(RankOutput(rank, stream, text, replace))
            case TaskExited(rank, host, returncode, output) if 0 <= rank < self.np:
                self.events.put(ProcessExited(rank, returncode, output, host))
                raise _EndConnection("the process ended")
            case _:
                raise _EndConnection("malformed")

    def _connection_ended(self, rank: int, timed_out: bool, channel: Channel) -> None:
        with self._lock:
            if self._channels.get(rank) is not channel:
                return  # an elastic run's lost rank, whose slot a new process holds now
            self._channels.pop(rank)
            closed = self._closed
        if rank not in self._finished and not closed:
            host = self._registrations[rank][1]
            if timed_out:
                failure = RankFailed(rank, host, FailureKind.UNREACHABLE, "",
                                     f"{host} stopped answering", at_ns=time.monotonic_ns())
            else:
                failure = RankFailed(rank, host, FailureKind.VANISHED, "", "connection lost",
                                     at_ns=time.monotonic_ns())
            self.events.put(failure)


def _interned(host: str) -> str:
    return sys.intern(host) if isinstance(host, str) else host
