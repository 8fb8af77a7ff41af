"""Sub-groups and N-D meshes on the `ddl` backend, on 4 local ranks: every collective over a
group of some of the ranks gives what gloo gives; HSDP, and FSDP2 with tensor parallelism,
train to the weights of gloo and of one process; groups created wrongly, and collectives a
member never joins, end with errors that name the ranks and say what to do."""

import pytest
import torch

import large_models
from ranks import run_on_ranks

NP = 4
RTOL, ATOL = 1e-5, 1e-6  # summed in another order than gloo's or one process's: a few ulps


def subgroup_collectives(backend: str) -> dict:
    """Every collective torch.distributed offers, over groups of some of the ranks, created
    in the order a 2-D DeviceMesh creates them (every rank, members or not), many at once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group(backend)
    rank = dist.get_rank()
    seen = {}
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    odd_three = dist.new_group([3, 1, 2])  # any ranks, in any order
    column, row = columns[rank % 2], rows[rank // 2]
    seen["ranks"] = (dist.get_rank(column), dist.get_world_size(column), dist.get_rank(row))

    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX),
                     ("min", dist.ReduceOp.MIN), ("product", dist.ReduceOp.PRODUCT)):
        t = torch.tensor([rank + 1.0, 10.0 * rank])
        dist.all_reduce(t, op=op, group=column)
        seen[f"all_reduce_{name}"] = t.tolist()
    work = dist.all_reduce(t := torch.full((3,), rank + 1.0), group=row, async_op=True)
    seen["async_future"] = work.get_future().wait()[0].tolist()
    work.wait()
    seen["async_in_place"] = t.tolist()
    gathered = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=row)
    seen["all_gather"] = [g.tolist() for g in gathered]
    into = torch.zeros(4)
    dist.all_gather_into_tensor(into, torch.full((2,), float(rank)), group=column)
    seen["all_gather_into_tensor"] = into.tolist()
    part = torch.zeros(2)
    dist.reduce_scatter_tensor(part, torch.arange(4.0) * (rank + 1), group=column)
    seen["reduce_scatter_tensor"] = part.tolist()
    part = torch.zeros(3)
    dist.reduce_scatter(part, [torch.full((3,), r + 10.0 * rank) for r in range(2)], group=row)
    seen["reduce_scatter"] = part.tolist()
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=2 if rank % 2 == 0 else 3, group=column)  # src: a run rank
    seen["broadcast"] = b.tolist()
    dist.barrier(group=row)
    out = torch.zeros(4)
    dist.all_to_all_single(out, torch.arange(4.0) + 10 * rank, group=column)
    seen["all_to_all_single"] = out.tolist()
    g = dist.get_rank(column)  # group rank g sends 1 + g + j rows of 2 to group rank j
    sends, receives = [1 + g + j for j in range(2)], [1 + s + g for s in range(2)]
    out = torch.zeros(sum(receives), 2)
    dist.all_to_all_single(out, torch.arange(sum(sends) * 2.0).reshape(-1, 2) + 100 * rank,
                           receives, sends, group=column)
    seen["uneven_all_to_all_single"] = out.tolist()
    listed = [torch.zeros(2), torch.zeros(2)]
    dist.all_to_all(listed, [torch.full((2,), 10.0 * rank + j) for j in range(2)], group=row)
    seen["all_to_all"] = [t.tolist() for t in listed]
    if rank in (1, 2, 3):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=odd_three)
        seen["odd_three"] = t.item()
    objects = [None, None] if rank < 2 else None  # rank 0 gathers its column, rank 1 its own
    dist.gather_object({"rank": rank}, objects, dst=rank % 2, group=column)
    seen["gather_object"] = objects
    received = [None]
    dist.scatter_object_list(received, [f"to {r}" for r in (0, 2)] if rank == 0 else
                             [f"to {r}" for r in (1, 3)] if rank == 1 else None,
                             src=rank % 2, group=column)
    seen["scatter_object_list"] = received[0]

    if backend == "ddl":  # gloo has neither AVG nor PREMUL_SUM (FSDP2's reductions)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=column)
        seen["ddl_only_avg"] = t.item()
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=row)
        seen["ddl_only_premul_sum"] = t.item()

    # point to point, within a group (ranks global, as torch takes them) and a tag apart
    if rank in (0, 1):
        peer = 1 - rank
        first, second = torch.arange(3.0) + rank, torch.zeros(3)
        requests = [dist.isend(first, peer, group=row, tag=7), dist.irecv(second, peer, group=row, tag=7)]
        for request in requests:
            request.wait()
        seen["exchanged"] = second.tolist()
    if rank == 2:
        dist.send(torch.tensor([5.0, 6.0]), 3, group=row)
        dist.send(torch.tensor([7.0, 8.0]), 3)
    if rank == 3:
        one, two = torch.zeros(2), torch.zeros(2)
        dist.recv(one, 2, group=row)
        dist.recv(two, 2)
        seen["received"] = one.tolist() + two.tolist()

    # a 2-D mesh: slices, a flattened dimension, DTensor across both dimensions
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    seen["mesh_groups"] = (dist.get_process_group_ranks(mesh.get_group("dp")),
                           dist.get_process_group_ranks(mesh.get_group("tp")))
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    seen["flattened_size"] = flat.size()
    full = torch.arange(48.0).reshape(8, 6)
    both = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    seen["shard_shard_local"] = both.to_local().tolist()
    seen["redistributed"] = both.redistribute(mesh, [Replicate(), Shard(0)]).to_local().tolist()
    seen["full_tensor"] = both.full_tensor().tolist()
    partial = DTensor.from_local(torch.ones(2, 2) * (rank + 1), mesh["tp"], [Shard(0)])
    seen["over_tp"] = partial.full_tensor().tolist()
    return seen


def collectives_then_training(backend: str) -> dict:
    """Everything this module checks on 4 ranks, in one run per backend (a launch costs seconds)."""
    return {"collectives": subgroup_collectives(backend), "hsdp": large_models.train_hsdp(backend),
            "fsdp_tp": large_models.train_fsdp_tp(backend)}


@pytest.fixture(scope="module")
def runs():
    return {backend: run_on_ranks(collectives_then_training, NP, backend=backend)
            for backend in ("ddl", "gloo")}


@pytest.fixture(scope="module")
def collectives(runs):
    return {backend: [rank["collectives"] for rank in ranks] for backend, ranks in runs.items()}


def test_every_collective_over_a_sub_group_gives_what_gloo_gives(collectives):
    over_ddl, over_gloo = collectives["ddl"], collectives["gloo"]
    for rank, (ddl, gloo) in enumerate(zip(over_ddl, over_gloo)):
        assert {k for k in ddl if not k.startswith("ddl_only")} == gloo.keys(), rank
        for what in gloo:
            assert ddl[what] == gloo[what], (rank, what, ddl[what], gloo[what])


def test_sub_group_collectives_give_the_expected_values(collectives):
    """Against the arithmetic, so that a mistake shared with gloo (there is none) or a test
    that compares nothing would show."""
    seen = collectives["ddl"]
    assert [s["ranks"] for s in seen] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert seen[0]["all_reduce_sum"] == [4.0, 20.0] and seen[3]["all_reduce_max"] == [4.0, 30.0]
    assert seen[1]["all_reduce_product"] == [8.0, 300.0]  # (2 * 4, 10 * 30)
    assert seen[2]["async_in_place"] == seen[2]["async_future"] == [7.0] * 3
    assert seen[3]["all_gather"] == [[2.0, 2.0], [3.0, 3.0]]
    assert seen[2]["all_gather_into_tensor"] == [0.0, 0.0, 2.0, 2.0]
    assert seen[2]["reduce_scatter_tensor"] == [8.0, 12.0]  # (1 + 3) * [2, 3]
    assert seen[0]["broadcast"] == [2.0] * 3 and seen[1]["broadcast"] == [3.0] * 3
    assert seen[2]["all_to_all_single"] == [2.0, 3.0, 22.0, 23.0]
    assert seen[1]["odd_three"] == 6.0 and "odd_three" not in seen[0]
    assert seen[1]["gather_object"] == [{"rank": 1}, {"rank": 3}] and seen[2]["gather_object"] is None
    assert [s["scatter_object_list"] for s in seen] == ["to 0", "to 1", "to 2", "to 3"]
    assert seen[0]["exchanged"] == [1.0, 2.0, 3.0] and seen[1]["exchanged"] == [0.0, 1.0, 2.0]
    assert seen[3]["received"] == [5.0, 6.0, 7.0, 8.0]
    assert [s["ddl_only_avg"] for s in seen] == [2.0, 3.0, 2.0, 3.0]
    assert [s["ddl_only_premul_sum"] for s in seen] == [1.5, 1.5, 3.5, 3.5]
    assert seen[1]["mesh_groups"] == ([1, 3], [0, 1]) and seen[0]["flattened_size"] == 4
    assert seen[0]["full_tensor"] == torch.arange(48.0).reshape(8, 6).tolist()


# ---- the large-model stack -------------------------------------------------------------------

def assert_close(weights, reference) -> None:
    assert len(weights) == len(reference)
    for got, expected in zip(weights, reference):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_hsdp_and_fsdp_with_tensor_parallel_train_to_the_weights_of_gloo_and_one_process(runs, layout):
    alone = large_models.train_alone()
    over_ddl, over_gloo = runs["ddl"], runs["gloo"]
    for rank in range(NP):  # full_tensor() gathers the same on every rank
        assert all(torch.equal(w, r) for w, r in zip(over_ddl[rank][layout]["weights"],
                                                     over_ddl[0][layout]["weights"])), rank
        assert over_ddl[rank][layout]["losses"] == pytest.approx(over_gloo[rank][layout]["losses"],
                                                                 rel=RTOL)
    assert_close(over_ddl[0][layout]["weights"], over_gloo[0][layout]["weights"])
    assert_close(over_ddl[0][layout]["weights"], alone)


def test_each_rank_holds_its_shard_of_a_2d_layout(runs):
    hsdp = [result["hsdp"] for result in runs["ddl"]]
    # HSDP shards dim 0 over the 2 ranks of "shard": up.weight (32, 8) is 16 rows on each
    assert all(r["shard_shapes"][0] == (16, 8) for r in hsdp)
    # tensor parallel: up's 32 output columns, 16 per "tp" rank, and dp shards those rows again
    assert all(r["fsdp_tp"]["up_local_shape"] == (8, 8) for r in runs["ddl"])


# ---- what goes wrong, said ---------------------------------------------------------------------

def groups_created_wrongly() -> dict:
    """Each mistake in turn; every rank returns the errors it saw."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("ddl")
    rank = dist.get_rank()
    seen = {}
    try:  # ranks 0 and 1 create a group over [0, 1]; ranks 2 and 3 one over [0, 2, 3]
        pair = dist.new_group([0, 1] if rank < 2 else [0, 2, 3])
    except ValueError as exc:
        seen["different_ranks"] = str(exc)
    if rank == 0:  # rank 1 never joins this collective
        try:
            dist.all_reduce(torch.ones(1), group=pair)
        except RuntimeError as exc:
            seen["never_joined"] = str(exc)
    try:  # a mesh of 6 over a run of 4
        from torch.distributed.device_mesh import init_device_mesh

        init_device_mesh("cpu", (3, 2))
    except RuntimeError as exc:
        seen["mesh_too_big"] = str(exc)
    if rank == 2:  # the others never create it
        try:
            dist.new_group([2, 3])
        except RuntimeError as exc:
            seen["created_on_one_rank"] = str(exc)
    # rank 0 hosts torch's store, where rank 2 waited: it stays until rank 2 is done
    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        store.set("rank 2 is done", "")
    elif rank == 0:
        store.wait(["rank 2 is done"], timedelta(seconds=60))
    return seen


def test_groups_created_wrongly_end_with_errors_that_name_the_ranks_and_what_to_do():
    seen = run_on_ranks(groups_created_wrongly, NP, env={"DDL_MAGIC_TIMEOUT": "3"})
    assert "rank 1" in seen[0]["never_joined"], seen[0]
    for rank in (2, 3):
        message = seen[rank]["different_ranks"]
        assert "over ranks [0, 1]" in message and "[0, 2, 3]" in message, message
        assert "same ranks, in the same order" in message
    assert "different_ranks" not in seen[0] and "different_ranks" not in seen[1]
    assert all("Mesh should not be bigger than default world size 4, but found 6 ranks"
               in s["mesh_too_big"] for s in seen)  # torch's words, before any group is made
    message = seen[2]["created_on_one_rank"]
    assert "ranks [3]" in message and "DDL_MAGIC_TIMEOUT" in message and "new_group" in message, message
