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
"""

from __future__ import annotations

import errno
import queue
import socket
import threading
import time

from .events import (FailureKind, ProcessExited, RankFailed, RankFinished, RankOutput,
                     RankProcessState, RanksPlaced, RankStarted, ResetAsked, TimelineBatch,
                     TimelineStarted)
from ..wire.liveness import ProcessState
from ..wire.messages import (Abort, AskNextWorld, ClockProbe, ClockReading, Failed, Finished,
                             Output, Register, RunSettings, Start, TaskAlive, TaskExited,
                             TaskOutput, TaskStarted, TimelineEvents, TimelineStart)
from ..wire.channel import HANDSHAKE_TIMEOUT_S, AuthenticationError, Channel, PeerClosedError

_PROCESS_STATES = {state.value for state in ProcessState}


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
        self._secret = secret
        self._task = task
        self._settings = settings
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._task_channels: set[Channel] = set()
        # The task that speaks for each rank: an elastic run's replacement's task takes over
        # from the lost rank's, which may still report (late) over its own channel.
        self._task_of: dict[int, Channel] = {}
        self._registrations: dict[int, tuple] = {}
        self._torch_master: tuple[str, int] | None = None  # rank 0's port for torch's store
        self._finished: set[int] = set()
        self._started = False  # every rank of the launch registered and was sent its Start
        self._closed = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(max(16, 2 * np))
        self.address = (advertised_host, self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept_loop, name="ddl-control-accept",
                                          daemon=True)
        self._acceptor.start()

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
            channels = [*self._channels.values(), *self._task_channels]
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() does not
        except OSError:
            pass
        self._listener.close()
        for channel in channels:
            channel.close()
        self._acceptor.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="ddl-control-rank",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            channel, purpose = Channel.accept(sock, self._secret, {"control", "task"},
                                              HANDSHAKE_TIMEOUT_S)
        except (OSError, AuthenticationError, PeerClosedError):
            return  # a stranger, or garbage: refused, and the run goes on
        rank = None
        timed_out = False
        try:
            if purpose == "task":
                self._relay_task(channel)
                return
            rank = self._register(channel)
            if rank is not None:
                self._relay(channel, rank)
        except (OSError, PeerClosedError, EOFError) as exc:
            # ETIMEDOUT: keepalive or TCP_USER_TIMEOUT gave up on a host that stopped answering
            timed_out = isinstance(exc, TimeoutError) or getattr(exc, "errno", None) == errno.ETIMEDOUT
        except Exception:  # a malformed message (it passed the handshake): the connection ends, the run goes on
            pass
        finally:
            channel.close()
            if rank is not None:
                self._connection_ended(rank, timed_out, channel)

    def _register(self, channel: Channel) -> int | None:
        channel.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        while isinstance(message := channel.recv(), ClockProbe):
            channel.send(ClockReading(time.monotonic_ns()))
        channel.sock.settimeout(None)
        if not isinstance(message, Register):
            raise ValueError(f"expected Register, got {type(message).__name__}")
        rank, host, ring_address, pid, torch_master = (message.rank, message.host,
                                                       message.ring_address, message.pid,
                                                       message.torch_master)
        with self._lock:
            if self._closed or not 0 <= rank < self.np or rank in self._registrations:
                channel.send(Abort(f"rank {rank} is not expected in this run"))
                return None
            self._channels[rank] = channel
            self._registrations[rank] = (rank, host, tuple(ring_address))
            if rank == 0:
                self._torch_master = tuple(torch_master)
            everyone_here = len(self._registrations) == self.np and not self._started
            self._started = self._started or everyone_here
        self.events.put(RankStarted(rank, host, pid))
        if everyone_here:
            self._start_all()
        return rank

    def _start_all(self) -> None:
        with self._lock:
            peers = [self._registrations[rank] for rank in range(self.np)]
            channels = dict(self._channels)
        for rank, channel in channels.items():
            channel.send(Start(peers, self._task, self._settings, self._torch_master))

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

    def _relay(self, channel: Channel, rank: int) -> None:
        host = self._registrations[rank][1]
        while True:
            match channel.recv():
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
                    self.events.put(ResetAsked(rank, generation, world_rank, reason, error,
                                               commits))
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
            channel.send(message)
            return True
        except OSError:
            return False

    def _relay_task(self, channel: Channel) -> None:
        """What a task relays for its rank: where the ranks run, output lines, then the
        process's end. Only the newest task of a rank is heard."""
        with self._lock:
            if self._closed:
                return
            self._task_channels.add(channel)
        try:
            while True:
                message = channel.recv()
                rank = getattr(message, "rank", None)
                with self._lock:
                    if isinstance(message, TaskStarted) and isinstance(rank, int):
                        self._task_of[rank] = channel
                    if self._task_of.get(rank) is not channel:
                        return  # a lost rank's task, replaced: old news
                match message:
                    case TaskStarted(rank, executors) if 0 <= rank < self.np and isinstance(
                            executors, list) and len(executors) in (0, self.np) and all(
                            isinstance(executor, str) for executor in executors):
                        if executors:  # an elastic rank's task knows no other: none
                            self.events.put(RanksPlaced(rank, executors))
                    case TaskAlive(rank, state) if 0 <= rank < self.np and state in _PROCESS_STATES:
                        self.events.put(RankProcessState(rank, state, periodic=True))
                    case TaskOutput(rank, stream, lines) if 0 <= rank < self.np:
                        for text, replace in lines:
                            self.events.put(RankOutput(rank, stream, text, replace))
                    case TaskExited(rank, host, returncode, output) if 0 <= rank < self.np:
                        self.events.put(ProcessExited(rank, returncode, output, host))
                        return
                    case _:
                        return
        finally:
            with self._lock:
                self._task_channels.discard(channel)

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
