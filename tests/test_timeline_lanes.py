"""The lane table (`ddl_magic.timeline.lanes`) against what real runs record.

Which lanes a run records depends on how its bytes move, so two small runs of two local
ranks take between them every path that records one: ranks sharing memory (the default on
one host) and the TCP ring (`DDL_MAGIC_TRANSPORT=tcp`). Each rank marks a user span around
an allreduce of two tensors (fused, so packed and unpacked), then allgathers and broadcasts.
The lanes are read back from the Chrome trace the driver wrote.
"""

from __future__ import annotations

import pytest

from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.launch.local import LocalLauncher
from ddl_magic.runtime.planes import shared_memory
from ddl_magic.timeline.lanes import LANE_ORDER
from ddl_magic.wire.tasks import FunctionTask
from trace_files import chrome_events

TRANSPORTS = ("shm", "tcp")

# Lanes that only one of the transports records: what the table's comments say of them.
SHARED_MEMORY_ONLY = {"shared_memory"}
TCP_RING_ONLY = {"scatter_reduce", "allgather", "ring_step", "broadcast", "recursive_doubling",
                 "negotiation_cycle"}


def every_kind_of_collective(steps: int) -> None:
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    for step in range(steps):
        with hvd.timeline_span("step", step=step):
            # Submitted together, the two are fused into one buffer (over a few steps, at
            # least once: a negotiation cycle could fall between the two submissions), large
            # enough for the ring over TCP; the loss is small enough for recursive doubling.
            hvd.grouped_allreduce([torch.ones(2_000_000), torch.ones(1_000)], name=f"grads.{step}")
            # Small tensors fused: unpacked from the fusion buffer on shared memory too, where
            # large ones are reduced straight into their outputs.
            hvd.grouped_allreduce([torch.ones(10), torch.ones(20)], name=f"biases.{step}")
            hvd.allreduce(torch.ones(1), name=f"loss.{step}")
        hvd.allgather(torch.ones(2, 3), name=f"shapes.{step}")
        hvd.broadcast(torch.ones(10), root_rank=0, name=f"weights.{step}")


@pytest.fixture(scope="module")
def lanes_recorded(tmp_path_factory) -> dict[str, set[str]]:
    """Transport -> the lanes its run recorded, on any rank."""
    if not shared_memory.supported():
        pytest.skip("ranks share memory only on x86-64 Linux")
    recorded = {}
    for transport in TRANSPORTS:
        path = tmp_path_factory.mktemp(transport) / "run.timeline.json"
        options = JobOptions(timeout_s=90, timeline_path=str(path), hide_output=True,
                             env={"DDL_MAGIC_TRANSPORT": transport})
        Job(FunctionTask(every_kind_of_collective, {"steps": 3}), 2, LocalLauncher(), options).run()
        recorded[transport] = {lane for _, lane, *_ in chrome_events(path)}
    return recorded


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_lane_a_run_records_is_in_the_table(lanes_recorded, transport):
    assert lanes_recorded[transport] <= set(LANE_ORDER), lanes_recorded[transport] - set(LANE_ORDER)


def test_each_transport_records_its_own_lanes_and_both_the_rest(lanes_recorded):
    shm, tcp = lanes_recorded["shm"], lanes_recorded["tcp"]
    assert SHARED_MEMORY_ONLY <= shm and not SHARED_MEMORY_ONLY & tcp, (shm, tcp)
    assert TCP_RING_ONLY <= tcp and not TCP_RING_ONLY & shm, (shm, tcp)
    assert {"user", "negotiate", "pack", "unpack"} <= shm & tcp, (shm, tcp)


def test_the_table_lists_no_lane_that_these_runs_do_not_record(lanes_recorded):
    """Between them, the two runs take every path that records a lane. The paths they leave
    out record no lane of their own: CUDA tensors (pack, shared_memory or the ring's lanes,
    unpack, as here), ranks on several hosts (shared_memory around the TCP ring's lanes),
    reduce-scatters (shared_memory, or the ring's scatter_reduce), process sets (rings of
    their own, the same lanes)."""
    recorded = lanes_recorded["shm"] | lanes_recorded["tcp"]
    assert set(LANE_ORDER) <= recorded, set(LANE_ORDER) - recorded
