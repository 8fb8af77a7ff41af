"""Every collective's values against a locally computed expectation, on 1 to 4 real ranks,
over each transport: shared memory (the default between ranks on one host), the TCP ring, and
both at once when the ranks look like several hosts (`DDL_MAGIC_TEST_HOSTS`, the host of each
rank): hierarchical allreduce on 2 hosts x 2 ranks, the flat ring on uneven hosts.

Each setup is launched once (processes are the expensive part); every rank runs all the
checks below and reports which failed, so each check still passes or fails on its own.
"""

import os

import pytest
import torch

from ranks import run_on_ranks

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 1001]  # empty, fewer elements than ranks, odd sizes


def rank_input(rank, numel, dtype, op_name="sum"):
    """What `rank` contributes: small values, so sums and products are exact in every dtype."""
    base = torch.arange(numel, dtype=torch.int64)
    values = (base + rank) % 2 + 1 if op_name == "product" else (base * 3 + rank * 5) % 11
    return values.to(dtype)


def expected_reduction(size, numel, dtype, op_name):
    inputs = torch.stack([rank_input(r, numel, dtype, op_name).to(torch.float64)
                          for r in range(size)])
    if op_name == "sum":
        return inputs.sum(0)
    if op_name == "average":
        mean = inputs.sum(0) / size
        return mean if dtype.is_floating_point else mean.trunc()
    if op_name == "min":
        return inputs.min(0).values
    if op_name == "max":
        return inputs.max(0).values
    return inputs.prod(0)


def close(actual, expected, dtype):
    tolerance = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-6}.get(dtype, 1e-9)
    return actual.dtype == dtype and torch.allclose(actual.to(torch.float64), expected,
                                                    rtol=tolerance, atol=tolerance)


def check_allreduce(hvd):
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
           "product": hvd.Product}
    failures = []
    for dtype in DTYPES:
        for numel in SIZES:
            for op_name, op in ops.items():
                mine = rank_input(hvd.rank(), numel, dtype, op_name)
                result = hvd.allreduce(mine, op=op)
                if not close(result, expected_reduction(hvd.size(), numel, dtype, op_name), dtype):
                    failures.append(f"{op_name} {dtype} numel={numel}: {result[:8].tolist()}")
    return failures


