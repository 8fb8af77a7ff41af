"""Process sets on real ranks: collectives over subsets of several shapes, on shared memory,
on the TCP ring and on both (ranks spread over simulated hosts), with autograd, the
DistributedOptimizer, adding at init(), removing, and every refusal.

Each check runs on every rank and returns a list of failures (empty when it holds), as in
test_horovod_api.py; one run per setup serves every check.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ranks import failures_of, reports_per_setup

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8]


def values(rank: int, dtype: torch.dtype, rows: int = 3) -> torch.Tensor:
    """A rank's own small tensor (exact in every dtype, also summed over 4 ranks)."""
    return (torch.arange(rows * 2).reshape(rows, 2) % 5 + rank).to(dtype)


@contextlib.contextmanager
def evens_and_odds(hvd):
    """The set of even ranks, the set of odd ranks and this rank's; removed again after."""
    size = hvd.size()
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    try:
        yield evens, odds, (evens if hvd.rank() % 2 == 0 else odds)
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


def check_every_collective_over_evens_and_odds(hvd):
    failures = []
    if hvd.size() < 2:  # the only set is the global one
        return failures
    with evens_and_odds(hvd) as (evens, odds, mine):
        rank, members = hvd.rank(), mine.ranks
        if (mine.size(), mine.rank(), mine.included()) != (len(members), members.index(rank), True):
            failures.append(f"{mine}: size {mine.size()}, rank {mine.rank()}, included {mine.included()}")
        other = odds if mine is evens else evens
        if other.included() or other.rank() is not None:
            failures.append(f"{other} says it includes rank {rank}")
        for dtype in DTYPES:
            summed = hvd.allreduce(values(rank, dtype), op=hvd.Sum, process_set=mine)
            expected = sum(values(r, torch.float64) for r in members).to(dtype)
            if not torch.equal(summed, expected):
                failures.append(f"allreduce {dtype}: {summed.tolist()} != {expected.tolist()}")
            gathered = hvd.allgather(values(rank, dtype, rows=rank % 3 + 1), process_set=mine)
            if not torch.equal(gathered, torch.cat([values(r, dtype, rows=r % 3 + 1) for r in members])):
                failures.append(f"allgather {dtype}: {gathered.tolist()}")
            root = members[-1]
            sent = hvd.broadcast(values(rank, dtype), root_rank=root, process_set=mine)
            if not torch.equal(sent, values(root, dtype)):
                failures.append(f"broadcast {dtype} from rank {root}: {sent.tolist()}")
        in_place = torch.full((4,), float(rank))
        hvd.allreduce_(in_place, op=hvd.Max, process_set=mine)
        if in_place.tolist() != [float(max(members))] * 4:
            failures.append(f"allreduce_ Max: {in_place.tolist()}")
        averaged = hvd.synchronize(hvd.allreduce_async(torch.tensor([float(rank)]), process_set=mine))
        if averaged.item() != sum(members) / len(members):
            failures.append(f"allreduce_async Average: {averaged.item()}")
        grouped = hvd.grouped_allreduce([torch.ones(2) * rank, torch.ones(3)], op=hvd.Sum,
                                        process_set=mine)
        if [g.tolist() for g in grouped] != [[float(sum(members))] * 2, [float(len(members))] * 3]:
            failures.append(f"grouped_allreduce: {[g.tolist() for g in grouped]}")
        rows = 2 * len(members) + 1
        scattered = hvd.reducescatter(torch.arange(rows * 2.0).reshape(rows, 2) + rank, op=hvd.Sum,
                                      process_set=mine)
        total = sum(torch.arange(rows * 2.0).reshape(rows, 2) + r for r in members)
        position = members.index(rank)
        start = position * 2 + min(position, 1)
        if not torch.equal(scattered, total[start:start + 2 + (position < 1)]):
            failures.append(f"reducescatter: {scattered.tolist()}")
        splits = [members.index(rank) + 1] * len(members)  # every member sends its position + 1 rows
        received, counts = hvd.alltoall(torch.full((sum(splits), 1), rank), splits, process_set=mine)
        # rank r sends each member (its own position + 1) rows of r
        expected = torch.cat([torch.full((members.index(r) + 1, 1), r) for r in members])
        if not torch.equal(received, expected) or counts.tolist() != [members.index(r) + 1 for r in members]:
            failures.append(f"alltoall: {received.flatten().tolist()} {counts.tolist()}")
        obj = hvd.broadcast_object({"from": rank} if rank == members[0] else None,
                                   root_rank=members[0], process_set=mine)
        if obj != {"from": members[0]}:
            failures.append(f"broadcast_object: {obj}")
        if hvd.allgather_object(rank, process_set=mine) != members:
            failures.append("allgather_object")
        hvd.barrier(process_set=mine)
    return failures


