"""`scale.py --driver N`: what a barrier stage of N tasks costs the driver, measured on the
real `ControlServer` with N emulated ranks over loopback.

Each emulated rank does what `rank/worker.py` does to register (connect and prove the
secret, five clock probes, `Register`, then wait for `Start`), and each emulated task what
`rank/spark_task.py` does (connect, `TaskStarted`, then `TaskAlive` every report interval).
The numbers come from the server's own counters and from the kernel's thread count of this
process: what a notebook's kernel would carry.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from common import print_table
from ddl_magic.driver.control import ControlServer
from ddl_magic.driver.events import RankProcessState
from ddl_magic.wire.channel import Channel, new_secret
from ddl_magic.wire.liveness import report_interval_s
from ddl_magic.wire.messages import (ClockProbe, Register, RunSettings, Start, TaskAlive,
                                     TaskStarted)

CLOCK_PROBES = 5  # as rank/worker.py's _clock_offset_ns
HOSTS = 64  # emulated hosts' names, so the peer table looks like a cluster's
REPORT_SECONDS = 6.0


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _register(address, secret: bytes, rank: int) -> Channel:
    channel = Channel.connect(address, secret, "control", 60.0)
    for _ in range(CLOCK_PROBES):
        channel.send(ClockProbe())
        channel.recv()
    channel.send(Register(rank, f"host-{rank % HOSTS}", ("10.0.0.1", 20000 + rank), os.getpid(),
                          ("10.0.0.1", 29500) if rank == 0 else None))
    return channel


def measure_driver(np: int, report_seconds: float = REPORT_SECONDS) -> dict:
    """Register `np` emulated ranks with a real control server, then let their tasks report
    liveness for `report_seconds`; the server's counters, timings and threads."""
    events: queue.Queue = queue.Queue()
    secret = new_secret()
    threads_before = _threads()
    server = ControlServer(secret, np, b"task", RunSettings("scale", {}, False, False), events)
    threads_with_server = _threads()
    interval = report_interval_s(10.0)
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            ranks = list(pool.map(lambda rank: _register(server.address, secret, rank), range(np)))
            registered_s = time.perf_counter() - started
            starts = list(pool.map(lambda channel: channel.recv(), ranks))
        everyone_started_s = time.perf_counter() - started
        assert all(isinstance(start, Start) and len(start.peers) == np for start in starts)
        start_bytes = len(pickle.dumps(starts[0], protocol=pickle.HIGHEST_PROTOCOL))
        with ThreadPoolExecutor(16) as pool:
            tasks = list(pool.map(lambda rank: Channel.connect(server.address, secret, "task", 60.0),
                                  range(np)))
        for rank, task in enumerate(tasks):
            task.send(TaskStarted(rank, []))
        threads_serving = _threads()
        server_threads = sum(t.name.startswith("ddl-control") for t in threading.enumerate())
        bursts = 0
        reporting_since = time.monotonic()
        while time.monotonic() < reporting_since + report_seconds:  # every task, once per interval
            for rank, task in enumerate(tasks):
                task.send(TaskAlive(rank, "running"))
            bursts += 1
            time.sleep(max(0.0, reporting_since + bursts * interval - time.monotonic()))
        deadline = time.monotonic() + 30
        reports = 0
        while time.monotonic() < deadline and server.counters.liveness_reports < np * bursts:
            time.sleep(0.05)
        handled_within_s = time.monotonic() - reporting_since
        while not events.empty():
            reports += isinstance(events.get_nowait(), RankProcessState)
        for channel in [*ranks, *tasks]:
            channel.close()
        counters = server.counters.summary()
    finally:
        server.close()
    return {"np": np, "registration_s": registered_s, "all_started_s": everyone_started_s,
            "start_message_bytes": start_bytes,
            "server_threads": server_threads,
            "threads_started_by_the_server": threads_with_server - threads_before,
            "process_threads_added_while_serving_2n_connections": threads_serving - threads_before,
            "report_interval_s": interval, "liveness_events_relayed": reports,
            "liveness_reports_per_s": server.counters.liveness_reports / max(
                handled_within_s, bursts * interval),
            "counters": counters,
            "per_rank": {"rendezvous_messages": counters["rendezvous_messages"] / np,
                         "handshake_frames": counters["handshake_frames"] / (2 * np),
                         "clock_probes": counters["clock_probes"] / np}}


def print_driver(result: dict) -> None:
    counters = result["counters"]
    np = result["np"]
    rows = [["ranks (N)", np],
            ["connections (ranks' and tasks')", counters["connections"]],
            ["threads the server runs (serving 2N connections)", result["server_threads"]],
            ["threads in this process, more than before", result["process_threads_added_while_serving_2n_connections"]],
            ["rendezvous messages (Register in, Start out)", counters["rendezvous_messages"]],
            ["  per rank", f"{result['per_rank']['rendezvous_messages']:.1f}"],
            ["handshake frames per connection", f"{result['per_rank']['handshake_frames']:.1f}"],
            ["clock probes per rank", f"{result['per_rank']['clock_probes']:.1f}"],
            ["messages received / sent", f"{counters['messages_received']} / {counters['messages_sent']}"],
            ["Start message bytes (each rank)", result["start_message_bytes"]],
            ["all registered (s)", f"{result['registration_s']:.2f}"],
            ["all started (s)", f"{result['all_started_s']:.2f}"],
            ["liveness reports handled per second", f"{result['liveness_reports_per_s']:.0f}"],
            ["  (N / report interval)", f"{np / result['report_interval_s']:.0f}"]]
    print_table(f"the driver at N = {np} (real control server, emulated ranks over loopback)",
                ["measure", "value"], rows)
