"""The runtime's process-wide state: what `init()` builds and `shutdown()` tears down.

A rank started by a launcher finds its `RankBootstrap` here (set by the worker before the
user's code runs); a script run with plain `python` has none and becomes a world of one.
Per-process state (the listener, the secret) lives in the bootstrap so that a process can
`init()` again after `shutdown()`.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from . import rendezvous
from .collectives import CollectiveRunner
from .errors import NotInitializedError
from .op_queue import OpQueue
from .op_queue_shm import SharedMemoryOpQueue, has_core_to_spare
from .op_queue_tcp import TcpOpQueue
from .planes import choose_plane
from .planes.tcp import RingTransport
from .settings import Settings
from .world import Peer, World, derive_world, single_process_world


class DriverLink(Protocol):
    """What a launched rank's runtime may ask of the driver that launched it (the worker
    provides it, over the rank's control channel)."""

    def start_timeline(self, path: str) -> None:
        """Record this rank's timeline; the driver writes the run's trace to `path`."""

    def stop_timeline(self) -> None:
        """Stop recording; what was recorded still reaches the driver."""


@dataclass
class RankBootstrap:
    """Everything a launched rank knows before `init()`: set by `ddl_magic.rank.worker`."""

    rank: int
    peers: list[Peer]
    secret: bytes
    listener: socket.socket
    driver: DriverLink | None = None  # None where no driver launched it (a test's own ring)


@dataclass
class Runtime:
    """One ring and what runs collectives over it: every rank's (`init()`), or a process set's."""

    world: World  # numbered within this ring: a process set's rank 0 is its lowest run rank
    queue: OpQueue
    transport: str  # how data moves between ranks: "none", "tcp", "shm" or "shm+tcp" (hierarchical),
    # "gloo" (every buffer through torch.distributed), or one of the first four + "+nccl"
    # Unnamed operations are named by how many of their kind this process submitted over this
    # ring before: ranks that call them in the same order name them alike.
    unnamed_submitted: collections.Counter = field(default_factory=collections.Counter)


bootstrap: RankBootstrap | None = None
_runtime: Runtime | None = None
_subsets: list[Runtime] = []  # the process sets this rank belongs to, closed by shutdown()
_lock = threading.Lock()


