"""A warm factory of rank processes: a process with torch already imported forks each rank.

Starting a rank from scratch costs a Python start and `import torch`, about a second per
rank and paid again by every cell. The factory pays it once per notebook kernel (it starts
in the background at `%load_ext ddl_magic`). Forking the notebook kernel itself would be
unsafe — CUDA may be initialised there and threads are running — but the factory is a fresh
process that never touches CUDA and forks from its only Python thread.

The factory talks to its parent over its stdin (a Unix socket, so that descriptors can go
with a request) and its stdout, which only that parent holds:

    parent ── ForkRank ──► factory ── os.fork() ──► rank: setsid, cwd, sys.path,
    parent ◄── RankForked ──                          environment, run the worker
    parent ◄── RankWrote ── (what the rank wrote, line by line)
    parent ◄── RankState ── (when the kernel's word on the rank changes: running, stopped)
    parent ◄── RankExited ── (after all it wrote: as it exits on its own, else when reaped)

Forking this process (torch imported, ~400 MB resident) takes about 10 ms on a small VM, and
a run's ranks were forked one after another on the way to its first step. So while no rank
of its own runs, the factory forks *spares* ahead of the next requests, as many as its last
busy spell had ranks at once (`MAX_SPARES` at most): each has already left the factory (own
session, own stdout and stderr pipes) and waits on a socket for the request that makes it a
rank; a request is then answered at once. Spares are named `ddl-spare` (`ps`, `top`), hold
no descriptor of a run, and exit when the factory does.

The factory owns each rank's output: a rank's stdout and stderr are pipes whose read ends
only the factory holds, so whatever the rank wrote before it died (a segfault, the OOM
killer, SIGKILL, `os._exit`) is read and sent on, and a rank's exit is reported only after
everything it wrote, its last unfinished line included.

A rank's exit is on the way to the end of every run: the kernel takes down its memory
before its parent can reap it, ~10 ms for a process forked from one with torch imported. So
a rank closes its output as its last act before `os._exit`; when both its pipes end, the
factory reads the rank's state from the kernel, which has set its exit code before taking its
memory down, and reports its exit (`RankExited`) without waiting for the reaping. A rank
killed by a signal is reported when reaped: its peak memory and the OOM killer's word come
from that; so is a rank in a memory cgroup of its own, which its reaping removes.

The factory is also the judge of whether a rank is alive (`liveness.py`): it reads each
rank's state from the kernel every `STATE_POLL_S` and reports changes, so a rank that holds
its GIL in a long native call is seen running, and a stopped one stopped.

CUDA. A process that has initialised CUDA cannot fork a child that uses it, and a notebook
kernel often has (a model moved to the GPU, `torch.cuda.is_available()`). So the factory
never initialises CUDA before it forks: it imports torch and warms `torch.optim`, neither of
which calls into CUDA, and asks nothing of `torch.cuda` (`is_available`, `device_count` and
`set_device` initialise the driver). Each rank initialises CUDA itself, after the fork, on
its own device (`--gpu` pins `local_rank`'s). `tests/test_rank_factory.py` starts a factory
with a stub that records every such call and checks that all of them came from ranks.

The factory exits when its stdin closes, that is when its parent exits. Its parent is a
notebook kernel (`launch/local.py`), or a Spark executor's Python worker (`spark_task.py`):
there the factory is *tied*: it dies with the worker, and each rank with it, as a rank
started by the task itself would.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import pickle
import select
import signal
import socket
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field

from . import memory_cap
from ..wire.liveness import ProcessState, exit_under_way, process_state
from ..wire.messages import ForkRank, RankExited, RankForked, RankState, RankWrote
from ..wire.output_lines import LineSplitter
from ..wire.channel import FrameBuffer, frame

# How often the factory reads its ranks' states: a stop is reported this long after it at
# most, well within the shortest peer timeout (2 s).
STATE_POLL_S = 0.25
# A rank that closed its output is read for its exit this often, this long, before its
# reaping is left to report it (it closes its output just before `os._exit`).
EXIT_POLL_S = 0.001
EXIT_POLL_FOR_S = 0.05
MAX_FDS_PER_READ = 64  # descriptors that can come with one read of requests
MAX_SPARES = 16  # processes forked ahead of requests, at most
SPARE_NAME = "ddl-spare"  # a spare's process name, until a request makes it a rank


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when the thread that started it ends (elsewhere,
    nothing: a rank there ends when it loses the driver)."""
    _prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def _prctl(option: int, argument: object) -> None:
    """Linux's prctl(2) for this process; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, argument)


def write_frame(fd: int, message: object) -> None:
    """Send `message` down the pipe `fd`, framed as every connection of a run frames it."""
    view = memoryview(frame(pickle.dumps(message)))
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """The messages coming up a pipe read in arbitrary pieces; on a Unix socket
    (`with_fds`), also the descriptors sent with them, in the order they came."""

    def __init__(self, fd: int, with_fds: bool = False):
        self.fd = fd
        self._frames = FrameBuffer()
        self._socket = socket.socket(fileno=fd) if with_fds else None
        self.fds: list[int] = []  # received, not yet taken by a request

    def read(self) -> list[object] | None:
        """The complete messages now available, or None at end of file."""
        if self._socket is None:
            chunk = os.read(self.fd, 65536)
        else:
            chunk, fds, _, _ = socket.recv_fds(self._socket, 65536, MAX_FDS_PER_READ)
            self.fds.extend(fds)
        if not chunk:
            return None
        return [pickle.loads(data) for data in self._frames.feed(chunk)]

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
        else:
            os.close(self.fd)

    def take_fds(self, count: int) -> list[int]:
        """The next `count` descriptors received (sent before or with the request)."""
        taken, self.fds = self.fds[:count], self.fds[count:]
        return taken


@dataclass
class _RankStream:
    """The factory's end of one rank's stdout or stderr pipe."""

    pid: int
    stream: str  # "stdout" or "stderr"
    lines: LineSplitter = field(default_factory=LineSplitter)


@dataclass
class _Spare:
    """A process forked ahead of a request: it waits on `link` for the request that makes it
    a rank; the factory holds the read ends of its stdout and stderr pipes."""

    pid: int
    link: socket.socket
    stdout: int
    stderr: int

    def fds(self) -> tuple[int, int, int]:
        return self.link.fileno(), self.stdout, self.stderr

    def close(self) -> None:
        self.link.close()
        os.close(self.stdout)
        os.close(self.stderr)


def spares_to_keep(busiest: int) -> int:
    """How many spares to fork while idle, after a busy spell that had `busiest` ranks alive
    at once: what the same run again would ask for."""
    return min(busiest, MAX_SPARES)


def serve(tied: bool = False) -> None:
    """The factory's loop: fork a rank per request, forward its output, report its exit.
    `tied`: each rank is killed when the factory ends (its parent started it tied to itself)."""
    try:
        import torch  # the point of the factory: imported once, before any fork

        from . import worker  # noqa: F401
        # What every rank imports on its way to the user's code, ~15 ms a rank: its task's
        # class (unpickled by reference), and the codec that `socket.create_connection`
        # encodes a host name with.
        import encodings.idna  # noqa: F401

        from ..wire import tasks  # noqa: F401

        # A process's first optimizer costs about 1.5 s: torch.optim imports torch's compiler
        # stack on first use. Every rank builds one, so pay it here, once.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    except ImportError:
        pass  # (an executor's Python without torch): each rank says so, as its own error

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent to handle
    child_exits_r, child_exits_w = os.pipe()
    os.set_blocking(child_exits_w, False)
    signal.set_wakeup_fd(child_exits_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = FrameReader(0, with_fds=True)
    streams: dict[int, _RankStream] = {}  # read end -> whose stream it is
    states: dict[int, ProcessState] = {}  # pid -> what was last reported of each living rank
    oom_kills: dict[int, int] = {}  # pid -> the machine's OOM kills when it became a rank
    spares: dict[int, _Spare] = {}  # pid -> a process forked ahead of a request
    output_ended: dict[int, float] = {}  # pid -> until when to look for its exit
    exit_reported: set[int] = set()  # ranks whose exit was reported before their reaping
    busiest = keep = 0  # ranks alive at once in this busy spell; spares kept while idle
    polled_at = 0.0
    while True:
        if not states and busiest:  # the busy spell is over
            keep, busiest = spares_to_keep(busiest), 0
        fork_spare = not states and len(spares) < keep
        timeout = (0 if fork_spare else EXIT_POLL_S if output_ended
                   else STATE_POLL_S if states else None)
        try:
            readable, _, _ = select.select([0, child_exits_r, *streams], [], [], timeout)
        except InterruptedError:
            continue
        if time.monotonic() - polled_at >= STATE_POLL_S:
            polled_at = time.monotonic()
            _report_states(states)
        for fd in readable:
            if fd in streams:
                pid = streams[fd].pid
                _forward(streams, fd, until_empty=False)
                # (a capped rank waits for its reaping, which removes its memory cgroup:
                # reported before, the run, and the factory with it, could end first)
                if (pid in states and not any(s.pid == pid for s in streams.values())
                        and not memory_cap.is_capped(pid)):
                    output_ended[pid] = time.monotonic() + EXIT_POLL_FOR_S
        _report_exits_under_way(output_ended, states, exit_reported)
        if child_exits_r in readable:
            os.read(child_exits_r, 4096)
            _report_exits(streams, states, oom_kills, spares, exit_reported)
            for pid in [pid for pid in output_ended if pid not in states]:  # reaped
                del output_ended[pid]
        if 0 in readable:
            messages = requests.read()
            if messages is None:
                # The parent is gone. Skip the interpreter's teardown of torch (over a
                # second), during which this process would still hold the parent's stderr.
                os._exit(0)
            for request in messages:
                handed = requests.take_fds(len(request.fds))
                kills_before = memory_cap.machine_oom_kills()
                pid, outputs = _start_rank(request, handed, spares, tied,
                                           [child_exits_r, child_exits_w, *streams])
                for stream, read_end in outputs.items():
                    streams[read_end] = _RankStream(pid, stream)
                states[pid] = ProcessState.RUNNING
                oom_kills[pid] = kills_before
                busiest = max(busiest, len(states))
                write_frame(1, RankForked(request.id, pid))
        elif fork_spare and not readable:  # nothing else to do: ready the next run's ranks
            spare = _fork_spare(tied, [0, child_exits_r, child_exits_w, *streams,
                                       *(fd for other in spares.values() for fd in other.fds())])
            spares[spare.pid] = spare


def _start_rank(request: ForkRank, handed: list[int], spares: dict[int, _Spare], tied: bool,
                factory_fds: list[int]) -> tuple[int, dict[str, int]]:
    """Make a rank of a spare, or fork one: its pid, and the read ends of its stdout and
    stderr. The descriptors `handed` are the rank's now (closed here)."""
    while spares:
        spare = spares.pop(next(iter(spares)))
        try:
            if not process_state(spare.pid).alive:  # killed while it waited, not yet reaped
                raise ProcessLookupError(spare.pid)
            send_frame(spare.link, request, handed)
        except OSError:  # it died waiting (its exit is not reported: it was never a rank)
            os.kill(spare.pid, signal.SIGKILL)
            spare.close()
            continue
        spare.link.close()
        for fd in handed:
            os.close(fd)
        return spare.pid, {"stdout": spare.stdout, "stderr": spare.stderr}
    pipes = {"stdout": os.pipe(), "stderr": os.pipe()}
    pid = os.fork()
    if pid == 0:
        _run_forked(lambda: _leave_the_factory(pipes, tied, factory_fds),
                    lambda: (request, handed))
    for fd in handed:
        os.close(fd)
    return pid, _parent_ends(pipes)


