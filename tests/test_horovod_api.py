"""The parts of `horovod.torch` that ported scripts and Horovod's own tests call besides the
basic collectives: the build and capability checks, `is_homogeneous`, the grouped
collectives in all their forms, and what happens when ranks' unnamed calls stop lining up.

Each setup is launched once (processes are the expensive part): on 1 rank, on 2 ranks over
shared memory, and on 3 ranks that look like 2 hosts of 2 and 1 ranks (the TCP ring, not
homogeneous). Every rank runs all the checks below and reports which failed.
"""

import pytest
import torch

from ranks import failures_of, reports_per_setup, run_on_ranks


def equal_lists(actual, expected) -> bool:
    return (isinstance(actual, list) and len(actual) == len(expected)
            and all(torch.equal(a, e) for a, e in zip(actual, expected)))


def check_capabilities(hvd):
    expected = {"mpi_built": False, "mpi_enabled": False, "gloo_built": True,
                "gloo_enabled": True, "nccl_built": 0, "ddl_built": False, "ccl_built": False,
                "rocm_built": False, "cuda_built": torch.backends.cuda.is_built()}
    actual = {name: getattr(hvd, name)() for name in expected}
    failures = [f"{name}() is {actual[name]!r}" for name in expected
                if actual[name] != expected[name]]
    if type(actual["nccl_built"]) is not int:  # Horovod's scripts compare it with versions
        failures.append("nccl_built() is not an int")
    try:
        hvd.mpi_threads_supported()
        failures.append("mpi_threads_supported() did not raise")
    except ValueError as exc:
        if "MPI" not in str(exc):
            failures.append(f"mpi_threads_supported: {exc}")
    return failures


def check_is_homogeneous(hvd):
    import os

    hosts = os.environ.get("DDL_MAGIC_TEST_HOSTS", "here").split(",")
    expected = len({hosts.count(host) for host in hosts}) == 1
    return [] if hvd.is_homogeneous() is expected else [f"is_homogeneous() is not {expected}"]


def check_grouped_allgather(hvd):
    rank, size = hvd.rank(), hvd.size()
    mine = [torch.full((rank + 1, 3), float(rank)),  # rank r contributes r + 1 rows
            torch.full((rank, 2), rank, dtype=torch.int64),  # rank 0 contributes none
            torch.tensor(rank * 10)]  # a scalar gathers as one row
    expected = [torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)]),
                torch.cat([torch.full((r, 2), r, dtype=torch.int64) for r in range(size)]),
                torch.tensor([r * 10 for r in range(size)])]
    failures = []
    for label, gathered in [("grouped_allgather", hvd.grouped_allgather(mine)),
                            ("named", hvd.grouped_allgather(mine, name="gathered")),
                            ("async", hvd.synchronize(hvd.grouped_allgather_async(mine)))]:
        if not equal_lists(gathered, expected):
            failures.append(f"{label}: {gathered}")
    return failures


def check_grouped_allgather_gradient(hvd):
    """Rank r's loss weighs the gathered tensors by r + 1, so each rank's slice of the
    gradient is the average over ranks (Horovod's): (1 + 2 + ... + size) / size times the
    weights at its rows."""
    rank, size = hvd.rank(), hvd.size()
    inputs = [torch.zeros(rank + 1, 2, requires_grad=True), torch.tensor(1.0, requires_grad=True)]
    gathered = hvd.grouped_allgather(inputs)
    weights = [torch.arange(g.numel(), dtype=torch.float32).view(g.shape) for g in gathered]
    loss = sum((g * w).sum() for g, w in zip(gathered, weights)) * (rank + 1)
    loss.backward()
    averaged = (size + 1) / 2
    start = sum(r + 1 for r in range(rank))  # this rank's first row of the first tensor
    expected = [averaged * weights[0][start:start + rank + 1], averaged * weights[1][rank]]
    return [f"gradient of input {i}: {x.grad}" for i, (x, e) in enumerate(zip(inputs, expected))
            if x.grad is None or x.grad.shape != x.shape or not torch.equal(x.grad, e)]


