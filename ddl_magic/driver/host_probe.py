"""Is a host there at all? Asked of the hosts a run's ranks were placed on.

A rank registers with the driver seconds after its Spark task starts. When the network to its
host is down, nothing comes at all: the task was never told to start, and Spark notices only
when the executor's heartbeat times out, a minute or more later. So the first task that
starts reports where the barrier stage placed every rank (`messages.TaskStarted`), and the
driver tries to connect to each of those hosts. An answer of any kind, a connection or a
refusal, means the host is up; a host that gives none within the peer timeout is reported
(`events.HostUnanswered`) with the ranks placed on it, and the run fails naming it unless
something came from those ranks meanwhile.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

from .events import HostUnanswered


def answers(host: str, port: int, timeout_s: float) -> bool | None:
    """Does `host` answer a connection to `port` within `timeout_s`? None: its name does not
    resolve, which says nothing of the network."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True  # its kernel answered: the host is up, nothing listens on that port
    except socket.gaierror:
        return None
    except OSError:  # timed out, no route to the host, the network is unreachable
        return False
    return True


class HostProbes:
    """Probes, once per run, every host that ranks were placed on, each from a thread of its
    own, and puts a `HostUnanswered` on `events` for each host that does not answer."""

    def __init__(self, events: queue.Queue, timeout_s: float):
        self._events = events
        self._timeout_s = timeout_s
        self._started = False

    def start(self, executors: list[str]) -> None:
        """Probe the hosts of `executors` (rank order, ``host:port`` each), the first time only."""
        if self._started:
            return
        self._started = True
        placed: dict[str, tuple[int, list[int]]] = {}  # host -> (a port there, its ranks)
        for rank, executor in enumerate(executors):
            host, _, port = executor.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                return  # not an address: nothing to probe
            placed.setdefault(host.strip("[]"), (int(port), []))[1].append(rank)
        for host, (port, ranks) in placed.items():
            threading.Thread(target=self._probe, args=(host, port, ranks), daemon=True,
                             name="ddl-host-probe").start()

    def _probe(self, host: str, port: int, ranks: list[int]) -> None:
        if answers(host, port, self._timeout_s) is False:
            self._events.put(HostUnanswered(host, ranks, time.monotonic_ns()))