def _fork_spare(tied: bool, factory_fds: list[int]) -> _Spare:
    """Fork a process that leaves the factory and waits for the request that makes it a rank."""
    link, spare_end = socket.socketpair()
    pipes = {"stdout": os.pipe(), "stderr": os.pipe()}
    pid = os.fork()
    if pid == 0:
        name = _process_name()

        def leave_the_factory() -> None:
            _leave_the_factory(pipes, tied, [*factory_fds, link.fileno()])
            _set_process_name(SPARE_NAME)

        def wait_for_request() -> tuple[ForkRank, list[int]]:
            requests = FrameReader(spare_end.detach(), with_fds=True)
            while True:
                messages = requests.read()
                if messages is None:
                    os._exit(0)  # the factory ended: so does its spare
                if messages:
                    handed = requests.take_fds(len(messages[0].fds))
                    requests.close()
                    _set_process_name(name)  # a rank, named as one forked on demand is
                    return messages[0], handed

        _run_forked(leave_the_factory, wait_for_request)
    spare_end.close()
    ends = _parent_ends(pipes)
    return _Spare(pid, link, ends["stdout"], ends["stderr"])


def _parent_ends(pipes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The factory keeps each pipe's read end; the write end is closed before the next fork,
    so that only the rank holds it."""
    ends = {}
    for stream, (read_end, write_end) in pipes.items():
        os.close(write_end)
        os.set_blocking(read_end, False)
        ends[stream] = read_end
    return ends


def send_frame(link: socket.socket, message: object, fds: list[int]) -> None:
    """Send `message` framed, with the descriptors `fds` (a request's, to a spare)."""
    data = frame(pickle.dumps(message))
    sent = socket.send_fds(link, [data], fds) if fds else 0
    if sent < len(data):  # (never an empty send: a spare closes its end once it has read it)
        link.sendall(data[sent:])


def _forward(streams: dict[int, _RankStream], fd: int, until_empty: bool) -> None:
    """Send on what the rank wrote to `fd`: one read, or `until_empty` all there is. At the
    end of the stream, its unfinished last line too."""
    rank_stream = streams[fd]
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        lines = rank_stream.lines.feed(chunk) if chunk else rank_stream.lines.finish()
        if lines:
            write_frame(1, RankWrote(rank_stream.pid, rank_stream.stream, lines))
        if not chunk:
            os.close(fd)
            del streams[fd]
            return
        if not until_empty:
            return


def _report_states(states: dict[int, ProcessState]) -> None:
    """Tell the parent of every rank that stopped, or went on after a stop, since the last
    report (whether it runs or sleeps is all one: alive)."""
    for pid, reported in states.items():
        state = process_state(pid)
        # (an ended rank, a zombie or gone, is reported once reaped)
        if state.alive != reported.alive and (state.alive or state is ProcessState.STOPPED):
            states[pid] = state
            write_frame(1, RankState(pid, state.value))


def _report_exits_under_way(output_ended: dict[int, float], states: dict[int, ProcessState],
                            exit_reported: set[int]) -> None:
    """Report each rank whose output ended and whose exit the kernel has under way: it is
    no longer a living rank (`states`: nor counted in a busy spell's ranks). Stop looking for
    the exit of those that have not exited in time (their reaping says)."""
    now = time.monotonic()
    for pid, until in list(output_ended.items()):
        code = exit_under_way(pid)
        if code is not None:
            write_frame(1, RankExited(pid, code))
            exit_reported.add(pid)
            states.pop(pid, None)
        if code is not None or now >= until:
            del output_ended[pid]


def _report_exits(streams: dict[int, _RankStream], states: dict[int, ProcessState],
                  oom_kills: dict[int, int], spares: dict[int, _Spare],
                  exit_reported: set[int]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in spares:  # (killed while it waited: never a rank, nobody to tell)
            spares.pop(pid).close()
            continue
        # Everything it wrote is in its pipes now (more only if a child of its own lives on).
        for fd in [fd for fd, rank_stream in streams.items() if rank_stream.pid == pid]:
            _forward(streams, fd, until_empty=True)
        states.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        why = memory_cap.out_of_memory(pid, code, usage.ru_maxrss * 1024, oom_kills.pop(pid, 0))
        if pid in exit_reported:  # as it exited (its memory cgroup is removed now)
            exit_reported.discard(pid)
        else:
            write_frame(1, RankExited(pid, code, why))


def _run_forked(leave_the_factory, wait_for_request) -> None:
    """In a forked child: `leave_the_factory()`, then `wait_for_request()` for the request and
    the descriptors that came with it, then become that rank as if freshly started, run it,
    and exit. The descriptors are opened here under the numbers the request gives them
    (`request.fds`)."""
    code = 1
    try:
        leave_the_factory()
        _leave_the_factorys_exit_work()
        request, handed = wait_for_request()
        _number_as_asked(handed, request.fds)
        os.chdir(request.cwd)
        sys.path[:] = request.sys_path
        os.environ.clear()
        os.environ.update(request.env)
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        from . import worker

        code = worker.run_rank(request.control, request.rank, request.secret,
                               parent_forwards_output=request.parent_forwards_output)
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _end_output()
        os._exit(code)  # never return into the factory's loop


def _leave_the_factorys_exit_work() -> None:
    """In a forked child: forget the exit handlers and finalizers the factory registered
    (torch's: ~50 ms at exit deregistering its operator libraries, which a process about to
    end need not do); a rank's exit runs only those registered while it was a rank (the
    user's code's, ddl_magic's), as a fresh process's would."""
    atexit._clear()
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False
    weakref.finalize._registered_with_atexit = False  # the next one registers its handler anew


def _end_output() -> None:
    """Close this rank's stdout and stderr pipes, its last act: the factory, seeing both
    end, reads its exit from the kernel while the kernel still takes down its memory. (Onto
    /dev/null, not closed: a thread of the rank that opens a file now cannot get 1 or 2.)"""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    except OSError:
        pass


def _leave_the_factory(pipes: dict[str, tuple[int, int]], tied: bool, factory_fds: list[int]) -> None:
    """In a forked child: its own session, the default signal handlers, none of the
    factory's descriptors (`factory_fds`); stdin from /dev/null, stdout and stderr the write
    ends of `pipes`, which the factory reads."""
    if tied:
        die_with_parent()
    os.setsid()  # its own process group: stopping the rank stops what it starts too
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    for fd in factory_fds:
        os.close(fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, (read_end, write_end) in zip((1, 2), (pipes["stdout"], pipes["stderr"])):
        os.close(read_end)
        os.dup2(write_end, fd)
        os.close(write_end)


def _process_name() -> str:
    try:
        with open("/proc/self/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _set_process_name(name: str) -> None:
    """The name `ps` and `top` show (Linux; elsewhere nothing)."""
    if name:
        _prctl(15, name.encode()[:15])  # PR_SET_NAME


def _number_as_asked(received: list[int], numbers: tuple[int, ...]) -> None:
    """Open each received descriptor under its number in `numbers`: first all of them above
    every number involved, so that placing one never closes another still to be placed."""
    if not received:
        return
    above = max(*received, *numbers) + 1
    lifted = []
    for fd in received:
        lifted.append(fcntl.fcntl(fd, fcntl.F_DUPFD, above))
        os.close(fd)
    for fd, number in zip(lifted, numbers):
        os.dup2(fd, number)  # inheritable: as a subprocess's pass_fds
        os.close(fd)
