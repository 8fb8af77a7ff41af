"""Rendezvous: how the ranks of a ring find each other, before collectives run over it.

Forming a ring, at `init()` and for each process set, is `connect`:

1. `connect_ring`: TCP. Each rank connects to its right neighbour (and, where hierarchical
   allreduce runs, to its right neighbour in its cross ring), to its hypercube partners at
   lower positions (`planes/hypercube.py`: at most ⌈log2 N⌉ in all) and, except rank 0, to
   rank 0 for the coordination links; it accepts the connections from its left neighbours,
   its partners at higher positions (and, on rank 0, every other rank's coordination link,
   used while the ring forms). Every connection proves the run's secret first.
2. `connect_host_group`: shared memory. The ranks of one host map each other's segments,
   where that is wanted and works on every host.
3. `connect_device_group`: a torch.distributed group (NCCL, or gloo standing in for it),
   where `DDL_MAGIC_TORCH_PLANE` and what every rank can do call for one
   (`planes/torch_distributed.py`).

`context` then chooses, from these `Connections`, the plane that moves the bytes
(`planes.choose_plane`) and the op queue that negotiates.

A process set's ring forms the same way among its members, each listening on a port of its
own (`process_set_world`), once every rank of the run has learnt those ports.

Agreeing. Where ranks could decide differently (shared memory works on one host but not on
another; a rank added another process set than the others did), each says what it found,
`gather` hands every rank the same list, and every rank decides alike from it: either every
rank uses shared memory or none does; a process set is refused on every rank or on none.
`gather` pickles; an *exchange* moves every rank's bytes, and which one depends on when:

    over_coordination   while a ring forms: through rank 0's coordination links, which
                        nothing else uses yet
    over_op_queue       once a ring runs (a process set is added over the run's ring): two
                        allgathers negotiated like any collective, since the ring's op queue
                        owns the coordination links by then

(`HostGroup.exchange`, the shared-memory round that carries each negotiation cycle, moves
every local rank's bytes too; it is the data path of a formed ring, not rendezvous.)

Why every wait ends: connecting has one deadline, `timeout` from the start, for every
connection and every handshake; a gather over the coordination links waits at most
`timeout` for each message; one over the op queue as long as any collective may (the op
timeout, then `CollectiveTimeoutError`). A rank lost on the way is a `PeerLostError` that
names it.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from ..wire.channel import HANDSHAKE_TIMEOUT_S, AuthenticationError, Channel, PeerClosedError
from .agreement import Exchange, gather
from .errors import PeerLostError
from .negotiation import Request
from .planes.hypercube import HypercubeLinks, links_to_open
from .planes.shared_memory import HostGroup, Neighbour, Segment, supported
from .planes import torch_distributed
from .planes.tcp import RendezvousCount, RingTransport
from .settings import TRANSPORT_VARIABLE, Settings
from .world import Peer, World, derive_world

if TYPE_CHECKING:
    from .op_queue import OpQueue


@dataclass
class Connections:
    """What `connect` formed for one rank of a ring."""

    ring: RingTransport  # the ring of every rank, with rank 0's coordination links
    host_group: HostGroup | None  # shared memory with the ring's ranks on this host
    cross: RingTransport | None  # the ring across hosts, for hierarchical allreduce
    device_group: torch_distributed.DeviceGroup | None = None  # NCCL (or gloo) for the buffers


def connect(world: World, listener: socket.socket, secret: bytes, settings: Settings) -> Connections:
    """Connect this rank's ring in `world`, plus shared memory, a cross ring and a
    torch.distributed group where they help."""
    host_group = device_group = None
    hierarchical = settings.hierarchical and settings.transport != "tcp" and world.uniform_hosts
    transport, cross = connect_ring(world, listener, secret, timeout=settings.timeout_s,
                                    op_timeout=settings.timeout_s, cross=hierarchical)
    try:
        # gloo carries every buffer itself: shared memory would sit unused
        if (len(world.hosts) == 1 or hierarchical) and settings.torch_plane != "gloo":
            host_group = connect_host_group(world, transport.coordination, settings.transport,
                                            settings.timeout_s)
        device_group = connect_device_group(world, transport.coordination, secret, settings)
    except BaseException:
        transport.close()
        if cross is not None:
            cross.close()
        if host_group is not None:
            host_group.close()
        raise
    if host_group is None and cross is not None:  # no shared memory: the flat ring
        cross.close()
        cross = None
    return Connections(transport, host_group, cross, device_group)


# ---- TCP: the ring, the cross ring and the coordination links ------------------------------

def connect_ring(world: World, listener: socket.socket, secret: bytes, timeout: float,
                 op_timeout: float, cross: bool = False) -> tuple[RingTransport, RingTransport | None]:
    """Open this rank's ring and coordination connections (and its cross ring if `cross`),
    authenticating every one.

    The ring's order is the world's `ring_order()`: ranks host by host. The cross ring holds
    the ranks with this rank's local_rank, one per host (`cross_ring_order()`).

    Each rank connects to its right neighbour in each ring (and, except rank 0, to rank 0)
    and accepts the connection from its left neighbours (and, on rank 0, from every other
    rank). A connection that fails the handshake is dropped and does not count; the run
    goes on.
    """
    ring = world.ring_order()
    if world.size == 1:
        return RingTransport(world, ring, None, None, {}, op_timeout), None
    deadline = time.monotonic() + timeout
    rings = {"ring": ring, "cross": world.cross_ring_order()} if cross else {"ring": ring}
    neighbours = {purpose: _neighbours(world.rank, members) for purpose, members in rings.items()}
    hops = {purpose: links_to_open(world.rank, members) for purpose, members in rings.items()}
    expected = {(purpose, left) for purpose, (left, _) in neighbours.items()}
    expected |= {(f"{purpose}-hop", rank) for purpose, (_, accepts) in hops.items() for rank in accepts}
    if world.rank == 0:
        expected |= {("coord", r) for r in range(1, world.size)}
    accepted: dict[tuple[str, int], Channel] = {}
    acceptor = threading.Thread(
        target=_accept_expected, args=(listener, secret, expected, accepted, deadline), daemon=True
    )
    acceptor.start()

    def connect(rank: int, purpose: str) -> Channel:
        try:
            channel = Channel.connect(world.peers[rank].address, secret, purpose,
                                      max(0.1, deadline - time.monotonic()))
        except (OSError, AuthenticationError) as exc:
            raise PeerLostError(world.run_ranks[rank], world.peers[rank].host,
                                f"could not connect: {exc}") from exc
        channel.send(world.rank)  # tells the acceptor who we are
        return channel

    rights = {purpose: connect(right, purpose) for purpose, (_, right) in neighbours.items()}
    hop_links = {(purpose, rank): connect(rank, f"{purpose}-hop").sock
                 for purpose, (connects, _) in hops.items() for rank in connects}
    coordination = {} if world.rank == 0 else {0: connect(0, "coord")}
    acceptor.join(max(0.0, deadline - time.monotonic()))
    missing = expected - accepted.keys()
    if missing:
        kind, rank = sorted(missing)[0]
        raise PeerLostError(world.run_ranks[rank], world.peers[rank].host,
                            f"did not open its {kind} connection within {timeout:.0f} s")
    if world.rank == 0:
        coordination = {rank: accepted[("coord", rank)] for rank in range(1, world.size)}
    for (purpose, rank), channel in accepted.items():
        if purpose.endswith("-hop"):
            hop_links[purpose[:-len("-hop")], rank] = channel.sock
    transports = {
        purpose: RingTransport(world, rings[purpose], rights[purpose].sock,
                               accepted[(purpose, left)].sock,
                               coordination if purpose == "ring" else {}, op_timeout,
                               HypercubeLinks(world, rings[purpose], {
                                   rank: sock for (of, rank), sock in hop_links.items()
                                   if of == purpose}, op_timeout))
        for purpose, (left, _) in neighbours.items()
    }
    opened = len(rights) + sum(len(connects) for connects, _ in hops.values()) + (world.rank != 0)
    transports["ring"].rendezvous = RendezvousCount(opened, len(accepted))
    return transports["ring"], transports.get("cross")


def _neighbours(rank: int, members: tuple[int, ...]) -> tuple[int, int]:
    """(left, right) of `rank` in a ring of `members`."""
    position = members.index(rank)
    return members[(position - 1) % len(members)], members[(position + 1) % len(members)]


def _accept_expected(listener: socket.socket, secret: bytes, expected: set, accepted: dict,
                     deadline: float) -> None:
    """Accept until every expected (purpose, rank) connection has proved the secret.

    Each handshake runs on its own thread, so a stranger that connects and says nothing
    cannot hold up the neighbours queued behind it. The handshake that completes the set
    wakes this loop at once: `connect_ring` waits for it to end (the listener serves the
    next ring too), and every ring of a run starts with this wait.
    """
    lock = threading.Lock()
    complete = threading.Event()
    wake_loop, wake = socket.socketpair()

    def authenticate(sock: socket.socket) -> None:
        try:
            channel, purpose = Channel.accept(sock, secret, {"ring", "cross", "coord", "ring-hop",
                                                             "cross-hop"},
                                              min(HANDSHAKE_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
        except (OSError, AuthenticationError, PeerClosedError):
            return  # refused: it does not count, and the run goes on
        try:
            channel.sock.settimeout(max(0.1, deadline - time.monotonic()))
            rank = channel.recv()
            channel.sock.settimeout(None)
            if not isinstance(rank, int):
                raise ValueError(f"expected a rank, got {type(rank).__name__}")
        except Exception:  # gone, silent, or its first message is no rank: refused the same way
            channel.close()
            return
        with lock:
            if (purpose, rank) in expected and (purpose, rank) not in accepted:
                accepted[(purpose, rank)] = channel
                if expected <= accepted.keys():
                    complete.set()
                    if wake.fileno() != -1:  # (closed: the loop already gave up at the deadline)
                        wake.send(b"!")
                return
        channel.close()

    listener.settimeout(0.05)  # an accept after `select` said ready cannot block for long
    try:
        while not complete.is_set() and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([listener, wake_loop], [], [], left)
            if listener not in ready:
                continue
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, socket.timeout):
                continue  # the connection was reset before we took it
            threading.Thread(target=authenticate, args=(sock,), daemon=True).start()
    finally:
        with lock:  # no handshake is between `complete.set()` and its wake-up
            wake_loop.close()
            wake.close()


# ---- shared memory: the ranks of one host ----------------------------------------------------

def connect_host_group(world: World, coordination: dict, choice: str,
                       op_timeout: float) -> HostGroup | None:
    """Map the segments of this rank's host neighbours; None where the ranks use TCP instead.

    Every rank calls this at `init()`, right after the ring is connected. Whether shared
    memory is wanted at all follows from the peer table and `choice`, the same on every
    rank; whether it works is agreed over the coordination channels, so either every host
    uses it or none does, and `shm` that cannot work is an error on every rank.
    """
    if choice == "tcp" or len(world.hosts) == world.size:  # no host has two ranks
        return None
    exchange = over_coordination(world, coordination, op_timeout, "setting up shared memory")
    on_this_host = world.ranks_on(world.peers[world.rank].host)
    own = Segment.create() if supported() else None
    offers = gather((os.getpid(), own.fd) if own else None, exchange)
    neighbours: dict[int, Neighbour] = {}
    problem = None
    if own is None:
        problem = ("shared memory between processes needs x86-64 Linux (memfd, futex, pidfd); "
                   f"this is {os.uname().sysname} on {os.uname().machine}")
    else:
        try:
            for rank in on_this_host:
                if rank != world.rank:
                    pid, fd = offers[rank]
                    neighbours[rank] = Neighbour(rank, Segment.open(pid, fd), os.pidfd_open(pid))
        except (OSError, TypeError) as exc:
            problem = f"rank {world.rank} could not map rank {rank}'s memory on the same host: {exc}"
    problems = [p for p in gather(problem, exchange) if p]
    if own is not None:
        os.close(own.fd)  # every neighbour has mapped it (or given up): the mappings keep it alive
        own.fd = None
    if problems:
        for neighbour in neighbours.values():
            neighbour.segment.close()
            os.close(neighbour.pidfd)
        if own is not None:
            own.close()
        if choice == "shm":
            raise RuntimeError(f"{TRANSPORT_VARIABLE}=shm, but shared memory cannot be used: "
                               f"{problems[0]}. Set {TRANSPORT_VARIABLE}=auto to fall back to TCP.")
        if world.rank == 0:
            print(f"ddl_magic note: ranks on one host use TCP, not shared memory: {problems[0]}",
                  file=sys.stderr, flush=True)
        return None
    for neighbour in neighbours.values():
        os.close(neighbour.segment.fd)
        neighbour.segment.fd = None
    return HostGroup(world, on_this_host, own, neighbours, op_timeout)


# ---- torch.distributed: NCCL for CUDA buffers (gloo standing in on CPU) -----------------

def connect_device_group(world: World, coordination: dict, secret: bytes,
                         settings: Settings) -> torch_distributed.DeviceGroup | None:
    """This ring's torch.distributed group, where one is wanted and every rank can run it;
    None otherwise. Every rank decides alike: from the setting and the peer table whether to
    ask, then from every rank's abilities (`torch_distributed.choose_backend`)."""
    spans_hosts = len(world.hosts) > 1
    if not torch_distributed.wants_group(settings.torch_plane, spans_hosts, world.size):
        return None
    exchange = over_coordination(world, coordination, settings.timeout_s,
                                 "forming the torch.distributed group")
    abilities = gather(torch_distributed.Abilities.of_this_process(world.local_size)
                       if settings.torch_plane != "gloo" else None, exchange)
    backend, note = torch_distributed.choose_backend(settings.torch_plane, spans_hosts, abilities)
    if note is not None and world.rank == 0:
        print(note, file=sys.stderr, flush=True)
    if backend is None:
        return None
    return torch_distributed.form_group(world, exchange, secret, backend, settings.timeout_s)


