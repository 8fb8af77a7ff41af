"""Recursive doubling against the ring on real ranks over TCP: the same tensors reduced both
ways give the same results (bitwise for integer sums) at N = 2..9, powers of two or not, in
process sets, and on the cross-host step of the hierarchical allreduce.

One run of 9 ranks covers N = 9 (every rank) and N = 2..8 (process sets of the lowest
ranks, plus a set of scattered ranks); a second run of 6 ranks on 3 simulated hosts covers
the hierarchical allreduce, whose step between hosts runs over a cross ring of 3. Each rank
switches its planes between the two algorithms at the same point of its program (no
collective in flight), which is how a test can run one tensor through both.
"""

from __future__ import annotations


from ranks import run_on_ranks

CASES = [("int64", "Sum"), ("int32", "Sum"), ("uint8", "Max"), ("float32", "Sum"),
         ("float64", "Average"), ("float32", "Min")]
ALWAYS, NEVER = 1 << 62, -1


def both_ways(hvd, process_set, planes_switch) -> list[str]:
    """Reduce each case's tensor with the ring and with recursive doubling; what differs."""
    import torch

    failures = []
    rank = hvd.rank()
    for index, (dtype_name, op_name) in enumerate(CASES):
        dtype, op = getattr(torch, dtype_name), getattr(hvd, op_name)
        generator = torch.Generator().manual_seed(1000 * rank + index)
        if dtype.is_floating_point:
            tensor = torch.randn(1001, generator=generator, dtype=dtype)
        else:
            tensor = torch.randint(0, 100, (1001,), generator=generator).to(dtype)
        results = []
        for switch in (NEVER, ALWAYS):  # the ring, then recursive doubling
            planes_switch(switch)
            results.append(hvd.allreduce(tensor, op=op, process_set=process_set,
                                         name=f"{dtype_name}.{op_name}.{switch}"))
        ring, doubling = results
        same = (torch.equal(ring, doubling) if not dtype.is_floating_point
                else torch.allclose(ring, doubling, rtol=1e-5, atol=1e-6))
        if not same:
            failures.append(f"{dtype_name} {op_name} over {process_set.ranks}: differs by "
                            f"{(ring.double() - doubling.double()).abs().max().item()}")
    planes_switch(None)
    return failures


def flat_rings() -> dict:
    import math

    import ddl_magic.torch as hvd

    hvd.init()
    sets = {hvd.size(): hvd.global_process_set}
    for size in range(2, hvd.size()):
        sets[size] = hvd.add_process_set(list(range(size)))
    sets["scattered"] = hvd.add_process_set([1, 4, 6, 7, 8])
    report = {}
    for label, process_set in sets.items():
        if not process_set.included():
            continue
        plane = process_set.runtime("test").queue._runner.plane
        assert plane.name == "tcp", plane.name
        auto = plane.switch_bytes

        def switch_to(value, plane=plane, auto=auto):
            plane.switch_bytes = auto if value is None else value

        report[label] = both_ways(hvd, process_set, switch_to)
        report[f"{label} picks recursive doubling for 8 KB"] = [] if auto >= 8008 else [auto]
    import torch

    for _ in range(3):  # a named tensor, again and again: cached after the first time
        hvd.allreduce(torch.ones(1), name="loss")
    # an optimizer given no names names its parameters by position: cached from step 2
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    coordinated = []
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        coordinated.append(hvd.negotiation_counters()["coordinated_cycles"])
    report["unnamed parameters cached"] = [] if coordinated[1] == coordinated[2] else coordinated
    counters = hvd.negotiation_counters()  # every rank's cycles, as a user reads them
    cached = counters["cached"]
    report["counters"] = [] if (cached["cycles"] > 0 and 0 < cached["messages_received_per_cycle"] <= 6
                                and counters["coordinated_cycles"] > 0) else [counters]
    # forming the ring: its two neighbours, at most log2 N + 1 hypercube partners, and rank
    # 0's coordination links (N - 1 on rank 0, one on every other rank)
    rendezvous, size = counters["rendezvous"], hvd.size()
    links = rendezvous["connections_opened"] + rendezvous["connections_accepted"]
    bound = 2 + math.ceil(math.log2(size)) + 1 + (size - 1 if hvd.rank() == 0 else 1)
    report["rendezvous"] = [] if (0 < links <= bound and rendezvous["frames"] == 4 * links and (
        hvd.rank() or rendezvous["connections_accepted"] >= size - 1)) else [rendezvous]
    hvd.shutdown()
    return report


def hierarchical() -> dict:
    import ddl_magic.torch as hvd

    hvd.init()
    plane = hvd.global_process_set.runtime("test").queue._runner.plane
    assert plane.name == "shm+tcp" and plane.cross.size == 3, plane.name
    auto = plane.cross_switch_bytes

    def switch_to(value):
        plane.cross_switch_bytes = auto if value is None else value

    report = {"cross-host step": both_ways(hvd, hvd.global_process_set, switch_to)}
    hvd.shutdown()
    return report


def test_recursive_doubling_equals_the_ring_for_n_2_to_9_and_in_process_sets():
    reports = run_on_ranks(flat_rings, 9, timeout_s=240, env={"DDL_MAGIC_TRANSPORT": "tcp"})
    failures = {(rank, label): failed for rank, report in enumerate(reports)
                for label, failed in report.items() if failed}
    assert failures == {}
    assert "scattered" in reports[8]
    assert {label for label in reports[0] if not isinstance(label, str)} == set(range(2, 10))


def test_recursive_doubling_equals_the_ring_across_hosts_of_a_hierarchical_allreduce(monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_TEST_HOSTS", "a,a,b,b,c,c")  # read as the ranks register
    reports = run_on_ranks(hierarchical, 6, timeout_s=240)
    assert all(report == {"cross-host step": []} for report in reports), reports
