"""Sharded checkpoints over the `ddl` backend: `torch.distributed.checkpoint` (DCP) saves an
FSDP2 or HSDP model and its optimizer from 4 ranks, in the background or not, and loads them
on 2; ZeRO-1's sharded optimizer state goes through DCP with every rank writing its own share;
a pool saves in one cell and a pool of another size loads in the next."""

import pytest
import torch

import large_models
from ranks import run_on_ranks

import ddl_magic


def fully_sharded(mesh_shape: tuple):
    """The test model and its Adam, FSDP2 (1-D mesh) or HSDP (2-D), on a ddl group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("ddl")
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = large_models.block_model()
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def everything(model, optimizer) -> dict:
    """The full weights and Adam moments (DTensor.full_tensor(): a collective)."""
    return {"weights": large_models.full_weights(model),
            "moments": [optimizer.state[p][key].full_tensor().clone()
                        for p in model.parameters() for key in ("exp_avg", "exp_avg_sq")]}


def train_and_save(path: str, mesh_shape: tuple, in_background: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = fully_sharded(mesh_shape)
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = large_models.data()
    large_models.train(model, (x[rank::size], y[rank::size]), steps=3, optimizer=optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if in_background:
        dcp.async_save(state, checkpoint_id=path).result()
    else:
        dcp.save(state, checkpoint_id=path)
    return everything(model, optimizer)


def load(path: str) -> dict:
    """Load into FSDP2 on a 1-D mesh of whatever size this run has."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = fully_sharded((int(os.environ["WORLD_SIZE"]),))
    model_state, optimizer_state = get_state_dict(model, optimizer)  # creates Adam's state
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return {**everything(model, optimizer), "world": dist.get_world_size()}


def assert_equal_states(loaded: dict, saved: dict) -> None:
    for what in ("weights", "moments"):
        assert len(loaded[what]) == len(saved[what])
        for got, expected in zip(loaded[what], saved[what]):
            assert torch.equal(got, expected), what


@pytest.mark.parametrize("mesh_shape, in_background", [((4,), False), ((2, 2), True)],
                         ids=["fsdp2-save", "hsdp-async_save"])
def test_a_checkpoint_saved_on_4_ranks_loads_on_2(tmp_path, mesh_shape, in_background):
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(train_and_save, 4, path=path, mesh_shape=mesh_shape,
                         in_background=in_background)[0]
    loaded = run_on_ranks(load, 2, path=path)
    assert [result["world"] for result in loaded] == [2, 2]
    for result in loaded:
        assert_equal_states(result, saved)


# ---- ZeRO-1 (hvd.DistributedOptimizer(shard_optimizer_state=True)) through DCP ---------------

def zero1(steps: int):
    import torch.distributed as dist

    import ddl_magic.torch as hvd

    hvd.init()
    dist.init_process_group("ddl")  # DCP's collectives
    model = large_models.block_model(checkpointed=False)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         shard_optimizer_state=True)
    x, y = large_models.data()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[hvd.rank()::hvd.size()]),
                                          y[hvd.rank()::hvd.size()]).backward()
        optimizer.step()
    return model, optimizer


def whole_state(model, optimizer) -> dict:
    optimizer.consolidate_state_dict(to=0)  # gathered here only to compare, never to save
    import ddl_magic.torch as hvd

    state = optimizer.state_dict() if hvd.rank() == 0 else None
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": state}


def zero1_save(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, optimizer = zero1(steps=3)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.sharded_state_dict()},
             checkpoint_id=path)
    return whole_state(model, optimizer)


def zero1_load(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, optimizer = zero1(steps=0)
    state = {"model": model.state_dict(), "optimizer": optimizer.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_sharded_state_dict(state["optimizer"])
    return whole_state(model, optimizer)


def test_zero1_state_goes_through_dcp_from_every_rank_and_loads_on_fewer(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "zero1")
    saved = run_on_ranks(zero1_save, 4, path=path)[0]
    loaded = run_on_ranks(zero1_load, 2, path=path)[0]
    for name, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    for index, state in saved["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["optimizer"]["state"][index][key], value), (index, key)
    # Nothing was gathered to save: every rank wrote the moments of its own quarter.
    metadata = dcp.FileSystemReader(path).read_metadata()
    moments_per_file = {}
    for index, where in metadata.storage_data.items():
        if index.fqn.endswith(("exp_avg", "exp_avg_sq")):
            chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks
                         if c.offsets == index.offset)
            moments_per_file[where.relative_path] = (moments_per_file.get(where.relative_path, 0)
                                                     + chunk.sizes.numel())
    every_moment = 2 * sum(t.numel() for t in saved["model"].values())
    assert len(moments_per_file) == 4 and sum(moments_per_file.values()) == every_moment
    assert max(moments_per_file.values()) - min(moments_per_file.values()) <= 2, moments_per_file


# ---- in a pool -----------------------------------------------------------------------------

def test_a_pool_saves_in_one_cell_and_a_smaller_pool_loads_in_the_next(tmp_path):
    path = str(tmp_path / "pool-checkpoint")
    with ddl_magic.start(np=4, quiet=True) as pool:
        saved = pool.run(train_and_save, path=path, mesh_shape=(2, 2), in_background=False)
    with ddl_magic.start(np=2, quiet=True) as pool:
        loaded = pool.run(load, path=path)
    assert loaded["world"] == 2
    assert_equal_states(loaded, saved)


# ---- what goes wrong, said -------------------------------------------------------------------

def save_to(path: str) -> str:
    import torch.distributed.checkpoint as dcp

    model, _ = fully_sharded((2,))
    try:
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    except BaseException as exc:  # DCP's CheckpointException is no Exception
        return str(exc)
    return "saved"


def test_a_checkpoint_to_an_unwritable_path_says_which_path_and_which_ranks(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    seen = run_on_ranks(save_to, 2, path=str(blocked / "checkpoint"))
    for message in seen:
        assert "RANK 0" in message and "RANK 1" in message, message
        assert f"Not a directory: '{blocked / 'checkpoint'}'" in message, message