def check_async_grouped_and_in_place_forms_over_a_set(hvd):
    failures = []
    if hvd.size() < 2:
        return failures
    with evens_and_odds(hvd) as (evens, odds, mine):
        rank, members = hvd.rank(), mine.ranks
        n, position = len(members), members.index(rank)

        def expect(what, got, wanted):
            if not torch.equal(got, wanted):
                failures.append(f"{what}: {got.tolist()} != {wanted.tolist()}")

        handles = {
            "allgather_async": hvd.allgather_async(torch.full((rank + 1,), rank), process_set=mine),
            "grouped_allgather_async": hvd.grouped_allgather_async(
                [torch.tensor([rank]), torch.full((1, 2), rank)], process_set=mine),
            "reducescatter_async": hvd.reducescatter_async(torch.ones(n, 2) * rank, op=hvd.Sum,
                                                           process_set=mine),
            "grouped_allreduce_async": hvd.grouped_allreduce_async(
                [torch.tensor([1.0]), torch.tensor([rank])], op=hvd.Sum, process_set=mine),
            "alltoall_async": hvd.alltoall_async(torch.arange(n) + 10 * rank, process_set=mine),
        }
        in_place = torch.tensor([float(rank)])
        handles["broadcast_async_"] = hvd.broadcast_async_(in_place, root_rank=members[-1],
                                                           process_set=mine)
        results = {name: hvd.synchronize(handle) for name, handle in handles.items()}
        expect("allgather_async", results["allgather_async"],
               torch.cat([torch.full((r + 1,), r) for r in members]))
        gathered = results["grouped_allgather_async"]
        expect("grouped_allgather_async 0", gathered[0], torch.tensor(members))
        expect("grouped_allgather_async 1", gathered[1], torch.cat([torch.full((1, 2), r) for r in members]))
        expect("reducescatter_async", results["reducescatter_async"], torch.ones(1, 2) * sum(members))
        summed = results["grouped_allreduce_async"]
        expect("grouped_allreduce_async", torch.cat(summed), torch.tensor([float(n), sum(members)]))
        received, _ = results["alltoall_async"]
        expect("alltoall_async", received, torch.tensor([10 * r + position for r in members]))
        expect("broadcast_async_", in_place, torch.tensor([float(members[-1])]))
        tensors = [torch.tensor([1.0]), torch.tensor([2.0 * rank])]
        hvd.grouped_allreduce_(tensors, op=hvd.Sum, process_set=mine)
        expect("grouped_allreduce_", torch.cat(tensors), torch.tensor([float(n), 2.0 * sum(members)]))
        scattered = hvd.grouped_reducescatter([torch.ones(n, 1) * rank, torch.ones(n) * 2],
                                              op=hvd.Sum, process_set=mine)
        expect("grouped_reducescatter", torch.cat([scattered[0].flatten(), scattered[1]]),
               torch.tensor([float(sum(members)), 2.0 * n]))
        sparse = torch.sparse_coo_tensor([[rank % 3]], [1.0], (3,))
        reduced = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Sum, process_set=mine)()
        expect("sparse_allreduce_async", reduced.to_dense(),
               sum(torch.sparse_coo_tensor([[r % 3]], [1.0], (3,)).to_dense() for r in members))
    return failures


