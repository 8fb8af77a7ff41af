"""Feeding a display events as the driver does, for tests that drive one by hand.

A display renders the run's records (one `RankRecord` per rank); the driver's watcher
applies each event to its rank's record, then hands the event to the display. `Fed` does
the same for a test.
"""

from __future__ import annotations

from ddl_magic.driver.events import GroupRestarted, WorldReset
from ddl_magic.driver.records import RankRecord, new_records


class Fed:
    """A display and its records: `handle(event)` applies the event to its rank's record
    first (an event for a rank the run does not have is the display's to refuse), then
    hands it on; everything else is the display's own."""

    def __init__(self, display, records: list[RankRecord]) -> None:
        self.inner = display
        self.records = records

    def handle(self, event) -> None:
        if not isinstance(event, (WorldReset, GroupRestarted)) and 0 <= event.rank < len(self.records):
            self.records[event.rank].apply(event)
        self.inner.handle(event)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def fed(make_display, np: int, log_dir: str | None = None) -> Fed:
    """`make_display(records)` for `np` fresh records, fed as the driver feeds it."""
    records = new_records(np, log_dir)
    return Fed(make_display(records), records)
