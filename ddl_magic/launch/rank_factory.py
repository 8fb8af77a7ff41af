"""A warm factory of rank processes: a process with torch already imported forks each rank.

Starting a rank from scratch costs a Python start and `import torch`, about a second per
rank and paid again by every cell. The factory pays it once per notebook kernel (it starts
in the background at `%load_ext ddl_magic`). Forking the notebook kernel itself would be
unsafe — CUDA may be initialised there and threads are running — but the factory is a fresh
process that never touches CUDA and forks from its only Python thread.

The factory talks to its parent over its stdin and stdout, which only that parent holds:

    parent ── fork(request) ──► factory ── os.fork() ──► rank: setsid, cwd, sys.path,
    parent ◄── ("started", id, pid) ──                         environment, run the worker
    parent ◄── ("exited", pid, returncode) ── (when the factory reaps a rank)

The factory exits when its stdin closes, that is when its parent exits.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import sys
import traceback

_LENGTH = struct.Struct("!Q")


def write_frame(fd: int, message: object) -> None:
    data = pickle.dumps(message)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Reassembles length-prefixed pickles from a pipe read in arbitrary pieces."""

    def __init__(self, fd: int):
        self.fd = fd
        self._buffer = b""

    def read(self) -> list[object] | None:
        """The complete messages now available, or None at end of file."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self._buffer += chunk
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if len(self._buffer) < _LENGTH.size + length:
                break
            messages.append(pickle.loads(self._buffer[_LENGTH.size:_LENGTH.size + length]))
            self._buffer = self._buffer[_LENGTH.size + length:]
        return messages


def serve() -> None:
    """The factory's loop: fork a rank per request, report every rank's exit."""
    import torch  # the point of the factory: imported once, before any fork

    from .. import worker  # noqa: F401

    # A process's first optimizer costs about 1.5 s: torch.optim imports torch's compiler
    # stack on first use. Every rank builds one, so pay it here, once.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent to handle
    child_exits_r, child_exits_w = os.pipe()
    os.set_blocking(child_exits_w, False)
    signal.set_wakeup_fd(child_exits_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = FrameReader(0)
    while True:
        try:
            readable, _, _ = select.select([0, child_exits_r], [], [])
        except InterruptedError:
            continue
        if child_exits_r in readable:
            os.read(child_exits_r, 4096)
            _report_exits()
        if 0 in readable:
            messages = requests.read()
            if messages is None:
                # The parent is gone. Skip the interpreter's teardown of torch (over a
                # second), during which this process would still hold the parent's stderr.
                os._exit(0)
            for request in messages:
                pid = os.fork()
                if pid == 0:
                    _become_rank(request, child_exits_r, child_exits_w)
                write_frame(1, ("started", request["id"], pid))


def _report_exits() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        write_frame(1, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _become_rank(request: dict, *factory_fds: int) -> None:
    """In the forked child: become a rank as if freshly started, run it, and exit."""
    code = 1
    try:
        os.setsid()  # its own process group: stopping the rank stops what it starts too
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for fd in factory_fds:
            os.close(fd)
        boot_log = os.open(request["boot_log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(boot_log, 1)
        os.dup2(boot_log, 2)
        os.chdir(request["cwd"])
        sys.path[:] = request["sys_path"]
        os.environ.clear()
        os.environ.update(request["env"])
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        from .. import worker

        code = worker.run_rank(request["control"], request["rank"], request["secret"])
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never return into the factory's loop

