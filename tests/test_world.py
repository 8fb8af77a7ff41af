"""local/cross ranks derived from the hosts ranks registered from."""

from ddl_magic.runtime.world import Peer, derive_world


def peers(*hosts):
    return [Peer(rank, host, (host, 1000 + rank)) for rank, host in enumerate(hosts)]


def test_one_host_numbers_ranks_locally():
    world = derive_world(2, peers("a", "a", "a"))
    assert (world.local_rank, world.local_size, world.cross_rank, world.cross_size) == (2, 3, 0, 1)


def test_two_hosts_interleaved():
    table = peers("a", "b", "a", "b")
    assert [(derive_world(r, table).local_rank, derive_world(r, table).cross_rank)
            for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert derive_world(3, table).cross_size == 2


def test_uneven_hosts_cross_size_counts_hosts_with_that_local_rank():
    table = peers("a", "a", "b")
    assert derive_world(1, table).cross_size == 1  # only host a has a local_rank 1
    assert derive_world(2, table).cross_size == 2
