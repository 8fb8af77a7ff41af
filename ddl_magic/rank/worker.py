"""The body of every rank, local process or Spark task alike.

    connect to the driver's control server and prove the run's secret
    measure the clock offset to the driver (for the timeline)
    register (host, ring listener) ──► receive the peer table and the task
    set torchrun's and Horovod's environment (rank_environment.py), register the `ddl`
    torch.distributed backend
    forward stdout/stderr line by line, ship timeline batches
    run the task ──► send its result, or the traceback
    exit; and exit at once if the driver aborts the run or goes away

Whether a rank is alive is not this process's to say: whatever owns it (the rank factory, a
Spark task) tells the driver (`liveness.py`), so a rank busy in native code for minutes,
holding its GIL, is not mistaken for a stopped one.

Every rank is forked by a rank factory (`factory.py`: the kernel's for local ranks, an
executor's Python worker's for a Spark task's), which calls `run_rank` with the secret it
received on its private socket: the secret never appears in a process listing or a log.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import runpy
import socket
import sys
import threading
import time
import traceback

import cloudpickle

from ..data.sources import SLOT_VARIABLE
from ..runtime import context
from ..runtime.errors import CollectiveAbortedError, CollectiveTimeoutError, HorovodInternalError
from ..runtime.timeline import recorder
from ..runtime.world import Peer, derive_world
from ..torch import backend as torch_backend
from ..torch import elastic
from ..torch.group_lifetime import keep_destroyed_groups_alive
from ..wire.channel import (ABORTED_EXIT_CODE, CONNECT_TIMEOUT_S, Channel, PeerClosedError,
                            peer_timeout_s)
from ..wire.elastic_settings import REPLACEMENT_START_S, elastic_timeout_s
from ..wire.messages import (Abort, AskNextWorld, ClockProbe, Failed, FailureKind, Finished,
                             HostsUpdated, NextWorld, Output, Register, RunCannotGoOn, Start, TimelineEvents,
                             TimelineStart)
from ..wire.output_lines import forward_lines
from . import allocator, memory_cap
from .environment import rank_environment, reserve_port

TEST_HOSTS_VARIABLE = "DDL_MAGIC_TEST_HOSTS"
TIMELINE_SHIP_INTERVAL_S = 0.25
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddl_magic/

# The control channel of this process's run. None outside a launched rank.
control: Channel | None = None
_shipper: "_TimelineShipper | None" = None
_leaving = threading.Event()  # set once the rank has finished: losing the driver is expected then


def run_rank(control_address: tuple[str, int], rank: int, secret: bytes,
             parent_forwards_output: bool = False) -> int:
    """Run one rank to completion; returns the process exit code.

    `parent_forwards_output`: the process that started this one reads its stdout and stderr
    and forwards them (the rank factory does), so that what this rank writes reaches the
    driver even if it dies: this rank then only flushes line by line.
    """
    global control
    channel = Channel.connect(control_address, secret, "control", CONNECT_TIMEOUT_S)
    control = channel
    recorder.clock_offset_ns = _clock_offset_ns(channel)
    listener = socket.socket()
    advertised_ip = channel.sock.getsockname()[0]  # the address the driver reached us from
    listener.bind((advertised_ip, 0))
    listener.listen(64)
    # Rank 0 keeps a port for torch.distributed's store (MASTER_PORT) until the task starts.
    store_port = reserve_port() if rank == 0 else None
    torch_master = (advertised_ip, store_port.getsockname()[1]) if store_port else None
    channel.send(Register(rank, _host_name(rank), listener.getsockname(), os.getpid(),
                          torch_master))
    os.environ[SLOT_VARIABLE] = str(rank)  # whose share of the run's data this process reads
    match channel.recv():
        case Start(peers, task_bytes, settings, torch_master, world_rank, generation):
            peers = [Peer(*p) for p in peers]
            # An elastic run's replacement registers in the slot it fills, and learns its rank.
            rank = rank if world_rank is None else world_rank
        case Abort():  # the run was stopped before it started, or this rank is not expected
            return ABORTED_EXIT_CODE
        case other:
            raise ValueError(f"expected Start from the driver, got {type(other).__name__}")
    os.environ.update(settings.env)
    if memory_cap.VARIABLE in settings.env:  # before anything of the user's runs
        memory_cap.cap_this_process(int(settings.env[memory_cap.VARIABLE]))
    else:
        allocator.keep_freed_memory()
    os.environ.update(rank_environment(derive_world(rank, peers), torch_master, settings.run_id,
                                       settings.restart_count, settings.max_restarts))
    context.bootstrap = context.RankBootstrap(rank, peers, secret, listener, _DriverLink(channel))
    plans: queue.Queue = queue.Queue()  # what the driver answers an elastic rank's reset
    if settings.elastic:
        elastic.install(DriverRendezvous(channel, plans, torch_master, settings.run_id),
                        generation)
    torch_backend.register()
    keep_destroyed_groups_alive()  # their destructors could deadlock (group_lifetime.py)
    if settings.pool:  # a rank that lives between cells: `cells.py` from here on
        from .cells import serve_cells

        if store_port is not None:
            store_port.close()
        output = _LineBuffered() if parent_forwards_output else _ForwardedOutput(channel)
        if settings.timeline:
            start_timeline_shipping()
        # An elastic pool's replacement forms its first ring with the survivors' fresh one.
        return serve_cells(channel, rank, output, run_reporting, _flush_timeline, _driver_time_ns,
                           first_epoch=generation)
    threading.Thread(target=_obey_driver, args=(channel, plans), name="ddl-control",
                     daemon=True).start()
    if settings.timeline:
        start_timeline_shipping()
    if store_port is not None:
        store_port.close()
    with _LineBuffered() if parent_forwards_output else _ForwardedOutput(channel):
        # An elastic run's rank 0 is whichever rank is first when it ends: every rank reports.
        exit_code, report = _run_task(task_bytes, rank, settings.return_all or settings.elastic)
    # A torch.distributed process group the task left open ends with this process, which
    # exits right after reporting, without running any destructor.
    stop_timeline_shipping()
    _leaving.set()
    channel.send(report)  # the task is done: nothing after this can fail or delay the run
    if exit_code == 0:
        context.shutdown()  # after a failure the driver stops everyone; don't wait on peers
    channel.close()
    return exit_code


def _host_name(rank: int) -> str:
    """The host this rank registers as: the rendezvous groups ranks into hosts by it.

    `DDL_MAGIC_TEST_HOSTS` ("a,a,b,b": the host of each rank) exists for tests only: it makes
    one machine look like several hosts, so mixed placements run without a cluster.
    """
    simulated = os.environ.get(TEST_HOSTS_VARIABLE)
    if not simulated:
        return socket.gethostname()
    hosts = simulated.split(",")
    return hosts[min(rank, len(hosts) - 1)].strip()


def _run_task(task_bytes: bytes, rank: int, return_all: bool) -> tuple[int, Finished | Failed]:
    return run_reporting(lambda: cloudpickle.loads(task_bytes).run(), rank, return_all)


def run_reporting(call, rank: int, return_all: bool) -> tuple[int, Finished | Failed]:
    """Call `call()`: the exit code and the report of how it went (its result pickled, where
    the driver wants it, or its traceback without ddl_magic's own frames)."""
    try:
        result = call()
    except elastic.RankRetired:  # the driver left this rank out of an elastic run's next world
        return 0, Finished(None)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 0:
            return 0, Finished(None)
        return code, Failed(FailureKind.RAISED, f"SystemExit: {exc.code}\n", f"exit code {code}",
                            code, _driver_time_ns())
    except BaseException as exc:
        failed_at_ns = _driver_time_ns()
        text = _user_traceback(exc)
        lost_a_peer = (isinstance(exc, HorovodInternalError)  # nobody was lost:
                       and not isinstance(exc, (CollectiveTimeoutError, CollectiveAbortedError)))
        kind = FailureKind.LOST_PEER if lost_a_peer else FailureKind.RAISED
        reason = (kind.value if lost_a_peer else
                  "collective timed out" if isinstance(exc, CollectiveTimeoutError) else "exception")
        return 1, Failed(kind, text, reason, 1, failed_at_ns, getattr(exc, "rank", None))
    if rank != 0 and not return_all:
        return 0, Finished(None)
    try:
        return 0, Finished(cloudpickle.dumps(result))
    except Exception as exc:
        text = (f"the result on rank {rank} ({type(result).__name__}) cannot be pickled: {exc}\n"
                "Return plain data (numbers, lists, tensors, a state_dict), or end the cell "
                "with a statement instead of an expression.\n")
        return 1, Failed(FailureKind.RAISED, text, "unpicklable result", 1, _driver_time_ns())


def _user_traceback(exc: BaseException) -> str:
    """The traceback without the frames of ddl_magic's own machinery above the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    first_user = next((i for i, f in enumerate(frames) if not _is_machinery(f.filename)), 0)
    trimmed = traceback.TracebackException.from_exception(exc)
    trimmed.stack = traceback.StackSummary.from_list(frames[first_user:])
    return "".join(trimmed.format())


def _is_machinery(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or filename in ("<frozen runpy>", runpy.__file__)


def _driver_time_ns() -> int:
    """Now, on the driver's monotonic clock (what attribution compares failures by)."""
    return time.monotonic_ns() + recorder.clock_offset_ns


def _clock_offset_ns(channel: Channel, probes: int = 5) -> int:
    """driver clock - our clock, from the probe with the shortest round trip (NTP's rule)."""
    best_rtt, best_offset = None, 0
    for _ in range(probes):
        sent = time.monotonic_ns()
        channel.send(ClockProbe())
        driver_ns = channel.recv().driver_ns
        received = time.monotonic_ns()
        if best_rtt is None or received - sent < best_rtt:
            best_rtt, best_offset = received - sent, driver_ns - (sent + received) // 2
    return best_offset


def _obey_driver(channel: Channel, plans: queue.Queue) -> None:
    """Exit at once when the driver aborts the run or disappears: no rank outlives its run.
    An elastic rank's next world, or the driver's word that there is none, goes to the
    rank's main thread, which waits for it in `DriverRendezvous.next_world`; a host-update
    notice goes to the running elastic states (`torch/elastic/notices.py`)."""
    try:
        while isinstance(message := channel.recv(), (NextWorld, RunCannotGoOn, HostsUpdated)):
            if isinstance(message, HostsUpdated):
                result = ((elastic.HostUpdateResult.added if message.added else 0)
                          | (elastic.HostUpdateResult.removed if message.removed else 0))
                elastic.notify_hosts_updated(message.timestamp, result)
            else:
                plans.put(message)
    except (OSError, PeerClosedError, EOFError):
        pass  # the driver went away
    if not _leaving.is_set():
        os._exit(ABORTED_EXIT_CODE)  # the driver already knows why: it asked, or it is gone


class DriverRendezvous:
    """An elastic rank's way to its next world (`torch.elastic.rendezvous`): ask the driver
    over the control channel, wait for its answer, and take the new rank's environment."""

    def __init__(self, channel: Channel, plans: queue.Queue,
                 torch_master: tuple[str, int] | None, run_id: str):
        self._channel = channel
        self._plans = plans
        self._torch_master = torch_master
        self._run_id = run_id

    def next_world(self, request: elastic.ResetRequest) -> elastic.WorldPlan:
        self._channel.send(AskNextWorld(request.generation, request.rank, request.reason.value,
                                        request.error, request.commits))
        # The driver answers once every live rank asked (the peer timeout at most), after
        # its wait for min_np ranks (DDL_MAGIC_ELASTIC_TIMEOUT) and the replacements' start.
        deadline_s = elastic_timeout_s() + 2 * peer_timeout_s() + REPLACEMENT_START_S
        try:
            answer = self._plans.get(timeout=deadline_s)
        except queue.Empty:
            raise elastic.ElasticRunFailed(
                f"the driver formed no next world within {deadline_s:.0f} s") from None
        if isinstance(answer, RunCannotGoOn):
            raise elastic.ElasticRunFailed(answer.reason)
        peers = tuple(Peer(*p) for p in answer.peers)
        if answer.rank is not None:
            os.environ.update(rank_environment(derive_world(answer.rank, list(peers)),
                                               self._torch_master, self._run_id))
        return elastic.WorldPlan(answer.generation, answer.rank, peers, answer.formed_at)


class _DriverLink:
    """The runtime's way to the driver (`runtime.context.DriverLink`): this rank's channel."""

    def __init__(self, channel: Channel):
        self._channel = channel

    def start_timeline(self, path: str) -> None:
        self._channel.send(TimelineStart(path))
        start_timeline_shipping()

    def stop_timeline(self) -> None:
        stop_timeline_shipping()


def start_timeline_shipping() -> None:
    """Record this rank's timeline and ship it to the driver (idempotent)."""
    global _shipper
    if _shipper is None:
        _shipper = _TimelineShipper(control)


def _flush_timeline() -> None:
    """Ship what the timeline recorded so far now (a pool's cell ended)."""
    if _shipper is not None:
        _shipper.ship()


def stop_timeline_shipping() -> None:
    """Stop recording; what was recorded so far still reaches the driver."""
    global _shipper
    if _shipper is not None:
        _shipper.stop()
        _shipper = None


class _TimelineShipper:
    """Sends the recorder's buffer to the driver in batches, off the training thread."""

    def __init__(self, channel: Channel):
        self._channel = channel
        self._stopped = threading.Event()
        recorder.enabled = True
        self._thread = threading.Thread(target=self._loop, name="ddl-timeline", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.wait(TIMELINE_SHIP_INTERVAL_S):
            self.ship()

    def ship(self) -> None:
        events = recorder.drain()
        if events:
            self._channel.send(TimelineEvents(events))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        recorder.enabled = False
        self.ship()


class _LineBuffered:
    """Output that the parent forwards: flushed line by line, and a native crash (segfault,
    abort) writes every thread's Python stack to stderr before the process dies."""

    def __enter__(self) -> "_LineBuffered":
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        faulthandler.enable(all_threads=True)
        return self

    def __exit__(self, *exc_info) -> None:
        faulthandler.disable()
        sys.stdout.flush()
        sys.stderr.flush()


class _ForwardedOutput:
    """Sends everything written to file descriptors 1 and 2 to the driver, line by line
    (`output_lines.py`), for a rank whose parent does not forward its output.

    Redirecting the descriptors (not just `sys.stdout`) also catches output from C
    extensions and child processes.
    """

    def __init__(self, channel: Channel):
        self._channel = channel
        self._streams = []

    def __enter__(self) -> "_ForwardedOutput":
        for fd, name, stream in ((1, "stdout", sys.stdout), (2, "stderr", sys.stderr)):
            stream.flush()
            read_end, write_end = os.pipe()
            saved = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)
            reader = threading.Thread(target=self._forward, args=(read_end, name),
                                      name=f"ddl-{name}", daemon=True)
            reader.start()
            self._streams.append((fd, saved, reader, stream))
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        # A native crash kills the forwarding threads with the process: its stacks go to the
        # original stderr instead, which whatever started this rank reads (a Spark task does).
        self._crash_file = os.fdopen(os.dup(self._streams[1][1]), "w")
        faulthandler.enable(file=self._crash_file, all_threads=True)
        return self

    def __exit__(self, *exc_info) -> None:
        faulthandler.disable()
        self._crash_file.close()
        for fd, saved, reader, stream in self._streams:
            stream.flush()
            os.dup2(saved, fd)  # closes our pipe's last write end: the reader sees EOF
            os.close(saved)
            reader.join(timeout=10)

    def _forward(self, read_end: int, stream: str) -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            forward_lines(lambda: pipe.read(65536),
                          lambda lines: self._channel.send(Output(stream, lines)))