def check_allreduce_in_place_and_scaling(hvd):
    failures = []
    tensor = rank_input(hvd.rank(), 33, torch.float32)
    hvd.allreduce_(tensor, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    if not close(tensor, expected_reduction(hvd.size(), 33, torch.float32, "sum") * 1.5, torch.float32):
        failures.append(f"in place with scaling: {tensor[:4].tolist()}")
    if hvd.allreduce(torch.tensor([float(hvd.rank())]), average=True).item() != (hvd.size() - 1) / 2:
        failures.append("legacy average=True")
    return failures


def check_fusion_of_many_small_tensors(hvd):
    tensors = [torch.full((i % 5 + 1,), float(hvd.rank() + i)) for i in range(200)]
    handles = [hvd.allreduce_async(t, name=f"small.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    expected_offset = sum(range(hvd.size()))
    return [f"small.{i}" for i, h in enumerate(handles)
            if not torch.equal(hvd.synchronize(h),
                               torch.full((i % 5 + 1,), float(hvd.size() * i + expected_offset)))]


def check_async_in_rank_dependent_order(hvd):
    names = [f"t{i}" for i in range(12)]
    order = names if hvd.rank() % 2 == 0 else list(reversed(names))
    handles = {name: hvd.allreduce_async(torch.full((3,), float(int(name[1:]))), name=name,
                                         op=hvd.Sum) for name in order}
    return [name for name, handle in handles.items()
            if hvd.synchronize(handle).tolist() != [float(int(name[1:]) * hvd.size())] * 3]


def check_grouped_allreduce(hvd):
    results = hvd.grouped_allreduce([torch.ones(3), torch.ones(2, 2) * 2], op=hvd.Sum)
    ok = torch.equal(results[0], torch.full((3,), float(hvd.size()))) and \
        torch.equal(results[1], torch.full((2, 2), 2.0 * hvd.size()))
    return [] if ok else [str(results)]


def check_fusion_of_large_tensors(hvd):
    """Fused tensors large enough to be reduced straight into their outputs, cut between the
    ranks' parts at odd places; and small ones with them, through the fusion buffer."""
    failures = []
    shapes = {"large": [(40_001,), (70_003,), (300, 301)],  # 800 KB: parts end inside tensors
              "two of 64 KiB": [(16_384,), (128, 128)],  # every rank reduces all of it
              "large and small": [(90_001,), (1,), (7,), (3, 5)]}  # through the fusion buffer
    for what, group in shapes.items():
        for dtype, op_name, op, scales in ((torch.float32, "sum", hvd.Sum, (0.5, 4.0)),
                                           (torch.float64, "average", hvd.Average, (1.0, 1.0)),
                                           (torch.int32, "average", hvd.Average, (1.0, 1.0))):
            inputs = [rank_input(hvd.rank(), torch.Size(shape).numel(), dtype, op_name).view(shape)
                      for shape in group]
            results = hvd.grouped_allreduce(inputs, op=op, prescale_factor=scales[0],
                                            postscale_factor=scales[1])
            for shape, result in zip(group, results):
                numel = torch.Size(shape).numel()
                expected = expected_reduction(hvd.size(), numel, dtype, op_name) * scales[0] * scales[1]
                if result.shape != shape or not close(result.view(-1), expected, dtype):
                    failures.append(f"{what}, {op_name} {dtype}, {shape}: {result.view(-1)[:4].tolist()}")
    return failures


def horovod_rows(rows, rank, size):
    """Rank `rank`'s rows of a reducescatter: the first `rows % size` ranks get one more."""
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_reducescatter(hvd):
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
           "product": hvd.Product}
    failures = []
    for dtype in DTYPES:
        for numel in SIZES:
            start, end = horovod_rows(numel, hvd.rank(), hvd.size())
            for op_name, op in ops.items():
                mine = rank_input(hvd.rank(), numel, dtype, op_name)
                result = hvd.reducescatter(mine, op=op)
                expected = expected_reduction(hvd.size(), numel, dtype, op_name)[start:end]
                if not close(result, expected, dtype) or result.shape != (end - start,):
                    failures.append(f"{op_name} {dtype} numel={numel}: {result[:8].tolist()}")
    rows = 5  # rows of 3: a rank's part is whole rows
    start, end = horovod_rows(rows, hvd.rank(), hvd.size())
    mine = rank_input(hvd.rank(), rows * 3, torch.float32).view(rows, 3)
    expected = expected_reduction(hvd.size(), rows * 3, torch.float32, "sum").view(rows, 3)
    handle = hvd.reducescatter_async(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    if not close(hvd.synchronize(handle), expected[start:end] * 2, torch.float32):
        failures.append("reducescatter_async of rows, scaled")
    grouped = hvd.grouped_reducescatter([mine, mine[:, 0].contiguous()], op=hvd.Sum)
    if not (close(grouped[0], expected[start:end], torch.float32)
            and close(grouped[1], expected[start:end, 0], torch.float32)):
        failures.append(f"grouped_reducescatter: {[t.tolist() for t in grouped]}")
    if not torch.equal(mine, rank_input(hvd.rank(), rows * 3, torch.float32).view(rows, 3)):
        failures.append("reducescatter changed its input")
    return failures


def check_alltoall(hvd):
    """Rank s sends (s + d) % 3 rows to rank d, each row holding (s, d): some blocks empty."""
    failures = []
    me, size = hvd.rank(), hvd.size()
    splits = [(me + d) % 3 for d in range(size)]
    for dtype in DTYPES:
        rows = torch.cat([torch.tensor([[me, d]] * n, dtype=torch.int64) for d, n in enumerate(splits)])
        tensor = rows.view(-1, 1, 2).expand(-1, 3, 2).to(dtype).contiguous()  # 3-D: rows of 3x2
        received, counts = hvd.alltoall(tensor, splits=torch.tensor(splits, dtype=torch.int32))
        expected = torch.cat([torch.tensor([[s, me]] * ((s + me) % 3), dtype=torch.int64)
                              for s in range(size)]).view(-1, 1, 2).expand(-1, 3, 2).to(dtype)
        if not torch.equal(received, expected) or counts.tolist() != [(s + me) % 3 for s in range(size)]:
            failures.append(f"alltoall {dtype}: {received.tolist()} {counts.tolist()}")
    equal = torch.arange(2 * size, dtype=torch.float32) + 100 * me  # two rows to each rank
    received = hvd.synchronize(hvd.alltoall_async(equal))[0]
    if received.tolist() != [100 * s + 2 * me + i for s in range(size) for i in range(2)]:
        failures.append(f"alltoall_async equal split: {received.tolist()}")
    source = (torch.arange(2 * size, dtype=torch.float64) + me).requires_grad_()
    (hvd.alltoall(source) * (me + 1)).sum().backward()  # each row's gradient: its receiver's rank + 1
    if source.grad.tolist() != [float(d + 1) for d in range(size) for _ in range(2)]:
        failures.append(f"alltoall gradient {source.grad.tolist()}")
    refused = [([size + 5] * size, "rows, but"), (torch.ones(size), "int32")]
    if size > 1:
        refused.append((None, "equally"))  # size + 1 rows
    for splits, error in refused:
        try:
            hvd.alltoall(torch.zeros(size + 1), splits=splits)
            failures.append(f"no error for splits {splits}")
        except ValueError as exc:
            if error not in str(exc):
                failures.append(f"splits {splits}: {exc}")
    return failures


def check_allgather(hvd):
    failures = []
    for dtype in DTYPES:
        mine = torch.full((hvd.rank(), 3), hvd.rank() + 1).to(dtype)  # rank 0 contributes no rows
        gathered = hvd.allgather(mine)
        expected = torch.cat([torch.full((r, 3), r + 1).to(dtype) for r in range(hvd.size())])
        if not torch.equal(gathered, expected):
            failures.append(f"allgather {dtype}: {gathered.tolist()}")
    handle = hvd.allgather_async(torch.tensor([hvd.rank()]))
    if hvd.synchronize(handle).tolist() != list(range(hvd.size())):
        failures.append("allgather_async")
    return failures


def check_broadcast(hvd):
    failures = []
    for root in range(hvd.size()):
        for dtype in DTYPES:
            for numel in (0, 5, 300_001):
                mine = rank_input(hvd.rank(), numel, dtype)
                result = hvd.broadcast(mine, root_rank=root)
                if not torch.equal(result, rank_input(root, numel, dtype)):
                    failures.append(f"broadcast root={root} {dtype} numel={numel}")
        tensor = torch.full((4,), float(hvd.rank()))
        hvd.broadcast_(tensor, root_rank=root)
        if tensor.tolist() != [float(root)] * 4:
            failures.append(f"broadcast_ root={root}")
    return failures


def check_objects_and_barrier(hvd):
    failures = []
    if hvd.broadcast_object({"from": hvd.rank()}, root_rank=hvd.size() - 1) != {"from": hvd.size() - 1}:
        failures.append("broadcast_object")
    if hvd.allgather_object(("rank", hvd.rank())) != [("rank", r) for r in range(hvd.size())]:
        failures.append("allgather_object")
    hvd.barrier()
    return failures


def check_mismatch_names_the_tensor_and_ranks(hvd):
    if hvd.size() == 1:
        return []
    try:
        hvd.allreduce(torch.ones(2 + (hvd.rank() == 1)), name="lopsided")
    except hvd.HorovodInternalError as exc:
        message = str(exc)
        return [] if "'lopsided'" in message and "ranks [0, 1]" in message else [message]
    return ["no error for mismatched shapes"]


def check_large_buffers(hvd):
    """Sizes past the shared-memory buffer: reduce-scatter in place, several rounds per call."""
    failures = []
    numel = 3_000_001  # 12 MB of float32: two rounds of an 8 MiB buffer, odd split between ranks
    result = hvd.allreduce(rank_input(hvd.rank(), numel, torch.float32), op=hvd.Sum)
    if not torch.equal(result, expected_reduction(hvd.size(), numel, torch.float32, "sum").float()):
        failures.append("allreduce of 12 MB")
    root = hvd.size() - 1
    result = hvd.broadcast(rank_input(hvd.rank(), numel, torch.float32), root_rank=root)
    if not torch.equal(result, rank_input(root, numel, torch.float32)):
        failures.append("broadcast of 12 MB")
    start, end = horovod_rows(numel, hvd.rank(), hvd.size())
    result = hvd.reducescatter(rank_input(hvd.rank(), numel, torch.float32), op=hvd.Sum)
    expected = expected_reduction(hvd.size(), numel, torch.float32, "sum").float()[start:end]
    if not torch.equal(result, expected):
        failures.append("reducescatter of 12 MB")
    rows = 1_000_000  # rank r contributes r + 1 rows of 3: blocks of different sizes, up to 48 MB
    gathered = hvd.allgather(torch.full(((hvd.rank() + 1) * rows // 3, 3), float(hvd.rank())))
    expected = torch.cat([torch.full(((r + 1) * rows // 3, 3), float(r)) for r in range(hvd.size())])
    if not torch.equal(gathered, expected):
        failures.append("allgather of blocks of different sizes")
    return failures


def check_transport(hvd):
    from ddl_magic.runtime import context

    expected = os.environ["EXPECTED_TRANSPORT"]
    actual = context.current("check_transport").transport
    return [] if actual == expected else [f"moved data by {actual}, expected {expected}"]


def check_topology(hvd):
    hosts = os.environ.get("DDL_MAGIC_TEST_HOSTS", ",".join(["here"] * hvd.size())).split(",")
    mine = hosts[hvd.rank()]
    local_rank = [r for r, host in enumerate(hosts) if host == mine].index(hvd.rank())
    with_local_rank = [host for host in dict.fromkeys(hosts) if hosts.count(host) > local_rank]
    expected = (local_rank, hosts.count(mine), hvd.size(), with_local_rank.index(mine),
                len(with_local_rank))
    actual = (hvd.local_rank(), hvd.local_size(), hvd.size(), hvd.cross_rank(), hvd.cross_size())
    return [] if actual == expected else [f"topology {actual}, expected {expected}"]


CHECKS = [check_allreduce, check_allreduce_in_place_and_scaling, check_fusion_of_many_small_tensors,
          check_fusion_of_large_tensors,
          check_async_in_rank_dependent_order, check_grouped_allreduce, check_reducescatter,
          check_alltoall, check_allgather,
          check_broadcast, check_objects_and_barrier, check_mismatch_names_the_tensor_and_ranks,
          check_large_buffers, check_transport, check_topology]


def run_all_checks():
    import ddl_magic.torch as hvd

    hvd.init()
    hvd.init()  # a second init is harmless
    report = {check.__name__: check(hvd) for check in CHECKS}
    hvd.shutdown()
    return report


# (np, DDL_MAGIC_TRANSPORT, the host of each rank or None for this one, the transport expected)
SETUPS = [(1, "shm", None, "none"), (2, "shm", None, "shm"), (3, "shm", None, "shm"),
          (4, "shm", None, "shm"), (2, "tcp", None, "tcp"), (3, "tcp", None, "tcp"),
          (4, "tcp", None, "tcp"),
          (4, "auto", "a,b,a,b", "shm+tcp"),  # Spark's placement: hierarchical, ring by host
          (3, "auto", "a,b,a", "tcp")]  # uneven hosts: the flat ring, ordered by host


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def for_setup(np, transport, hosts, expected):
        if (np, transport, hosts) not in cache:
            with pytest.MonkeyPatch.context() as patch:
                if hosts:  # read by each rank as it registers, from the environment it inherits
                    patch.setenv("DDL_MAGIC_TEST_HOSTS", hosts)
                env = {"DDL_MAGIC_TRANSPORT": transport, "EXPECTED_TRANSPORT": expected}
                cache[np, transport, hosts] = run_on_ranks(run_all_checks, np, timeout_s=240, env=env)
        return cache[np, transport, hosts]

    return for_setup


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
@pytest.mark.parametrize("np, transport, hosts, expected", SETUPS)
def test_collective(reports, np, transport, hosts, expected, check):
    failures = {rank: report[check] for rank, report in
                enumerate(reports(np, transport, hosts, expected)) if report[check]}
    assert failures == {}


def uneven_data_with_join():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    sums = []
    for step in range(hvd.rank() + 1):  # rank r has r + 1 batches
        sums.append(hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), name=f"grad.{step}",
                                  op=hvd.Sum).tolist())
    last = hvd.join()
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()  # everyone is back
    return sums, last, after


def test_join_lets_ranks_with_less_data_contribute_zeros():
    results = run_on_ranks(uneven_data_with_join, 3)
    # step s is summed over the ranks that still have data: ranks s..2 contribute r + 1
    expected = [[float(sum(r + 1 for r in range(step, 3)))] * 3 for step in range(3)]
    for rank, (sums, last, after) in enumerate(results):
        assert sums == expected[:rank + 1]
        assert last == 2
        assert after == 3.0


def same_name_twice_at_once():
    """Each rank in turn submits its own name, then submits it again 3 times (as Horovod's
    test_horovod_allreduce_duplicate_name_error does) while the others wait at a barrier, so
    that the first cannot have completed yet; then the others submit it too."""
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    mine, errors = f"twice.{hvd.rank()}", []
    for turn in range(hvd.size()):
        if turn == hvd.rank():
            first = hvd.allreduce_async(torch.ones(2), name=mine, op=hvd.Sum)
            for _ in range(3):
                try:
                    hvd.allreduce_async(torch.ones(2), name=mine, op=hvd.Sum)
                except ValueError as exc:
                    errors.append(str(exc))
        hvd.barrier()
    others = [hvd.allreduce_async(torch.ones(2), name=f"twice.{other}", op=hvd.Sum)
              for other in range(hvd.size()) if other != hvd.rank()]
    reduced = hvd.synchronize(first).tolist()
    for handle in others:
        hvd.synchronize(handle)
    again = [hvd.allreduce(torch.ones(1), name=f"twice.{r}", op=hvd.Sum).tolist()  # free again
             for r in range(hvd.size())]
    return reduced, errors, again


def test_one_name_in_flight_twice_is_refused_at_submit_and_the_first_completes():
    for rank, (first, errors, again) in enumerate(run_on_ranks(same_name_twice_at_once, 2,
                                                               timeout_s=60)):
        assert first == [2.0, 2.0]
        assert len(errors) == 3
        assert f"a collective named 'twice.{rank}' is already in flight on this rank" in errors[0]
        assert again == [[2.0], [2.0]]
