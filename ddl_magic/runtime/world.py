"""Who is who in a run: every rank's address, and the local/cross numbering derived from hosts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """One rank as the others see it: where it runs and where its ring listener waits."""

    rank: int
    host: str
    address: tuple[str, int]


@dataclass(frozen=True)
class World:
    """This rank's place among all ranks of a run.

    ``local_rank``/``local_size`` number the ranks on this rank's host; ``cross_rank``/
    ``cross_size`` number the hosts, ordered by their lowest rank (Horovod's definitions:
    ranks with the same local_rank on different hosts form one cross communicator).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    peers: tuple[Peer, ...]
    # Each rank's rank in the run: itself, except in a process set's ring (numbered 0..size-1
    # within the set), where errors and the timeline still name ranks as the user knows them.
    run_ranks: tuple[int, ...]

    @property
    def hosts(self) -> list[str]:
        """The run's hosts, in the order of their lowest rank."""
        return list(dict.fromkeys(peer.host for peer in self.peers))

    def ranks_on(self, host: str) -> list[int]:
        """The ranks the rendezvous saw on `host`, in rank order."""
        return [peer.rank for peer in self.peers if peer.host == host]

    def ring_order(self) -> tuple[int, ...]:
        """Every rank, host by host: the ring then crosses between hosts only once per host.

        Spark may place ranks 0 and 2 on one host and 1 and 3 on another; in rank order every
        hop of the ring would cross hosts (Horovod orders its ring by host for the same reason).

        >>> peers = [Peer(r, "ab"[r % 2], ("x", r)) for r in range(4)]
        >>> derive_world(0, peers).ring_order()
        (0, 2, 1, 3)
        """
        if not self.peers:
            return (self.rank,)
        return tuple(rank for host in self.hosts for rank in self.ranks_on(host))

    def cross_ring_order(self) -> tuple[int, ...]:
        """The ranks with this rank's local_rank, one per host, host by host."""
        on_hosts = [self.ranks_on(host) for host in self.hosts]
        return tuple(on_host[self.local_rank] for on_host in on_hosts if self.local_rank < len(on_host))

    @property
    def homogeneous(self) -> bool:
        """Every host runs the same number of ranks (Horovod's `is_homogeneous`).

        >>> derive_world(0, [Peer(r, "aab"[r], ("x", r)) for r in range(3)]).homogeneous
        False
        """
        return len({len(self.ranks_on(host)) for host in self.hosts}) <= 1

    @property
    def uniform_hosts(self) -> bool:
        """Several hosts, each with the same number (more than one) of ranks."""
        return len(self.hosts) > 1 and self.homogeneous and self.local_size > 1


def derive_world(rank: int, peers: list[Peer], run_ranks: tuple[int, ...] | None = None) -> World:
    """Number ranks within their host and hosts within the run.

    >>> peers = [Peer(0, "a", ("a", 1)), Peer(1, "b", ("b", 1)), Peer(2, "a", ("a", 2))]
    >>> w = derive_world(2, peers)
    >>> (w.local_rank, w.local_size, w.cross_rank, w.cross_size)
    (1, 2, 0, 1)
    """
    hosts_in_order = list(dict.fromkeys(p.host for p in sorted(peers, key=lambda p: p.rank)))
    host = peers[rank].host
    same_host = [p.rank for p in peers if p.host == host]
    local_rank = same_host.index(rank)
    # Horovod: cross_rank is this host's index among the hosts that have a rank with our local_rank.
    hosts_with_local_rank = [
        h for h in hosts_in_order if local_rank < sum(1 for p in peers if p.host == h)
    ]
    return World(
        rank=rank,
        size=len(peers),
        local_rank=local_rank,
        local_size=len(same_host),
        cross_rank=hosts_with_local_rank.index(host),
        cross_size=len(hosts_with_local_rank),
        peers=tuple(peers),
        run_ranks=tuple(range(len(peers))) if run_ranks is None else run_ranks,
    )


def single_process_world() -> World:
    """The world of a script run without a launcher: one rank, no network."""
    return World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1, peers=(),
                 run_ranks=(0,))