def check_gradients_of_allgather_broadcast_and_grouped_allreduce(hvd):
    """The gradients Horovod's own tests expect (test_horovod_allgather_grad,
    test_horovod_broadcast_grad, test_horovod_grouped_allreduce_grad[_average])."""
    rank, size = hvd.rank(), hvd.size()
    failures = []
    rows = [r + 1 for r in range(size)]  # rank r gathers r + 1 rows
    mine = torch.ones(rows[rank], 3, requires_grad=True)
    gathered = hvd.allgather(mine)
    gathered.backward(torch.cat([torch.full((n, 3), float(r)) for r, n in enumerate(rows)]))
    if not torch.equal(mine.grad, torch.full((rows[rank], 3), float(rank))):
        failures.append(f"allgather gradient {mine.grad.tolist()}")
    root = size - 1
    source = torch.full((4,), float(rank), requires_grad=True)
    broadcasted = hvd.broadcast(source, root)
    if broadcasted.tolist() != [float(root)] * 4 or not broadcasted.requires_grad:
        failures.append(f"broadcast gave {broadcasted} (it must carry autograd)")
    broadcasted.backward(torch.ones(4))
    if source.grad.tolist() != [1.0 if rank == root else 0.0] * 4:
        failures.append(f"broadcast gradient {source.grad.tolist()}")
    for op, scale in ((hvd.Sum, float(size)), (hvd.Average, 1.0)):
        tensors = [torch.ones(5, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
        reduced = hvd.grouped_allreduce(tensors, op=op)
        if not all(r.requires_grad for r in reduced):
            failures.append(f"grouped_allreduce op={op} outputs carry no autograd")
            continue
        sum(r.sum() for r in reduced).backward()
        if any(not torch.equal(t.grad, torch.full_like(t, scale)) for t in tensors):
            failures.append(f"grouped_allreduce op={op} gradients {[t.grad for t in tensors]}")
    return failures


def check_broadcast_optimizer_state_fills_missing_gradients(hvd):
    """Horovod's test_broadcast_state_no_grad: a fresh optimizer's trainable parameters get
    zero gradients, the others none, and the state is the root's."""
    frozen = torch.nn.Parameter(torch.tensor([1, 3]), requires_grad=False)
    trained = torch.nn.Parameter(torch.rand(4))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD([frozen, trained], lr=0.001, weight_decay=1e-6, momentum=0.9,
                        nesterov=True), named_parameters=[("a", frozen), ("b", trained)])
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    failures = []
    if frozen.grad is not None:
        failures.append(f"a parameter without requires_grad got a gradient {frozen.grad}")
    if trained.grad is None or not torch.equal(trained.grad, torch.zeros(4)):
        failures.append(f"the trainable parameter's gradient is {trained.grad}, not zeros")
    if optimizer.param_groups[0]["lr"] != 0.001:
        failures.append("the hyperparameters changed")
    return failures


def check_sparse_gradients_and_sparse_allreduce(hvd):
    """Horovod's test_sparse_embeddings (both ways of sending a sparse gradient, SparseAdam
    stepping on the result) and test_async_sparse_allreduce."""
    rank, size = hvd.rank(), hvd.size()
    failures = []
    rows = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]] if rank == 0 else [[1, 3, 4], [4, 7, 9]])
    expected = torch.zeros(10, 3)  # the average over ranks of each rank's dense gradient
    for r in range(size):
        ids = [1, 2, 4, 5, 4, 3, 2, 9] if r == 0 else [1, 3, 4, 4, 7, 9]
        for i in ids:
            expected[i] += 1.0 / size
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
            named_parameters=embedding.named_parameters(), sparse_as_dense=sparse_as_dense)
        optimizer.zero_grad()
        embedding(rows).sum().backward()
        optimizer.step()
        grad = embedding.weight.grad
        if not grad.is_sparse or not torch.allclose(grad.to_dense(), expected):
            failures.append(f"sparse_as_dense={sparse_as_dense}: gradient {grad}")
    torch.manual_seed(rank)
    dense = torch.rand(6, 4) * (torch.rand(6, 4) > 0.6)
    for op in (hvd.Average, hvd.Sum):
        gathered = hvd.sparse_allreduce_async(dense.to_sparse(), name=f"sparse.{op}", op=op)()
        if not torch.allclose(gathered.to_dense(), hvd.allreduce(dense, op=op), atol=1e-6):
            failures.append(f"sparse_allreduce_async op={op} differs from allreduce")
    return failures


