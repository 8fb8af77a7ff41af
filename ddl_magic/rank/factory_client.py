"""The parent's side of the rank factory (`factory.py`): start one, ask it for ranks, hear
what each writes, whether it is stopped, and when it exited.

A notebook kernel keeps one for its local runs (`launch/local.py`); a Spark executor's
Python worker keeps a tied one for the ranks of the tasks it runs (`spark_task.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
import time

from ..wire.messages import ForkRank, RankExited, RankForked, RankState, RankWrote
from .factory import FrameReader, die_with_parent, send_frame

FORK_TIMEOUT_S = 60.0  # for the rank factory to fork a rank it was asked for
FACTORY_EXIT_TIMEOUT_S = 10.0  # for a released factory to exit before it is killed


class RankFactory:
    """The parent's handle on the factory process: fork a rank, hear what it writes, whether
    it is stopped, and when it exits. `tied`: the factory dies with the thread that starts
    it, and its ranks with the factory (a Spark task's, `spark_task.py`)."""

    def __init__(self, tied: bool = False):
        self._requests, factory_end = socket.socketpair()
        with factory_end:
            self._process = subprocess.Popen(
                [sys.executable, "-c", "from ddl_magic.rank.factory import serve; "
                                       f"serve(tied={tied})"],
                stdin=factory_end.fileno(), stdout=subprocess.PIPE, cwd=os.getcwd(),
                preexec_fn=die_with_parent if tied else None)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._started: dict[int, queue.Queue] = {}
        self._exit_listeners: dict[int, callable] = {}
        self._output_listeners: dict[int, callable] = {}  # by request id until started, then by pid
        self._state_listeners: dict[int, callable] = {}  # by request id until started, then by pid
        self._early_exits: dict[int, RankExited] = {}  # exits heard before anyone listened for them
        threading.Thread(target=self._read_replies, name="ddl-rank-factory", daemon=True).start()

    def alive(self) -> bool:
        return self._process.poll() is None

    def end(self) -> tuple[int, int]:
        """End the factory (its pid, and its resident bytes before it ended)."""
        pid, resident = self._process.pid, _resident_bytes(self._process.pid)
        self._requests.close()  # the factory exits at the end of its requests
        try:
            self._process.wait(timeout=FACTORY_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        return pid, resident

    def fork_rank(self, request: ForkRank, on_exit, on_output, on_state) -> int:
        """Start one rank. From another thread, `on_output(stream, lines)` is called with what
        it writes, `on_state(state)` when it stops or goes on (a `ProcessState` value), then
        `on_exit(returncode, out_of_memory)` once it has ended and all it wrote was read
        (`out_of_memory`: why, where the OOM killer killed it, else ""): reaped, or exiting
        on its own with its output closed (the kernel then still takes its memory down)."""
        return self.fork_ranks([(request, on_exit, on_output, on_state)])[0]

    def fork_ranks(self, requests: list[tuple]) -> list[int]:
        """Start a rank for each `(request, on_exit, on_output, on_state)` (as `fork_rank`),
        all asked for before the first answer is awaited: their pids, in order."""
        replies = []
        with self._lock:
            for request, _, on_output, on_state in requests:
                request_id = next(self._ids)
                replies.append(reply := queue.Queue())
                self._started[request_id] = reply
                self._output_listeners[("request", request_id)] = on_output
                self._state_listeners[("request", request_id)] = on_state
                send_frame(self._requests, dataclasses.replace(request, id=request_id),
                           list(request.fds))
        deadline = time.monotonic() + FORK_TIMEOUT_S
        pids = []
        for reply, (_, on_exit, _, _) in zip(replies, requests):
            try:
                pid = reply.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError("the rank factory did not start a rank within "
                                   f"{FORK_TIMEOUT_S:.0f} s") from None
            if pid is None:
                raise RuntimeError("the rank factory exited before starting the rank; the next "
                                   "run starts a new one")
            with self._lock:
                early = self._early_exits.pop(pid, None)
                if early is None:
                    self._exit_listeners[pid] = on_exit
            if early is not None:
                on_exit(early.returncode, early.out_of_memory)
            pids.append(pid)
        return pids

    def _read_replies(self) -> None:
        replies = FrameReader(self._process.stdout.fileno())
        try:
            self._dispatch(replies)
        finally:  # the factory is gone: nobody waiting for a rank may wait in vain
            with self._lock:
                waiting, self._started = list(self._started.values()), {}
            for reply in waiting:
                reply.put(None)

    def _dispatch(self, replies: FrameReader) -> None:
        while (messages := replies.read()) is not None:
            for message in messages:
                on_exit = None
                with self._lock:
                    match message:
                        case RankForked(request_id, pid):
                            on_output = self._output_listeners.pop(("request", request_id))
                            self._output_listeners[pid] = on_output
                            self._state_listeners[pid] = self._state_listeners.pop(
                                ("request", request_id))
                            self._started.pop(request_id).put(pid)
                        case RankWrote(pid, stream, lines):
                            # (also after its exit: a process the rank started lives on)
                            if (on_output := self._output_listeners.get(pid)) is not None:
                                on_output(stream, lines)
                        case RankState(pid, state):
                            if (on_state := self._state_listeners.get(pid)) is not None:
                                on_state(state)
                        case RankExited(pid):
                            self._output_listeners.pop(pid, None)
                            self._state_listeners.pop(pid, None)
                            on_exit = self._exit_listeners.pop(pid, None)
                            if on_exit is None:
                                self._early_exits[pid] = message
                if on_exit is not None:
                    on_exit(message.returncode, message.out_of_memory)


def signal_rank_group(pid: int, signum: int) -> None:
    """Signal a rank a factory forked and anything it started (DataLoader workers,
    subprocesses): its process group, which it leads (`os.setsid` in the factory)."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