def check_gradients_flow_within_the_set(hvd):
    failures = []
    if hvd.size() < 2:
        return failures
    with evens_and_odds(hvd) as (evens, odds, mine):
        rank, members = hvd.rank(), mine.ranks
        x = torch.ones(3, requires_grad=True)
        hvd.allreduce(x * (rank + 1), op=hvd.Sum, process_set=mine).sum().backward()
        if x.grad.tolist() != [float(len(members) * (rank + 1))] * 3:
            failures.append(f"allreduce gradient {x.grad.tolist()}")
        x = torch.ones(2, requires_grad=True)
        gathered = hvd.allgather(x * (rank + 1), process_set=mine)
        (gathered * torch.arange(1.0, 2 * len(members) + 1)).sum().backward()
        position = members.index(rank)
        # Horovod's allgather gradient: the set's average of each rank's slice of the incoming gradient
        expected = [(rank + 1) * (2 * position + 1.0), (rank + 1) * (2 * position + 2.0)]
        if x.grad.tolist() != expected:
            failures.append(f"allgather gradient {x.grad.tolist()} != {expected}")
        x = torch.ones(2, requires_grad=True)
        hvd.broadcast(x * 2, root_rank=members[0], process_set=mine).sum().backward()
        if x.grad.tolist() != ([2.0, 2.0] if rank == members[0] else [0.0, 0.0]):
            failures.append(f"broadcast gradient {x.grad.tolist()}")
    return failures


def check_overlapping_sets_and_unnamed_calls_count_per_set(hvd):
    """Sets may share ranks; each set numbers its unnamed calls on its own, so members
    making different numbers of them on different sets leaves every ring in step."""
    failures = []
    size = hvd.size()
    if size < 3:
        return failures
    left, right = hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])
    ends = hvd.add_process_set([0, size - 1])
    # 2 unnamed calls over [0, 1], 3 over [1, 2]: ranks 0, 1 and 2 make 2, 5 and 3 of them
    for process_set, calls in ((left, 2), (right, 3)):
        for _ in range(calls if process_set.included() else 0):
            got = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=process_set)
            if got.item() != 2.0:
                failures.append(f"{process_set}: {got.item()}")
    handles = []
    if ends.included():  # one name in flight on two rings at once
        handles.append(hvd.allreduce_async(torch.tensor([1.0]), name="same", op=hvd.Sum,
                                           process_set=ends))
    handles.append(hvd.allreduce_async(torch.tensor([1.0]), name="same", op=hvd.Sum))
    got = [hvd.synchronize(handle).item() for handle in handles]
    if got != ([2.0] if ends.included() else []) + [float(size)]:
        failures.append(f"one name on two rings: {got}")
    if hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() != size:
        failures.append("the global ring's unnamed calls went out of step")
    if right.included():  # errors name ranks as the run numbers them, not within the set
        try:
            hvd.allreduce(torch.ones(hvd.rank()), name="mismatch", process_set=right)
            failures.append("a mismatch over [1, 2] went unnoticed")
        except Exception as exc:
            if "between ranks [1, 2]" not in str(exc):
                failures.append(f"the mismatch over [1, 2] says: {exc}")
    for process_set in (left, right, ends):
        if hvd.remove_process_set(process_set) is not True:
            failures.append(f"remove_process_set({process_set}) did not say True")
    return failures


def check_distributed_optimizer_over_a_set(hvd):
    """Members average their gradients; a rank outside the set steps on its own (Horovod)."""
    failures = []
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        return failures
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters(),
                                         process_set=evens)

    def gradients(r):
        local = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for p, s in zip(local.parameters(), start):
                p.copy_(s)
        local(torch.full((1, 3), float(r + 1))).sum().backward()
        return [p.grad for p in local.parameters()]

    model(torch.full((1, 3), float(rank + 1))).sum().backward()
    optimizer.step()
    averaged_over = evens.ranks if rank in evens.ranks else [rank]
    expected = [s - 0.5 * sum(g) / len(averaged_over)
                for s, g in zip(start, zip(*(gradients(r) for r in averaged_over)))]
    if not all(torch.allclose(p, e) for p, e in zip(model.parameters(), expected)):
        failures.append(f"rank {rank} stepped to {[p.tolist() for p in model.parameters()]}")
    hvd.remove_process_set(evens)
    return failures