def check_step_after_synchronize_warns_and_parameter_names(hvd):
    """Horovod's warning for step() after synchronize() outside skip_synchronize(), and its
    `_parameter_names` (a parameter's name, the same on every rank)."""
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    failures = []
    names = optimizer._parameter_names
    if len(set(names.values())) != 4 or hvd.allgather_object(sorted(names.values()))[0] != sorted(names.values()):
        failures.append(f"_parameter_names {names}")
    for skip in (False, True):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        warned = [w for w in caught if "optimizer.skip_synchronize()" in str(w.message)]
        if len(warned) != (0 if skip else 1):
            failures.append(f"skip_synchronize={skip}: {len(warned)} warnings")
        optimizer.zero_grad()
    return failures


def check_reducescatter(hvd):
    """Every rank reduces; each keeps its rows, the first `rows % size` ranks one row more
    (Horovod's split); the gradient is the allgather of the incoming ones."""
    rank, size = hvd.rank(), hvd.size()
    failures = []
    rows = 2 * size + 1  # uneven unless size is 1
    start = rank * 2 + min(rank, 1)
    mine = slice(start, start + 2 + (1 if rank < 1 or size == 1 else 0))
    whole = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
    tensor = whole * (rank + 1)
    total = whole * (size * (size + 1) / 2)
    summed = hvd.reducescatter(tensor, op=hvd.Sum)
    if not torch.equal(summed, total[mine]):
        failures.append(f"reducescatter Sum gave {summed.tolist()}")
    averaged = hvd.synchronize(hvd.reducescatter_async(tensor, name="rs.average"))
    if not torch.allclose(averaged, total[mine] / size):
        failures.append(f"reducescatter_async Average gave {averaged.tolist()}")
    scaled = hvd.grouped_reducescatter([tensor, tensor[:, 0].contiguous()], op=hvd.Sum,
                                       postscale_factor=0.5)
    if not (torch.equal(scaled[0], total[mine] * 0.5) and torch.equal(scaled[1], total[mine][:, 0] * 0.5)):
        failures.append(f"grouped_reducescatter gave {[t.tolist() for t in scaled]}")
    source = tensor.clone().requires_grad_()
    hvd.reducescatter(source, op=hvd.Sum).sum().backward()
    if not torch.equal(source.grad, torch.full_like(source, float(size))):
        failures.append(f"reducescatter gradient {source.grad.tolist()}")
    try:
        hvd.reducescatter(torch.tensor(1.0))
        failures.append("a scalar was scattered")
    except ValueError:
        pass
    return failures


def check_grouped_allreduce_forms(hvd):
    rank, size = hvd.rank(), hvd.size()
    failures = []
    handle = hvd.grouped_allreduce_async([torch.full((3,), float(rank)), torch.ones(2, 2)],
                                         op=hvd.Sum)
    results = hvd.synchronize(handle)  # one handle for the group, as in Horovod
    expected = [torch.full((3,), float(sum(range(size)))), torch.full((2, 2), float(size))]
    if not (hvd.poll(handle) and equal_lists(results, expected)):
        failures.append(f"grouped_allreduce_async: {results}")

    tensors = [torch.full((3,), float(rank)), torch.ones(2, dtype=torch.int32)]
    returned = hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    if not (returned[0] is tensors[0] and returned[1] is tensors[1]):
        failures.append("grouped_allreduce_ did not return the tensors it was given")
    if tensors[0].tolist() != [float(sum(range(size)))] * 3 or tensors[1].tolist() != [size] * 2:
        failures.append(f"grouped_allreduce_: {tensors}")

    tensors = [torch.full((4,), float(rank)), torch.full((1,), float(rank))]
    hvd.synchronize(hvd.grouped_allreduce_async_(tensors, name="in place"))  # Average
    if [t.tolist() for t in tensors] != [[(size - 1) / 2] * 4, [(size - 1) / 2]]:
        failures.append(f"grouped_allreduce_async_: {tensors}")

    try:
        hvd.grouped_allreduce_([torch.ones(2), torch.ones(3, 2).t()])
        failures.append("grouped_allreduce_ accepted a non-contiguous tensor")
    except ValueError:
        pass

    # 1 + 2**-12 is 1.0 in float16: the compressed sum arrives rounded, as a float32
    reduced = hvd.grouped_allreduce([torch.tensor([1 + 2 ** -12])], op=hvd.Sum,
                                    compression=hvd.Compression.fp16)
    if reduced[0].dtype != torch.float32 or reduced[0].item() != float(size):
        failures.append(f"grouped_allreduce ignored its compression: {reduced[0]!r}")
    return failures


