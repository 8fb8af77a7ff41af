"""Host-update notices from the driver, delivered to the elastic states that are running.

Horovod runs a notification service in every worker; here the rank's control channel
already reaches the driver, so the worker's thread that reads it calls
`notify_hosts_updated` when the driver announces a host change. The notice waits in each
running state until its next `commit()` or `check_host_updates()`, where every rank agrees
on it before any raises `HostsUpdatedInterrupt`.
"""

from __future__ import annotations

import threading
from typing import Protocol

from .exceptions import HostUpdateResult


class HostUpdateListener(Protocol):
    def on_hosts_updated(self, timestamp: float, result: HostUpdateResult) -> None:
        ...


class HostUpdateNotices:
    """The states inside a running `hvd.elastic.run` function, and the notices sent to them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners: list[HostUpdateListener] = []

    def register(self, listener: HostUpdateListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: HostUpdateListener) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def notify(self, timestamp: float, result: HostUpdateResult) -> None:
        with self._lock:
            listeners = self._listeners[:]
        for listener in listeners:
            listener.on_hosts_updated(timestamp, result)


notices = HostUpdateNotices()


def notify_hosts_updated(timestamp: float, result: HostUpdateResult) -> None:
    """Tell the running states that the driver changed the run's hosts at `timestamp`
    (seconds, increasing with each change). Safe to call from any thread.

    >>> notify_hosts_updated(time.time(), HostUpdateResult.added)  # doctest: +SKIP
    """
    notices.notify(timestamp, HostUpdateResult(result))
