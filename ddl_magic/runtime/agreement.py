"""Agreeing: every rank's small object, on every rank, over whatever moves bytes between them.

The rendezvous agrees over rank 0's coordination links or the op queue; the shared-memory
plane over its own rounds (`HostGroup.exchange`): each is an `Exchange`, and `gather`
pickles, moves and unpickles the same way for all of them.
"""

from __future__ import annotations

import pickle
from typing import Callable

Exchange = Callable[[bytes], list[bytes]]
"""Sends this rank's bytes and returns every rank's, in rank order (the same list everywhere)."""


def gather(mine: object, exchange: Exchange) -> list:
    """Every rank's `mine`, in rank order, the same list on every rank: pickled, moved by
    `exchange`, unpickled. Every rank of the ring calls it at the same point.

    >>> two_ranks_alike = lambda mine: [mine, mine]
    >>> gather(("rank", 0), two_ranks_alike)
    [('rank', 0), ('rank', 0)]
    """
    return [pickle.loads(theirs) for theirs in exchange(pickle.dumps(mine))]