def check_failed_calls_leave_nothing_behind(hvd):
    """The last rank alone makes calls that raise; then every rank makes the same unnamed calls.
    Had a failed call consumed a number, or submitted part of a group, these would never pair."""
    rank, size = hvd.rank(), hvd.size()
    failures = []
    if rank == size - 1:
        bad_calls = {
            "group with a non-tensor": lambda: hvd.grouped_allreduce([torch.ones(2), "x"]),
            "gather group with a non-tensor": lambda: hvd.grouped_allgather([torch.ones(2), 3]),
            "Adasum": lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
            "grouped Adasum": lambda: hvd.grouped_allreduce_async([torch.ones(1)], op=hvd.Adasum),
            "root out of range": lambda: hvd.broadcast(torch.ones(2), root_rank=size),
            "in place, not contiguous": lambda: hvd.grouped_allreduce_async_(
                [torch.ones(2), torch.ones(3, 2).t()]),
        }
        for label, call in bad_calls.items():
            try:
                call()
                failures.append(f"{label}: no error")
            except (AttributeError, TypeError, ValueError, NotImplementedError):
                pass
    if [t.tolist() for t in hvd.grouped_allreduce([torch.ones(2), torch.ones(1)], op=hvd.Sum)] \
            != [[size] * 2, [size]]:
        failures.append("grouped_allreduce after the failed calls")
    gathered = hvd.grouped_allgather([torch.tensor([rank]), torch.ones(1)])
    if gathered[0].tolist() != list(range(size)):
        failures.append("grouped_allgather after the failed calls")
    if hvd.allreduce(torch.ones(1), op=hvd.Sum).item() != size:
        failures.append("allreduce after the failed calls")
    if hvd.broadcast(torch.tensor([rank]), root_rank=0).tolist() != [0]:
        failures.append("broadcast after the failed calls")
    return failures


def check_diverged_unnamed_calls_are_explained_and_init_restarts_the_count(hvd):
    """The last rank makes one unnamed allreduce more than the others: its first one meets
    their next one, with another shape. Then every rank shuts down and inits again."""
    from ddl_magic.runtime.errors import CollectiveMismatchError, HorovodInternalError

    rank, size = hvd.rank(), hvd.size()
    if size == 1:
        return []
    failures = []
    extra = hvd.allreduce_async(torch.ones(1)) if rank == size - 1 else None  # this rank only
    try:
        mine = hvd.allreduce_async(torch.ones(2))
    except HorovodInternalError:
        # The last rank, slower than the others under load: they met its `extra`, got the
        # mismatch and shut down before it submitted this call, which then finds rank 0 gone.
        if extra is None:
            raise
        mine = None
    try:
        hvd.synchronize(mine if extra is None else extra)
        failures.append("no error for diverged unnamed calls")
    except CollectiveMismatchError as exc:
        message = str(exc)
        if not ("'allreduce.noname." in message and "name=" in message
                and "sequences of unnamed allreduce calls diverged at this call or before it"
                in message):
            failures.append(message)
    hvd.shutdown()  # the last rank's second call never meets a partner
    if hvd.gloo_enabled():
        failures.append("gloo_enabled() after shutdown()")
    hvd.init()
    if hvd.allreduce(torch.ones(1), op=hvd.Sum).item() != size:  # numbered from 0 on every rank
        failures.append("unnamed calls after init() do not pair up")
    return failures


