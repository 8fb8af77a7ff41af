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
    parent ◄── RankReaped ── (when the factory reaps a rank, after all it wrote)

The factory owns each rank's output: a rank's stdout and stderr are pipes whose read ends
only the factory holds, so whatever the rank wrote before it died (a segfault, the OOM
killer, SIGKILL, `os._exit`) is read and sent on, and a rank's exit is reported only after
everything it wrote, its last unfinished line included.

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
from dataclasses import dataclass, field

from . import memory_cap
from ..wire.liveness import ProcessState, process_state
from ..wire.messages import ForkRank, RankForked, RankReaped, RankState, RankWrote
from ..wire.output_lines import LineSplitter
from ..wire.channel import FrameBuffer, frame

# How often the factory reads its ranks' states: a stop is reported this long after it at
# most, well within the shortest peer timeout (2 s).
STATE_POLL_S = 0.25
MAX_FDS_PER_READ = 64  # descriptors that can come with one read of requests


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when the thread that started it ends (elsewhere,
    nothing: a rank there ends when it loses the driver)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


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


def serve(tied: bool = False) -> None:
    """The factory's loop: fork a rank per request, forward its output, report its exit.
    `tied`: each rank is killed when the factory ends (its parent started it tied to itself)."""
    try:
        import torch  # the point of the factory: imported once, before any fork

        from . import worker  # noqa: F401

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
    oom_kills: dict[int, int] = {}  # pid -> the machine's OOM kills when it was forked
    polled_at = 0.0
    while True:
        try:
            readable, _, _ = select.select([0, child_exits_r, *streams], [], [],
                                           STATE_POLL_S if states else None)
        except InterruptedError:
            continue
        if time.monotonic() - polled_at >= STATE_POLL_S:
            polled_at = time.monotonic()
            _report_states(states)
        for fd in readable:
            if fd in streams:
                _forward(streams, fd, until_empty=False)
        if child_exits_r in readable:
            os.read(child_exits_r, 4096)
            _report_exits(streams, states, oom_kills)
        if 0 in readable:
            messages = requests.read()
            if messages is None:
                # The parent is gone. Skip the interpreter's teardown of torch (over a
                # second), during which this process would still hold the parent's stderr.
                os._exit(0)
            for request in messages:
                pipes = {"stdout": os.pipe(), "stderr": os.pipe()}
                handed = requests.take_fds(len(request.fds))
                kills_before = memory_cap.machine_oom_kills()
                pid = os.fork()
                if pid == 0:
                    _become_rank(request, pipes, handed, tied, child_exits_r, child_exits_w,
                                 *streams)
                for fd in handed:
                    os.close(fd)  # the rank's now
                for stream, (read_end, write_end) in pipes.items():
                    os.close(write_end)  # before the next fork: only this rank may hold it
                    os.set_blocking(read_end, False)
                    streams[read_end] = _RankStream(pid, stream)
                states[pid] = ProcessState.RUNNING
                oom_kills[pid] = kills_before
                write_frame(1, RankForked(request.id, pid))


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


def _report_exits(streams: dict[int, _RankStream], states: dict[int, ProcessState],
                  oom_kills: dict[int, int]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        # Everything it wrote is in its pipes now (more only if a child of its own lives on).
        for fd in [fd for fd, rank_stream in streams.items() if rank_stream.pid == pid]:
            _forward(streams, fd, until_empty=True)
        states.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        why = memory_cap.out_of_memory(pid, code, usage.ru_maxrss * 1024, oom_kills.pop(pid, 0))
        write_frame(1, RankReaped(pid, code, why))


def _become_rank(request: ForkRank, pipes: dict[str, tuple[int, int]], handed: list[int],
                 tied: bool, *factory_fds: int) -> None:
    """In the forked child: become a rank as if freshly started, run it, and exit.

    Its stdout and stderr are the write ends of `pipes`, which the factory reads; `handed`
    are the descriptors that came with the request, open here under the numbers the
    request gives them (`request.fds`)."""
    code = 1
    try:
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
        os._exit(code)  # never return into the factory's loop


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
