"""The environment every launched rank sees: torchrun's contract and Horovod's.

Code written for `torchrun` reads its place from the environment (`dist.init_process_group()`
with the default `env://`, Lightning, accelerate); code written for `horovodrun` reads
`HOROVOD_RANK` and friends. A rank started by ddl_magic — `%%horovod`, HorovodRunner,
ddlrun, TorchDistributor, Spark barrier task alike — gets both, from the rendezvous:

| variable | value |
|---|---|
| `RANK`, `WORLD_SIZE` | the rank and the number of ranks |
| `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | the rank among, and the number of, ranks on its host |
| `GROUP_RANK`, `NODE_RANK`, `GROUP_WORLD_SIZE` | the host's index (hosts ordered by their lowest rank), the number of hosts |
| `ROLE_RANK`, `ROLE_WORLD_SIZE`, `ROLE_NAME` | as `RANK`, `WORLD_SIZE`; `default` |
| `MASTER_ADDR`, `MASTER_PORT` | rank 0's address and a port kept free for torch's store |
| `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS` | the run's id; how many times the whole group was restarted, and may be (`max_restarts`: 0, 0 without) |
| `HOROVOD_RANK`, `HOROVOD_SIZE`, `HOROVOD_LOCAL_RANK`, `HOROVOD_LOCAL_SIZE`, `HOROVOD_CROSS_RANK`, `HOROVOD_CROSS_SIZE`, `HOROVOD_HOSTNAME` | Horovod's names for the same |

One difference from torchrun: on Spark the ranks of one host need not be consecutive (Spark
places tasks), so `GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK` need not equal `RANK`.
"""

from __future__ import annotations

import socket

from ..runtime.world import World


def rank_environment(world: World, torch_master: tuple[str, int], run_id: str,
                     restart_count: int = 0, max_restarts: int = 0) -> dict[str, str]:
    """The variables above, for `world`'s rank.

    >>> from .runtime.world import Peer, derive_world
    >>> peers = [Peer(r, "ab"[r % 2], ("10.0.0.1", 9000 + r)) for r in range(4)]
    >>> env = rank_environment(derive_world(3, peers), ("10.0.0.1", 29500), "run-1")
    >>> [env[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")]
    ['3', '1', '2', '1', '29500']
    """
    host = world.peers[world.rank].host
    hosts = world.hosts
    values = {
        "RANK": world.rank, "WORLD_SIZE": world.size,
        "LOCAL_RANK": world.local_rank, "LOCAL_WORLD_SIZE": world.local_size,
        "GROUP_RANK": hosts.index(host), "NODE_RANK": hosts.index(host),
        "GROUP_WORLD_SIZE": len(hosts),
        "ROLE_RANK": world.rank, "ROLE_WORLD_SIZE": world.size, "ROLE_NAME": "default",
        "MASTER_ADDR": torch_master[0], "MASTER_PORT": torch_master[1],
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        "HOROVOD_RANK": world.rank, "HOROVOD_SIZE": world.size,
        "HOROVOD_LOCAL_RANK": world.local_rank, "HOROVOD_LOCAL_SIZE": world.local_size,
        "HOROVOD_CROSS_RANK": world.cross_rank, "HOROVOD_CROSS_SIZE": world.cross_size,
        "HOROVOD_HOSTNAME": host,
    }
    return {name: str(value) for name, value in values.items()}


def reserve_port() -> socket.socket:
    """A socket holding a free port on every interface (torch's store listens on all): closed
    just before the user's code runs, whose store then binds it."""
    reservation = socket.socket()
    reservation.bind(("", 0))
    return reservation
