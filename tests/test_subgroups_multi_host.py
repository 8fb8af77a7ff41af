"""Sub-groups and HSDP on the `ddl` backend across two hosts (`two_host_cluster.py`, Spark
barrier tasks): on 8 ranks, 4 per host, groups within a host (shared memory) and across hosts
(TCP) give the sums, gathers and reduce-scatters they must, HSDP on a 2x4 mesh trains to the
weights of one process, and a checkpoint that HSDP saved on 4 ranks loads into FSDP2 on the 8.

gloo is the reference on one host (`test_torch_subgroups.py`) but cannot run here: it connects
to the address its host name resolves to, which in a worker's namespace is 127.0.0.1.

Needs root for the namespaces; skips with the reason elsewhere. Its cluster offers 4 slots per
host, so a run of 8 has 4 on each (Spark places a run of 4 where it likes: all on one host,
at times), and starts once for the module.
"""

from __future__ import annotations

import sys

import pytest
import torch

import large_models
from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.launch.spark import SparkLauncher
from ddl_magic.wire.tasks import FunctionTask
from spark_sessions import sent_by_value
from two_host_cluster import TwoHostCluster, Unavailable

RUN_TIMEOUT_S = 180
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def spark():
    try:
        cluster = TwoHostCluster(cores_per_host=4).start()
    except Unavailable as why:
        pytest.skip(str(why))
    try:
        with pytest.MonkeyPatch.context() as patch, \
                sent_by_value(sys.modules[__name__], large_models):
            patch.setenv("PYSPARK_PYTHON", sys.executable)
            patch.setenv("SPARK_LOCAL_IP", cluster.driver_address)
            session = cluster.spark_session("ddl_magic sub-groups on two hosts", 8)
            yield session
            session.stop()
    finally:
        cluster.stop()


def run_on_cluster(function, np: int, **kwargs) -> list:
    options = JobOptions(timeout_s=RUN_TIMEOUT_S, return_all=True, hide_output=True)
    return Job(FunctionTask(function, kwargs), np, SparkLauncher(), options).run().results


def saved_by_four(path: str) -> list:
    """HSDP on 2x2, saved to `path` with DCP; the full weights."""
    return large_models.train_hsdp("ddl", checkpoint_to=path)["weights"]


def on_eight(path: str) -> dict:
    """A few collectives over a group of each host's ranks and a group across the hosts,
    HSDP on 2x4, then FSDP2 loading the checkpoint at `path`."""
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("ddl")
    rank = dist.get_rank()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    # Spark places the tasks: a group of each host's ranks, and one of each host's first rank
    # (across the hosts), created by every rank in the same order whatever the placement
    on_hosts = [[r for r, h in enumerate(hosts) if h == host] for host in dict.fromkeys(hosts)]
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in on_hosts}
    firsts = tuple(ranks[0] for ranks in on_hosts)
    groups[firsts] = dist.new_group(list(firsts))
    seen = {"hosts": hosts}
    mine = [("within_host", next(tuple(r) for r in on_hosts if rank in r))]
    if rank in firsts:
        mine.append(("across_hosts", firsts))
    for name, ranks in mine:
        group = groups[ranks]
        total = torch.tensor([rank + 1.0, 2.0 ** rank])
        dist.all_reduce(total, group=group)
        gathered = torch.zeros(2 * len(ranks))
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), group=group)
        part = torch.zeros(1)
        dist.reduce_scatter_tensor(part, torch.arange(float(len(ranks))) * (rank + 1), group=group)
        seen[name] = {"ranks": ranks, "sum": total.tolist(), "gathered": gathered.tolist(),
                      "reduce_scattered": part.tolist()}
    seen["hsdp"] = large_models.train_hsdp("ddl")["weights"]
    seen["loaded"] = _loaded(path)
    return seen


def _loaded(path: str) -> list:
    """FSDP2 over every rank loads the HSDP model that 4 ranks saved."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = large_models.block_model()
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return large_models.full_weights(model)


@pytest.mark.timeout(420)  # the cluster (~30 s, more under load) and two Spark runs
def test_sub_groups_and_hsdp_across_two_hosts_and_a_checkpoint_of_4_ranks_loads_on_8(spark, tmp_path):
    path = str(tmp_path / "hsdp")
    saved = run_on_cluster(saved_by_four, 4, path=path)[0]
    over_ddl = run_on_cluster(on_eight, 8, path=path)
    hosts = over_ddl[0]["hosts"]
    assert sorted(hosts.count(host) for host in set(hosts)) == [4, 4], hosts
    assert sum("across_hosts" in seen for seen in over_ddl) == 2  # each host's first rank
    alone = large_models.train_alone()
    for rank, seen in enumerate(over_ddl):
        for name in ("within_host", "across_hosts")[:1 + ("across_hosts" in seen)]:
            ranks = list(seen[name]["ranks"])
            assert seen[name]["sum"] == [sum(r + 1.0 for r in ranks), sum(2.0 ** r for r in ranks)]
            assert seen[name]["gathered"] == [float(r) for r in ranks for _ in range(2)]
            # the group's sum of arange(n) * (r + 1); this rank keeps element (its place)
            place = ranks.index(rank)
            assert seen[name]["reduce_scattered"] == [place * sum(r + 1.0 for r in ranks)]
        for got, expected in zip(seen["hsdp"], alone):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        for got, expected in zip(seen["loaded"], saved):
            assert torch.equal(got, expected)
