"""Ranks as local processes: the embedded default, no cluster needed.

Processes are spawned, never forked: the notebook kernel may have CUDA initialised or
threads running, neither of which survives a fork. Each rank gets one torch thread unless
the user says otherwise (N ranks on N cores, not N x N threads), the kernel's working
directory and its `sys.path`, so modules next to the notebook import on every rank.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

from ..events import RankOutput


class ProcessExited:
    """A rank's process ended (sent on the event queue; the run loop reads the exit code)."""

    def __init__(self, rank: int, returncode: int):
        self.rank = rank
        self.returncode = returncode


class LocalLauncher:
    """Starts `np` ranks as child processes of this one and stops them all on request."""

    bind_host = "127.0.0.1"
    advertised_host = "127.0.0.1"
    where = "local processes"

    def __init__(self, env: dict[str, str] | None = None):
        self._extra_env = dict(env or {})
        self._processes: list[subprocess.Popen] = []
        self._watchers: list[threading.Thread] = []

    def check(self, np: int) -> None:
        """Nothing to check up front: any number of local processes can start."""

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
              events: queue.Queue) -> None:
        base_env = dict(os.environ)
        base_env.update({
            "DDL_MAGIC_CONTROL": f"{control_address[0]}:{control_address[1]}",
            "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        })
        base_env.update(self._extra_env)
        for rank in range(np):
            read_end, write_end = os.pipe()
            env = dict(base_env, DDL_MAGIC_RANK=str(rank), DDL_MAGIC_SECRET_FD=str(read_end))
            process = subprocess.Popen(
                [sys.executable, "-m", "ddl_magic.worker"],
                env=env, cwd=os.getcwd(), pass_fds=(read_end,),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches the driver only; it stops the ranks
            )
            os.close(read_end)
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(secret)
            self._processes.append(process)
            for stream_name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
                self._follow(rank, stream_name, stream, events)
            self._follow_exit(rank, process, events)

    def stop(self, grace_s: float = 1.0) -> None:
        """Terminate every rank's process group, kill what remains after `grace_s`, reap all."""
        for process in self._processes:
            _signal_group(process, signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for watcher in self._watchers:
            watcher.join(timeout=5)

    def exit_codes(self) -> list[int | None]:
        return [process.poll() for process in self._processes]

    def _follow(self, rank: int, stream_name: str, stream, events: queue.Queue) -> None:
        """Relay what a rank prints outside the worker's own forwarding (e.g. an import error)."""
        def relay():
            for raw in iter(stream.readline, b""):
                events.put(RankOutput(rank, stream_name, raw.decode(errors="replace").rstrip("\r\n")))
            stream.close()

        self._start(relay)

    def _follow_exit(self, rank: int, process: subprocess.Popen, events: queue.Queue) -> None:
        self._start(lambda: events.put(ProcessExited(rank, process.wait())))

    def _start(self, target) -> None:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self._watchers.append(thread)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """Signal the rank and anything it started (DataLoader workers, subprocesses)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL', for messages."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
