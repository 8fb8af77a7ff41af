"""FSDP2 (`fully_shard`), DeviceMesh and DTensor over the `ddl` backend, on local ranks:
the same weights as over gloo and as one process, DTensor's collectives giving what gloo's
give, and what the backend refuses named."""

import pytest
import torch

import training
from ranks import run_on_ranks

SHARDINGS = ("per_layer", "whole")
# The ranks' gradients are summed in another order than gloo's or one process's: float32
# rounding, a few ulps after a few steps. A wrong gradient or a stale shard is far off.
RTOL, ATOL = 1e-6, 1e-7


def train_both_shardings(backend: str) -> dict:
    """Every sharding trained in turn in one run (one launch instead of two)."""
    return {sharding: training.train_fully_sharded(backend, sharding) for sharding in SHARDINGS}


@pytest.fixture(scope="module")
def runs():
    """(backend, np) -> every rank's results of `train_both_shardings`, run once each."""
    cache = {}

    def run(backend: str, np: int) -> list[dict]:
        if (backend, np) not in cache:
            cache[backend, np] = run_on_ranks(train_both_shardings, np, backend=backend)
        return cache[backend, np]

    return run


@pytest.fixture(scope="module")
def one_process_weights():
    return training.train_alone()


def assert_close_weights(weights, reference) -> None:
    assert len(weights) == len(reference)
    for got, expected in zip(weights, reference):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("np", [2, 4])
def test_fully_shard_over_ddl_trains_to_the_weights_of_gloo_and_of_one_process(
        runs, one_process_weights, np, sharding):
    over_ddl = runs("ddl", np)
    over_gloo = runs("gloo", np)
    weights = over_ddl[0][sharding]["weights"]
    for rank, result in enumerate(over_ddl):  # full_tensor() gathers the same on every rank
        assert all(torch.equal(w, r) for w, r in zip(result[sharding]["weights"], weights)), rank
    assert_close_weights(weights, over_gloo[0][sharding]["weights"])
    assert_close_weights(weights, one_process_weights)


@pytest.mark.parametrize("np", [2, 4])
def test_fully_shard_over_ddl_keeps_a_shard_of_each_parameter_on_each_rank(runs, np):
    full_shapes = [tuple(w.shape) for w in training.train_alone(steps=0)]
    over_ddl = runs("ddl", np)
    for sharding in SHARDINGS:
        shards = [result[sharding]["shard_shapes"] for result in over_ddl]
        for index, full in enumerate(full_shapes):
            rows = [shapes[index][0] for shapes in shards]
            # dim 0 split in rank order, ceil(rows / np) each, the last ranks' possibly fewer
            assert sum(rows) == full[0] and max(rows) == -(-full[0] // np), (sharding, index, rows)
            assert all(shapes[index][1:] == full[1:] for shapes in shards)


def test_fully_shard_over_ddl_on_one_rank_is_one_process(one_process_weights):
    (result,) = run_on_ranks(train_both_shardings, 1, backend="ddl")
    for sharding in SHARDINGS:
        assert_close_weights(result[sharding]["weights"], one_process_weights)


def train_with_a_gradient_divide_factor(factor_per_rank: float) -> list:
    """FSDP2 with `set_gradient_divide_factor(size * factor_per_rank)`: its reduce-scatter is
    a PREMUL_SUM (each gradient multiplied by 1/factor, then summed), which gloo refuses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("ddl")
    rank, size = dist.get_rank(), dist.get_world_size()
    model, x, y = training._model_and_data()
    fully_shard(model, mesh=init_device_mesh("cpu", (size,)))
    model.set_gradient_divide_factor(size * factor_per_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(training.STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rank::size]), y[rank::size]).backward()
        optimizer.step()
    return [p.full_tensor().detach() for p in model.parameters()]


def test_a_gradient_divide_factor_scales_the_reduce_scatter_over_ddl():
    weights = run_on_ranks(train_with_a_gradient_divide_factor, 2, factor_per_rank=2.0)[0]
    # Gradients halved: one process on the whole batch with half the learning rate.
    model, x, y = training._model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(training.STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert_close_weights(weights, [p.detach() for p in model.parameters()])


def dtensor_and_rooted_collectives(backend: str) -> dict:
    """What DTensor's and torch.distributed's collectives give on this rank, or the error.
    Rows not divisible by the ranks, so shards are uneven."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    seen = {}
    full = torch.arange(35.0).reshape(7, 5)
    sharded = distribute_tensor(full, mesh, [Shard(0)])  # rank 0 scatters the rows
    seen["distributed_rows"] = sharded.to_local().tolist()
    seen["full_tensor"] = sharded.full_tensor().tolist()
    seen["shard_0_to_shard_1"] = sharded.redistribute(mesh, [Shard(1)]).to_local().tolist()
    seen["replicated"] = distribute_tensor(full * (rank + 1), mesh, [Replicate()]).to_local().tolist()
    partial = DTensor.from_local(torch.arange(6.0).reshape(3, 2) * (rank + 1), mesh, [Partial()])
    seen["partial_to_replicate"] = partial.redistribute(mesh, [Replicate()]).to_local().tolist()
    seen["partial_to_shard"] = partial.redistribute(mesh, [Shard(0)]).to_local().tolist()

    if backend == "ddl":  # gloo refuses parts of different sizes
        uneven = [torch.zeros(r + 1) for r in range(size)]
        dist.all_gather(uneven, torch.full((rank + 1,), float(rank)))
        seen["uneven_all_gather"] = [t.tolist() for t in uneven]
    coalesced = [[torch.zeros(2), torch.zeros(1)] for _ in range(size)]
    dist.all_gather_coalesced(coalesced, [torch.full((2,), float(rank)), torch.full((1,), 10.0 + rank)])
    seen["all_gather_coalesced"] = [[t.tolist() for t in ts] for ts in coalesced]
    gathered = [torch.zeros(2) for _ in range(size)] if rank == 1 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=1)
    seen["gather"] = gathered and [t.tolist() for t in gathered]
    part = torch.zeros(3)
    dist.scatter(part, [torch.full((3,), 100.0 + r) for r in range(size)] if rank == 2 else None, src=2)
    seen["scatter"] = part.tolist()
    objects = [None] * size if rank == 0 else None
    dist.gather_object({"rank": rank}, objects, dst=0)
    seen["gather_object"] = objects

    # Its second dimension's groups are single ranks; a backend_override is honoured.
    mesh = init_device_mesh("cpu", (size, 1), backend_override={1: "gloo"})
    seen["first_dimension_backend"] = mesh.get_group(0).name()
    seen["over_the_first_dimension"] = distribute_tensor(full, mesh, [Shard(0), Replicate()]).full_tensor().tolist()
    return seen


