"""What the elastic loop catches and raises, under the names Horovod's users import.

Horovod keeps these in `horovod.common.exceptions`; ported code finds them here as
`hvd.elastic.HostsUpdatedInterrupt` and `hvd.HorovodInternalError` (also
`hvd.elastic.HorovodInternalError`).
"""

from __future__ import annotations

import enum

from ...runtime.errors import HorovodInternalError


class HostUpdateResult(enum.IntFlag):
    """What changed in the run's hosts, as the driver announces it (Horovod's flags)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class HostsUpdatedInterrupt(RuntimeError):
    """The driver announced that hosts were added or will be removed: re-form the ring at
    this point, keeping the current state (nothing is rolled back).

    `skip_sync`: the ranks that stay already hold the same state and no rank joins (hosts
    were only removed), so the state need not be broadcast again.
    """

    def __init__(self, skip_sync: bool):
        super().__init__("the run's hosts changed: the ring is re-formed at this commit"
                         + (" (ranks only left)" if skip_sync else ""))
        self.skip_sync = skip_sync


class RankRetired(RuntimeError):
    """The driver left this rank out of the next world (its host is blacklisted, or the run
    has more ranks than `max_np`): the rank's part in the run is over, and it is no failure.

    Raised out of the `hvd.elastic.run` function; the worker that runs the rank reports it
    as retired rather than failed.
    """


class ElasticRunFailed(RuntimeError):
    """The run cannot go on: the driver refused to form a new world (fewer than `min_np`
    ranks after its wait, every host blacklisted), or the reset limit was reached. The
    message says why and what would let it go on."""


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "RankRetired",
           "ElasticRunFailed"]