def check_refusals(hvd):
    failures = []
    rank, size = hvd.rank(), hvd.size()

    def refused(call, error, words, attempt):
        try:
            attempt()
            failures.append(f"{call} was accepted")
        except error as exc:
            if not all(word in str(exc) for word in words):
                failures.append(f"{call}: {exc}")

    refused("a duplicate of the global set", ValueError, ["duplicate process set"],
            lambda: hvd.add_process_set(list(range(size))))
    refused("a rank outside the run", ValueError, ["must be distinct ranks of this run"],
            lambda: hvd.add_process_set([0, size]))
    refused("a string", TypeError, ["must be a ProcessSet"],
            lambda: hvd.allgather(torch.ones(1), process_set="all"))
    refused("a set never added", ValueError, ["is not added"],
            lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([rank])))
    refused("init(comm=...)", NotImplementedError, ["does not use MPI"],
            lambda: hvd.init(comm=object()))
    if size < 2:
        return failures
    first = hvd.add_process_set([0])
    refused("a duplicate set", ValueError, ["duplicate process set"], lambda: hvd.add_process_set([0]))
    if rank != 0:
        refused("a collective outside the set", ValueError, [f"rank {rank} is not in", "[0]"],
                lambda: hvd.allreduce(torch.ones(1), process_set=first))
    else:
        refused("a root outside the set", ValueError, ["root_rank 1 is not a rank of", "[0]"],
                lambda: hvd.broadcast(torch.ones(1), root_rank=1, process_set=first))
    refused("sharding over a set", NotImplementedError, ["leave process_set out"],
            lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                                             lr=0.1),
                                             process_set=first, shard_optimizer_state=True))
    if hvd.remove_process_set(first) is not True or hvd.remove_process_set(first) is not False:
        failures.append("remove_process_set does not say True, then False")
    if hvd.remove_process_set(hvd.global_process_set) is not False:
        failures.append("the global set was removed")
    refused("a removed set", ValueError, ["is not added (or was removed)"],
            lambda: hvd.allreduce(torch.ones(1), process_set=first))
    # ranks that disagree: every rank refuses, and the run's ring goes on
    refused("sets that differ between ranks", ValueError,
            ["every rank must add the same sets", "rank 0 added [0]"],
            lambda: hvd.add_process_set([0] if rank == 0 else [0, 1]))
    if hvd.allreduce(torch.ones(1), op=hvd.Sum).item() != size:
        failures.append("the global ring does not work after a refused add")
    return failures


def check_sets_given_to_init_and_forgotten_at_shutdown(hvd):
    failures = []
    size, rank = hvd.size(), hvd.rank()
    if size < 2:
        return failures
    older = hvd.add_process_set([0])
    hvd.shutdown()
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(list(range(1, size)))
    hvd.init(process_sets=[first, rest])
    if (first.process_set_id, rest.process_set_id) != (1, 2):
        failures.append(f"ids {first.process_set_id}, {rest.process_set_id}")
    if older.process_set_id is not None:
        failures.append("a set from before shutdown() still has an id")
    mine = first if rank == 0 else rest
    if hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine).item() != mine.size():
        failures.append("a set given to init() does not reduce")
    try:
        hvd.allreduce(torch.ones(1), process_set=older)
        failures.append("a set from before shutdown() still runs")
    except ValueError:
        pass
    return failures


CHECKS = [check_every_collective_over_evens_and_odds,
          check_async_grouped_and_in_place_forms_over_a_set, check_gradients_flow_within_the_set,
          check_overlapping_sets_and_unnamed_calls_count_per_set,
          check_distributed_optimizer_over_a_set, check_refusals,
          check_sets_given_to_init_and_forgotten_at_shutdown]


def run_all_checks():
    import ddl_magic.torch as hvd

    hvd.init()
    report = {}
    for check in CHECKS:
        try:
            report[check.__name__] = check(hvd)
        except Exception as exc:  # reported per check, not as the whole run's failure
            report[check.__name__] = [f"raised {type(exc).__name__}: {exc}"]
    hvd.shutdown()
    return report


# (np, the host of each rank or None for this one): sets of one on shared memory; sets of
# one and two; two simulated hosts, where the even set shares memory on host a, the odd set
# on host b, and [0, 1] and [1, 2] cross between hosts over TCP.
SETUPS = [(1, None), (2, None), (3, None), (4, "a,b,a,b")]


@pytest.fixture(scope="module")
def reports():
    return reports_per_setup(run_all_checks, timeout_s=90)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
@pytest.mark.parametrize("np, hosts", SETUPS)
def test_process_sets(reports, np, hosts, check):
    assert failures_of(reports(np, hosts), check) == {}
