"""Plain torch.distributed code (DDP, FSDP) on local ranks: torchrun's environment, the `ddl`
backend, and `TorchDistributor` as pyspark's users call it."""

import json
import subprocess
import sys

import pytest
import torch

import training
from ddl_magic import HorovodRunner, RankFailedError, TorchDistributor
from ranks import run_on_ranks

RUN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def reference_weights():
    return training.train_alone()


def test_every_rank_sees_torchruns_and_horovods_environment(monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_TEST_HOSTS", "a,b,a,b")  # two "hosts", ranks interleaved
    env = run_on_ranks(training.launcher_environment, 4)
    for rank, seen in enumerate(env):
        assert seen["RANK"] == seen["HOROVOD_RANK"] == seen["ROLE_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["HOROVOD_SIZE"] == "4"
        assert seen["LOCAL_RANK"] == seen["HOROVOD_LOCAL_RANK"] == str(rank // 2)
        assert seen["LOCAL_WORLD_SIZE"] == seen["HOROVOD_LOCAL_SIZE"] == "2"
        assert seen["GROUP_RANK"] == seen["NODE_RANK"] == seen["HOROVOD_CROSS_RANK"] == str(rank % 2)
        assert seen["GROUP_WORLD_SIZE"] == seen["HOROVOD_CROSS_SIZE"] == "2"
        assert seen["MASTER_ADDR"] == "127.0.0.1"
    # One store address and one run id for the whole run, a real port.
    assert len({(s["MASTER_ADDR"], s["MASTER_PORT"], s["TORCHELASTIC_RUN_ID"]) for s in env}) == 1
    assert 0 < int(env[0]["MASTER_PORT"]) < 65536 and env[0]["TORCHELASTIC_RUN_ID"]


@pytest.mark.parametrize("backend", ["gloo", "ddl"])
@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_ddp_trains_to_the_weights_of_one_process(np, backend, reference_weights):
    runner = HorovodRunner(np=-np, driver_log_verbosity="log_callback_only", timeout=RUN_TIMEOUT_S)
    weights, checksums = runner.run(training.train, backend=backend)
    training.assert_same_weights(weights, reference_weights)
    assert len(set(checksums)) == 1, f"ranks ended with different weights: {checksums}"


@pytest.mark.parametrize("backend", ["gloo", "ddl"])
def test_fsdp_trains_to_the_weights_of_one_process(backend):
    # FSDP's all-gathers and reduce-scatters deliver into tensors after the collective
    # completes: enough steps that a result read too early would show.
    results = run_on_ranks(training.train, 2, backend=backend, wrapper="fsdp", steps=20)
    reference = training.train_alone(steps=20)
    for weights, _ in results:
        training.assert_same_weights(weights, reference)


@pytest.mark.parametrize("backend", ["gloo", "ddl"])
def test_a_rank_killed_mid_step_fails_the_run_naming_it(backend):
    runner = HorovodRunner(np=-3, driver_log_verbosity="log_callback_only", timeout=RUN_TIMEOUT_S)
    with pytest.raises(RankFailedError) as failure:
        runner.run(training.train, backend=backend, steps=10_000, kill_rank=1)
    assert failure.value.rank == 1
    assert "SIGKILL" in str(failure.value)
    assert failure.value.exit_code == -9 and failure.value.run.ranks[1].exit_code == -9


def ddl_backend_behaviour():
    """The ddl backend's async works, its errors, and what it refuses."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("ddl")
    rank = dist.get_rank()
    seen = {}
    work = dist.all_reduce(torch.full((3,), rank + 1.0), async_op=True)
    seen["future"] = work.get_future().wait()[0].tolist()
    work.wait()
    work = dist.all_reduce(torch.ones(2 + rank), async_op=True)  # shapes differ across ranks
    try:
        work.wait()
    except Exception as exc:
        seen["mismatch"] = str(exc)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    seen["max"] = total.item()
    for name, call in (("recv_from_any", lambda: dist.recv(torch.ones(1))),
                       ("bitwise", lambda: dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.BAND))):
        try:
            call()
        except (NotImplementedError, RuntimeError) as exc:
            seen[name] = str(exc)
    gathered = torch.zeros(4)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    seen["all_gather_into_tensor"] = gathered.tolist()
    part = torch.zeros(2)
    dist.reduce_scatter_tensor(part, torch.arange(4.0) * (rank + 1))
    seen["reduce_scatter_tensor"] = part.tolist()
    # The names torch 2.11 calls them by (a GPU machine's image holds 2.11).
    from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions, ReduceScatterOptions

    world, summed = dist.distributed_c10d._get_default_group(), ReduceScatterOptions()
    summed.reduceOp = dist.ReduceOp.SUM
    mine, whole = torch.full((2,), float(rank)), torch.arange(4.0) * (rank + 1)
    outputs = {name: torch.zeros(size) for name, size in (("_allgather_base", 4), ("_reduce_scatter_base", 2),
               ("allgather_into_tensor_coalesced", 4), ("reduce_scatter_tensor_coalesced", 2), ("alltoall_base", 2))}
    world._allgather_base(outputs["_allgather_base"], mine, AllgatherOptions()).wait()
    world._reduce_scatter_base(outputs["_reduce_scatter_base"], whole, summed).wait()
    world.allgather_into_tensor_coalesced([outputs["allgather_into_tensor_coalesced"]], [mine],
                                          AllgatherOptions()).wait()
    world.reduce_scatter_tensor_coalesced([outputs["reduce_scatter_tensor_coalesced"]], [whole], summed).wait()
    world.alltoall_base(outputs["alltoall_base"], torch.tensor([10.0 * rank, 10.0 * rank + 1]), [], [],
                        AllToAllOptions()).wait()
    seen["older names"] = {name: output.tolist() for name, output in outputs.items()}
    dist.barrier()
    return seen


def test_the_ddl_backend_completes_futures_reports_errors_and_names_what_it_lacks():
    seen = run_on_ranks(ddl_backend_behaviour, 2)
    for rank, result in enumerate(seen):
        assert result["future"] == [3.0, 3.0, 3.0]
        assert "mismatch" in result and "shape" in result["mismatch"].lower()
        assert result["max"] == 2.0
        assert "recv without src is not supported" in result["recv_from_any"]
        assert "src=" in result["recv_from_any"]
        assert "BAND" in result["bitwise"]
        assert result["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        # Sum over ranks of arange(4) * (rank + 1) = 3 * arange(4); each rank keeps its half.
        assert result["reduce_scatter_tensor"] == [[0.0, 3.0], [6.0, 9.0]][rank]
        assert result["older names"] == {
            "_allgather_base": [0.0, 0.0, 1.0, 1.0], "allgather_into_tensor_coalesced": [0.0, 0.0, 1.0, 1.0],
            "_reduce_scatter_base": [[0.0, 3.0], [6.0, 9.0]][rank],
            "reduce_scatter_tensor_coalesced": [[0.0, 3.0], [6.0, 9.0]][rank],
            "alltoall_base": [[0.0, 10.0], [1.0, 11.0]][rank]}


def test_ddp_collectives_over_ddl_are_on_the_timeline(tmp_path):
    path = tmp_path / "ddp.json"
    runner = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only", timeline=str(path),
                           timeout=RUN_TIMEOUT_S)
    runner.run(training.train, backend="ddl")
    events = json.loads(path.read_text())["traceEvents"]
    labels = {f"{e.get('name', '')} {e.get('args', '')}" for e in events}
    assert any("ddl0.allreduce" in label for label in labels), sorted(labels)[:20]


# ---- TorchDistributor ------------------------------------------------------------------------

def add_ranks(offset, scale=1.0):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(total)
    return total.item() * scale, dist.get_world_size()


SCRIPT = """
import sys, torch, torch.distributed as dist
dist.init_process_group(sys.argv[1])
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} args {sys.argv[2:]} total {total.item()}")
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_torch_distributor_runs_a_function_with_its_arguments_and_returns_rank_0s_result():
    distributor = TorchDistributor(num_processes=3, local_mode=True, use_gpu=False)
    assert distributor.run(add_ranks, 1.0, scale=2.0) == (12.0, 3)  # (0+1 + 1+1 + 2+1) * 2


@pytest.mark.parametrize("backend", ["gloo", "ddl"])
def test_torch_distributor_runs_a_script_with_its_arguments(script, backend, capfd):
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    assert distributor.run(str(script), backend, "--epochs", 3) is None
    out = capfd.readouterr().out
    for rank in range(2):
        assert f"[{rank}] rank {rank} of 2 args ['--epochs', '3'] total 1.0" in out
    assert distributor.last_run.status == "done"


def test_torch_distributor_refuses_what_pyspark_refuses_before_starting_anything(script):
    with pytest.raises(ValueError, match="positive integer"):
        TorchDistributor(num_processes=0)
    with pytest.raises(ValueError, match="command-line arguments only"):
        TorchDistributor(num_processes=2, use_gpu=False).run(str(script), epochs=3)
    with pytest.raises(FileNotFoundError, match="not_there.py"):
        TorchDistributor(num_processes=2, use_gpu=False).run("not_there.py")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_gpu=True"):
            TorchDistributor(num_processes=2).run(add_ranks, 0.0)  # pyspark's default: GPUs


def test_ddlrun_runs_plain_ddp_scripts(script):
    for backend in ("gloo", "ddl"):
        result = subprocess.run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "2", str(script),
                                 backend], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                                cwd=script.parent)
        assert result.returncode == 0, result.stderr
        assert "[1] rank 1 of 2 args [] total 1.0" in result.stdout


def test_the_ddl_backend_outside_a_ddl_magic_launch_says_how_to_launch():
    import torch.distributed as dist

    import ddl_magic.torch  # noqa: F401 (registers the backend, as in a user's script)

    with pytest.raises(RuntimeError, match="ddlrun -np N"):
        dist.init_process_group("ddl", store=dist.HashStore(), rank=0, world_size=2)
    assert not dist.is_initialized()