def check_work_nobody_waits_for_completes(hvd):
    """An async allreduce that no rank waits for still runs (on its own background thread,
    whether or not the rank has a core to spare for overlapping), and poll() sees it done."""
    import time

    handle = hvd.allreduce_async(torch.ones(4), name="nobody.waits", op=hvd.Sum)
    deadline = time.monotonic() + 30
    while not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.001)
    if not hvd.poll(handle):
        return ["an allreduce nobody waited for was still pending after 30 s"]
    result = hvd.synchronize(handle)
    return [] if result.tolist() == [float(hvd.size())] * 4 else [f"nobody.waits: {result}"]


# The last check leaves the ranks' unnamed calls out of step until it inits again: keep it last.
CHECKS = [check_capabilities, check_is_homogeneous, check_grouped_allgather,
          check_grouped_allgather_gradient, check_grouped_allreduce_forms,
          check_gradients_of_allgather_broadcast_and_grouped_allreduce,
          check_broadcast_optimizer_state_fills_missing_gradients,
          check_sparse_gradients_and_sparse_allreduce,
          check_step_after_synchronize_warns_and_parameter_names, check_reducescatter,
          check_failed_calls_leave_nothing_behind, check_work_nobody_waits_for_completes,
          check_diverged_unnamed_calls_are_explained_and_init_restarts_the_count]


def run_all_checks():
    import ddl_magic.torch as hvd

    hvd.init()
    report = {check.__name__: check(hvd) for check in CHECKS}
    hvd.shutdown()
    return report


# (np, the host of each rank or None for this one): one rank; shared memory; the TCP ring
# over 2 hosts of uneven size, which is not homogeneous.
SETUPS = [(1, None), (2, None), (3, "a,b,a")]


@pytest.fixture(scope="module")
def reports():
    return reports_per_setup(run_all_checks, timeout_s=60)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
@pytest.mark.parametrize("np, hosts", SETUPS)
def test_horovod_api(reports, np, hosts, check):
    assert failures_of(reports(np, hosts), check) == {}


def test_build_checks_answer_without_init():
    """Scripts may ask before `init()`, as Horovod allows."""
    import ddl_magic.torch as hvd

    assert (hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built(), hvd.cuda_built()) == (
        False, True, 0, torch.backends.cuda.is_built())


def unreducible_dtypes_and_a_failing_collective():
    """A complex allreduce is refused before it is submitted; a collective that fails while it
    runs (submitted past that check) fails its callers instead of leaving them waiting."""
    import torch

    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context
    from ddl_magic.runtime.negotiation import Request

    hvd.init()
    seen = {}
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.complex64))
    except TypeError as exc:
        seen["refused"] = str(exc)
    seen["still_works"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    tensor = torch.ones(3, dtype=torch.complex64)
    handle = context.current("test").queue.submit(
        Request("complex.sum", "allreduce", tensor.dtype, tuple(tensor.shape), op=int(hvd.Sum)),
        tensor, None, wait_follows=True)
    try:
        handle.wait()
    except Exception as exc:
        seen["failed"] = f"{type(exc).__name__}: {exc}"
    return seen


@pytest.mark.parametrize("np, transport", [(2, "auto"), (3, "auto"), (2, "tcp")])
def test_an_unreducible_dtype_is_refused_and_a_failing_collective_never_hangs(np, transport):
    for seen in run_on_ranks(unreducible_dtypes_and_a_failing_collective, np, timeout_s=60,
                             env={"DDL_MAGIC_TRANSPORT": transport}):
        assert "complex64 tensors cannot be reduced" in seen["refused"]
        assert seen["still_works"] == [float(np)] * 2
        assert "HorovodInternalError" in seen["failed"] and "complex64" in seen["failed"]


def pending_at_shutdown():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    hvd.barrier()
    if hvd.rank() == 0:
        hvd.shutdown()
        return None
    try:  # refused at once if rank 0's shutdown got here first
        handle = hvd.allreduce_async(torch.ones(2), name="only.rank.1")  # rank 0 never submits it
        hvd.shutdown()
        hvd.synchronize(handle)
    except hvd.HorovodInternalError as exc:
        return str(exc)
    return "completed"


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_collective_pending_at_shutdown_fails_instead_of_waiting_for_ever(transport):
    _, follower = run_on_ranks(pending_at_shutdown, 2, timeout_s=60,
                               env={"DDL_MAGIC_TRANSPORT": transport})
    assert "shut down" in follower
