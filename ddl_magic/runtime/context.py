"""The runtime's process-wide state: what `init()` builds and `shutdown()` tears down.

A rank started by a launcher finds its `RankBootstrap` here (set by the worker before the
user's code runs); a script run with plain `python` has none and becomes a world of one.
Per-process state (the listener, the secret) lives in the bootstrap so that a process can
`init()` again after `shutdown()`.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from .errors import NotInitializedError
from .collectives import CollectiveRunner
from .op_queue import OpQueue
from .op_queue_shm import SharedMemoryOpQueue
from .op_queue_tcp import TcpOpQueue
from .settings import Settings
from .shared_memory import connect_host_group
from .transport import RingTransport, connect_ring
from .world import Peer, World, derive_world, single_process_world


@dataclass
class RankBootstrap:
    """Everything a launched rank knows before `init()`: set by `ddl_magic.worker`."""

    rank: int
    peers: list[Peer]
    secret: bytes
    listener: socket.socket


@dataclass
class Runtime:
    world: World
    queue: OpQueue
    transport: str  # how data moves between ranks: "none", "tcp", "shm" or "shm+tcp" (hierarchical)


bootstrap: RankBootstrap | None = None
_runtime: Runtime | None = None
_lock = threading.Lock()


def init() -> Runtime:
    """Form the ring (or a world of one). Calling it again while initialised is harmless."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        settings = Settings.from_environment()
        host_group = cross = None
        if bootstrap is None:
            world = single_process_world()
            transport = RingTransport(world, (0,), None, None, {}, settings.timeout_s)
        else:
            world = derive_world(bootstrap.rank, bootstrap.peers)
            hierarchical = (settings.hierarchical and settings.transport != "tcp"
                            and world.uniform_hosts)
            transport, cross = connect_ring(world, bootstrap.listener, bootstrap.secret,
                                            timeout=settings.timeout_s,
                                            op_timeout=settings.timeout_s, cross=hierarchical)
            try:
                if len(world.hosts) == 1 or hierarchical:  # else nothing would use it
                    host_group = connect_host_group(world, transport.coordination,
                                                    settings.transport, settings.timeout_s)
            except BaseException:
                transport.close()
                if cross is not None:
                    cross.close()
                raise
            if host_group is None and cross is not None:  # no shared memory: the flat ring
                cross.close()
                cross = None
        if os.environ.get("DDL_MAGIC_GPU") == "1":
            _pin_gpu(world.local_rank)
        runner = CollectiveRunner(transport, host_group, cross)
        if runner.moves_data_by == "shm":  # one host: negotiate in lockstep through it too
            queue: OpQueue = SharedMemoryOpQueue(runner, host_group, settings.fusion_threshold,
                                                 settings.cycle_time_s, settings.stall_time_s,
                                                 settings.timeout_s)
        else:
            queue = TcpOpQueue(runner, transport, settings.fusion_threshold,
                               settings.cycle_time_s, settings.stall_time_s)
        _runtime = Runtime(world, queue, runner.moves_data_by)
        return _runtime


def _pin_gpu(local_rank: int) -> None:
    """One GPU per rank on a host, chosen by local_rank, as Horovod scripts do themselves."""
    import torch

    torch.cuda.set_device(local_rank % torch.cuda.device_count())


def shutdown() -> None:
    """Stop the background thread and close the ring. Harmless when not initialised."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.queue.close()


def current(api_name: str) -> Runtime:
    """The initialised runtime, or a clear error naming the API that was called too early."""
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError(api_name)
    return runtime


def is_initialized() -> bool:
    return _runtime is not None