def init() -> Runtime:
    """Form the ring (or a world of one). Calling it again while initialised is harmless."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        settings = Settings.from_environment()
        if bootstrap is None:
            world = single_process_world()
            alone = RingTransport(world, (0,), None, None, {}, settings.timeout_s)
            # DDL_MAGIC_TORCH_PLANE=nccl or gloo holds for a world of one too (a group of one)
            device_group = rendezvous.connect_device_group(world, {}, os.urandom(16), settings)
            _runtime = _runtime_over(world, rendezvous.Connections(alone, None, None, device_group),
                                     settings)
        else:
            world = derive_world(bootstrap.rank, bootstrap.peers)
            _allow_open_files(world.size)
            _runtime = _runtime_over(world, rendezvous.connect(world, bootstrap.listener,
                                                               bootstrap.secret, settings),
                                     settings)
        if os.environ.get("DDL_MAGIC_GPU") == "1":
            _pin_gpu(world.local_rank)
        return _runtime


def subset_listener() -> socket.socket:
    """A listener for a process set's ring, on the address this rank's ring listener has."""
    if bootstrap is None:
        raise RuntimeError("a process set needs a launched run (a world of one has none)")
    return socket.create_server((bootstrap.listener.getsockname()[0], 0))


def connect_subset(members: tuple[int, ...], ports: dict[int, int],
                   listener: socket.socket) -> Runtime:
    """Form a ring over `members` (global ranks, ascending; this rank among them), each
    listening on `ports[rank]` at its usual address, and run collectives over it.

    Every member calls this with the same `members` and `ports`, agreed over the run's ring
    (`rendezvous.gather`).
    """
    world = rendezvous.process_set_world(bootstrap.peers, bootstrap.rank, members, ports)
    try:
        settings = Settings.from_environment()
        connections = rendezvous.connect(world, listener, bootstrap.secret, settings)
    finally:
        listener.close()
    run = _runtime
    if connections.host_group is not None and run is not None and \
            run.world.local_size > len(os.sched_getaffinity(0)):
        # The set's members share their cores with the run's other ranks on this host, busy
        # in sets of their own (HSDP's groups run side by side): a spinning wait would take
        # the core a neighbour needs, so wait on the futex at once, as the run's ring does.
        connections.host_group.spin_s = 0.0
    runtime = _runtime_over(world, connections, settings)
    with _lock:
        _subsets.append(runtime)
    return runtime


def is_open(runtime: Runtime) -> bool:
    """Whether `runtime` still runs collectives: the run's ring, or a set's ring that neither
    `close_subset` nor `shutdown` (the run's ring re-formed) has closed."""
    with _lock:
        return runtime is _runtime or runtime in _subsets


def close_subset(runtime: Runtime) -> None:
    """Leave a process set's ring (its members call this together)."""
    with _lock:
        if runtime not in _subsets:
            return
        _subsets.remove(runtime)
    runtime.queue.close()


def _runtime_over(world: World, connections: rendezvous.Connections,
                  settings: Settings) -> Runtime:
    # the plane is chosen once per ring (a process set's too)
    plane = choose_plane(connections.ring, connections.host_group, connections.cross,
                         connections.device_group, settings.allreduce_algorithm)
    runner = CollectiveRunner(plane, world.rank, world.size)
    if plane.lockstep_group is not None:  # one host: negotiate in lockstep through it too
        # Every rank of the run on this host computes (a process set's ring shares the host's
        # cores with the run's other ranks). Torch's threads are read here, on the user's
        # thread: OpenMP keeps them per thread, and the queue's own thread would see its own.
        ranks_on_host = max(world.local_size, _runtime.world.local_size if _runtime else 0)
        overlap = has_core_to_spare(ranks_on_host, len(os.sched_getaffinity(0)), torch.get_num_threads())
        queue: OpQueue = SharedMemoryOpQueue(runner, plane.lockstep_group, settings.fusion_threshold,
                                             settings.cycle_time_s, settings.stall_time_s,
                                             settings.timeout_s, overlap)
    else:
        queue = TcpOpQueue(runner, connections.ring, settings.fusion_threshold,
                           settings.cycle_time_s, settings.stall_time_s)
    return Runtime(world, queue, plane.name)


def _allow_open_files(size: int) -> None:
    """Rank 0 holds a connection to every rank while the ring forms (`rendezvous.py`): at
    1024 ranks that passes the usual soft limit of 1024 open files, so raise it to the hard
    limit where that is needed and allowed."""
    try:
        import resource
    except ImportError:  # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = size + 256  # the ring's links, the hypercube's, and what the rank opens itself
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # connecting then says which connection could not be opened


def _pin_gpu(local_rank: int) -> None:
    """One GPU per rank on a host, chosen by local_rank, as Horovod scripts do themselves."""
    import torch

    torch.cuda.set_device(local_rank % torch.cuda.device_count())


def shutdown() -> None:
    """Stop the background threads and close the rings (process sets' too). Harmless when
    not initialised."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
        subsets = _subsets[:]
        _subsets.clear()
    for subset in subsets:
        subset.queue.close()
    if runtime is not None:
        runtime.queue.close()


def abort(error: BaseException) -> None:
    """Fail every collective in flight with `error`, from any thread, ending the waits under
    them at once (a pool's cell was stopped). The rings stay allocated, and unusable, until
    `shutdown()`: a thread may still be reading their memory."""
    with _lock:
        runtimes = [runtime for runtime in (_runtime, *_subsets) if runtime is not None]
    for runtime in runtimes:
        runtime.queue.abort(error)


def refuse_collectives(error: BaseException | None) -> None:
    """Refuse every collective with `error` until called with None (a pool cell on some
    ranks only: the others would never join one)."""
    with _lock:
        runtimes = [runtime for runtime in (_runtime, *_subsets) if runtime is not None]
    for runtime in runtimes:
        runtime.queue.refusal = error


def ring_is_clean() -> bool:
    """Is a ring formed that the next cell can use: nothing failed, nothing left in flight?"""
    with _lock:
        runtimes = [runtime for runtime in (_runtime, *_subsets) if runtime is not None]
    return _runtime is not None and all(runtime.queue.is_clean for runtime in runtimes)


def current(api_name: str) -> Runtime:
    """The initialised runtime, or a clear error naming the API that was called too early."""
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError(api_name)
    return runtime


def is_initialized() -> bool:
    return _runtime is not None