# ---- process sets: a ring over some of the run's ranks ---------------------------------------

def process_set_world(run_peers: Sequence[Peer], rank: int, members: tuple[int, ...],
                      ports: dict[int, int]) -> World:
    """The world of a process set's ring, as rank `rank` of the run sees it: `members` (run
    ranks, ascending) numbered from 0, each at its usual address on the port its set
    listener has (`ports[rank]`, gathered over the run's ring), errors and the timeline
    still naming them by run rank."""
    peers = [Peer(index, run_peers[member].host, (run_peers[member].address[0], ports[member]))
             for index, member in enumerate(members)]
    return derive_world(members.index(rank), peers, run_ranks=members)


# ---- agreeing: every rank's small object, on every rank (`agreement.gather`) ---------------

def over_coordination(world: World, coordination: dict[int, Channel], timeout: float,
                      during: str) -> Exchange:
    """Through rank 0's coordination links, while a ring forms: every rank sends rank 0 its
    bytes, and rank 0 sends every rank the list. Each message waits at most `timeout`; a
    rank lost meanwhile is a `PeerLostError`, lost while `during`."""
    def exchange(mine: bytes) -> list[bytes]:
        channels = coordination.items()
        try:
            for _, channel in channels:
                channel.sock.settimeout(timeout)
            if world.rank != 0:
                coordination[0].send(mine)
                return coordination[0].recv()
            gathered = [mine] + [None] * (world.size - 1)
            for rank, channel in channels:
                gathered[rank] = channel.recv()
            for _, channel in channels:
                channel.send(gathered)
            return gathered
        except (OSError, EOFError, ConnectionError) as exc:
            rank = 0 if world.rank != 0 else next(iter(coordination))
            raise PeerLostError(world.run_ranks[rank], world.peers[rank].host,
                                f"lost while {during}: {exc}") from exc
        finally:
            for _, channel in channels:
                channel.sock.settimeout(None)

    return exchange


def over_op_queue(queue: OpQueue, name: str) -> Exchange:
    """Through a running ring's op queue: two allgathers named `{name}.length` and
    `{name}.payload`, negotiated, ordered and timed out like any collective."""
    def exchange(mine: bytes) -> list[bytes]:
        lengths = _allgathered(queue, f"{name}.length", torch.tensor([len(mine)], dtype=torch.int64))
        payload = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        gathered = _allgathered(queue, f"{name}.payload", payload).numpy().tobytes()
        every, start = [], 0
        for length in lengths.tolist():
            every.append(gathered[start:start + length])
            start += length
        return every

    return exchange


def _allgathered(queue: OpQueue, name: str, tensor: torch.Tensor) -> torch.Tensor:
    return queue.submit(Request.of(name, "allgather", tensor), tensor, None, wait_follows=True).wait()