def test_dtensor_and_rooted_collectives_over_ddl_give_what_gloo_gives():
    over_ddl = run_on_ranks(dtensor_and_rooted_collectives, 3, backend="ddl")
    over_gloo = run_on_ranks(dtensor_and_rooted_collectives, 3, backend="gloo")
    full = torch.arange(35.0).reshape(7, 5).tolist()
    for rank, (ddl, gloo) in enumerate(zip(over_ddl, over_gloo)):
        assert ddl["distributed_rows"] == full[3 * rank:3 * rank + 3]  # 3, 3 and 1 rows
        assert ddl["full_tensor"] == ddl["over_the_first_dimension"] == full
        assert ddl["uneven_all_gather"] == [[float(r)] * (r + 1) for r in range(3)]
        assert ddl["gather"] == ([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]] if rank == 1 else None)
        assert ddl["scatter"] == [100.0 + rank] * 3
        assert ddl["gather_object"] == ([{"rank": r} for r in range(3)] if rank == 0 else None)
        assert (ddl["first_dimension_backend"], gloo["first_dimension_backend"]) == ("ddl", "gloo")
        for what in ("distributed_rows", "full_tensor", "shard_0_to_shard_1", "replicated",
                     "partial_to_replicate", "partial_to_shard", "all_gather_coalesced", "gather",
                     "scatter", "gather_object", "over_the_first_dimension"):
            assert ddl[what] == gloo[what], (rank, what)


def test_fully_shard_over_ddl_in_a_horovod_cell(tmp_path, one_process_weights):
    import ast
    import os

    from kernel import Kernel

    # The kernel, and the ranks it starts, import `training` from here.
    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "PYTHONPATH": path}, cwd=str(tmp_path))
    try:
        assert kernel.run("%load_ext ddl_magic").error is None
        out = kernel.run("%%horovod -np 2 --quiet\n"
                         "import training\n"
                         "trained = training.train_fully_sharded('ddl', 'per_layer')\n"
                         "[w.tolist() for w in trained['weights']]")
    finally:
        kernel.close()
    assert out.error is None, out.error
    weights = [torch.tensor(w) for w in ast.literal_eval(out.result)]
    assert_close_weights(weights, one_process_weights)
