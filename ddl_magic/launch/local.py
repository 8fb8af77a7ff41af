"""Ranks as local processes: the embedded default, no cluster needed.

Ranks are forked by the rank factory (`rank/factory.py`), a clean process with torch
already imported, never by the notebook kernel itself, where CUDA may be initialised and
threads are running. Each rank gets one torch thread unless the user says otherwise (N ranks
on N cores, not N x N threads), and the kernel's working directory, `sys.path` and
environment, so modules next to the notebook import on every rank.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time

from ..driver.events import ProcessExited, RankOutput, RankProcessState
from ..rank.factory_client import RankFactory, signal_rank_group
from ..wire.messages import ForkRank

_factory: RankFactory | None = None
_factory_lock = threading.Lock()


def rank_factory() -> RankFactory:
    """The factory of this process, started on first use (or by `prewarm`)."""
    global _factory
    with _factory_lock:
        if _factory is None or not _factory.alive():
            _factory = RankFactory()
        return _factory


def prewarm() -> None:
    """Start the rank factory now, so that it has imported torch by the first run."""
    rank_factory()


def release_rank_factory() -> tuple[int, int] | None:
    """End this process's rank factory, which keeps torch imported between runs (a few
    hundred MB) so that local ranks start fast; the next local run starts a new one.

    Returns its pid and resident bytes when it ended, None if none was running. Only between
    runs: ranks it forked (a local pool's) would lose the process that forwards their output.

    Example::

        release_rank_factory()   # (12345, 301989888)
    """
    global _factory
    with _factory_lock:
        factory, _factory = _factory, None
    if factory is None or not factory.alive():
        return None
    return factory.end()


class LocalLauncher:
    """Starts `np` ranks as local processes and stops them all on request (the driver's
    `Launcher` contract, `driver/launcher.py`)."""

    bind_host = "127.0.0.1"
    advertised_host = "127.0.0.1"
    where = elastic_where = "local processes"
    # The rank factory reads every rank's output and reports its exit after all of it.
    forwards_output = True
    # A replacement is a fork, ready in a moment: an elastic run's world waits for it.
    replacements_join_later = False
    caps_memory = True  # the factory forks each rank: it may enter a memory cgroup of its own

    def __init__(self):
        self._pids: list[int] = []
        self._exited: dict[int, threading.Event] = {}
        self._slot_pids: dict[int, int] = {}  # the process that now holds each rank's slot
        self._start_args: tuple | None = None

    @staticmethod
    def describe_lost(host: str, ranks: list[int]) -> str:
        """Local ranks that vanished without an exit status: their connection is all we know."""
        return "connection lost"

    def renewed(self) -> LocalLauncher:
        return LocalLauncher()

    def check(self, np: int) -> None:
        """Nothing to check up front: any number of local processes can start."""

    def check_elastic(self, np: int, max_np: int) -> None:
        """An elastic run here keeps its `np` slots: a lost rank's replacement takes its slot."""
        if max_np > np:
            raise ValueError(f"max_np={max_np} is above np={np}: a local elastic run replaces "
                             f"lost ranks and keeps at most its {np} ranks. Use -np {max_np}, "
                             "or leave max_np out")

    def check_gpus(self, np: int) -> None:
        """Every rank needs a GPU of this machine: say so before starting any."""
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError("GPUs were asked for (--gpu / use_gpu=True), but this machine has no "
                             "CUDA GPU that torch can see: drop the GPU option to train on CPU")
        if count < np:
            raise ValueError(f"{np} ranks need {np} GPUs, but this machine has {count}: "
                             f"use -np {count} or fewer, or drop the GPU option")

    def start(self, np: int, control_address: tuple[str, int], secret: bytes,
              events: queue.Queue, elastic: bool = False) -> None:
        """Fork `np` ranks (`elastic` or not: a lost one is replaced by `replace`, either way)."""
        sys_path = [os.getcwd(), *sys.path]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys_path if p)  # for what ranks start
        self._start_args = (control_address, secret, env, sys_path, events)
        # A start after `stop` is a new group (a run's restart): the last one's are all gone.
        self._pids, self._exited, self._slot_pids = [], {}, {}
        self._fork(range(np))

    def _fork(self, ranks) -> None:
        """Fork the processes of `ranks`, asked of the factory all at once."""
        control_address, secret, env, sys_path, events = self._start_args
        requests, exits = [], []
        for rank in ranks:
            exited = threading.Event()
            exits.append(exited)
            requests.append((ForkRank(rank, control_address, secret, env, os.getcwd(), sys_path),
                             *self._listeners(rank, events, exited)))
        pids = rank_factory().fork_ranks(requests)
        for rank, pid, exited in zip(ranks, pids, exits):
            self._pids.append(pid)
            self._exited[pid] = exited
            self._slot_pids[rank] = pid

    @staticmethod
    def _listeners(rank: int, events: queue.Queue, exited: threading.Event) -> tuple:
        """What the factory calls with a rank's exit, its output and its state."""

        def on_exit(returncode: int, out_of_memory: str) -> None:
            events.put(ProcessExited(rank, returncode, out_of_memory=out_of_memory))
            exited.set()

        def on_output(stream: str, lines: list) -> None:
            for text, replace in lines:
                events.put(RankOutput(rank, stream, text, replace))

        def on_state(state: str) -> None:
            events.put(RankProcessState(rank, state))

        return on_exit, on_output, on_state

    def replace(self, rank: int) -> bool:
        """Start a new process in the slot of `rank`, whose process was lost (an elastic
        run). The old one is gone first (a rank that raised gets half a second to exit on
        its own), and its exit queued before anything of the new one: True."""
        if not self._exited[self._slot_pids[rank]].wait(0.5):
            self.kill(rank)
        self._fork([rank])
        return True

    def kill(self, rank: int) -> None:
        """Kill the process in the slot of `rank` (stopped, unreachable or hung in an elastic
        run), and wait up to 5 s for its exit to be reported."""
        pid = self._slot_pids[rank]
        signal_rank_group(pid, signal.SIGKILL)
        self._exited[pid].wait(5)

    def stop(self, finished: bool = False, grace_s: float = 1.0) -> None:
        """Terminate every rank's process group, kill what remains after `grace_s`.
        `finished`: every rank reported its result, and is exiting: each has `grace_s` to
        exit before the signals (its exit is reported as soon as it has closed its output,
        while the kernel still takes down its memory: a signal now would cut that short)."""
        if finished:
            deadline = time.monotonic() + grace_s
            for pid in self._pids:
                self._exited[pid].wait(max(0.0, deadline - time.monotonic()))
        for pid in self._pids:
            signal_rank_group(pid, signal.SIGTERM)
            signal_rank_group(pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once resumed
        for pid in self._pids:
            if not self._exited[pid].wait(grace_s):
                signal_rank_group(pid, signal.SIGKILL)
                self._exited[pid].wait(5)

    @property
    def pids(self) -> list[int]:
        return list(self._pids)
