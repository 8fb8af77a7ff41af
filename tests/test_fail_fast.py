"""Fail-fast that is right both ways: a healthy rank is never failed (DDP over gloo tearing
down, a rank holding its GIL in native code), and a stuck run never hangs (a collective that
one rank never joins ends after DDL_MAGIC_TIMEOUT, on every plane)."""

import os
import subprocess
import sys
import textwrap

import pytest

from ddl_magic import TorchDistributor
from ddl_magic.driver.run_result import RankFailedError
from kernel import Kernel
from ranks import run_on_ranks

# The README's "Coming from TorchDistributor" code, whole: it deadlocked in gloo's destructor
# on most runs, after training (group_lifetime.py says why).
DDP_OVER_GLOO = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    x, y = torch.randn(32, 20), torch.randint(0, 2, (32,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(f"trained rank {dist.get_rank()}")
dist.destroy_process_group()
"""
RUNS = 3  # it failed 3 of 4 runs before: three clean runs in a row rule that out


def test_ddp_over_gloo_ends_cleanly_as_a_ddlrun_script(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_OVER_GLOO)
    for run in range(RUNS):
        finished = subprocess.run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "2", "python",
                                   str(script)], capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path)
        assert finished.returncode == 0, f"run {run}: {finished.stdout}{finished.stderr}"
        assert "[0] trained rank 0" in finished.stdout and "[1] trained rank 1" in finished.stdout


def ddp_over_gloo():
    exec(compile(DDP_OVER_GLOO, "<ddp>", "exec"), {"__name__": "__main__"})
    import torch.distributed  # the group is destroyed, its model dropped with the namespace

    return not torch.distributed.is_initialized()


def test_ddp_over_gloo_ends_cleanly_through_torch_distributor():
    for _ in range(RUNS):
        assert TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
            ddp_over_gloo) is True


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"}, cwd=str(tmp_path_factory.mktemp("nb")))
    assert kernel.run("%load_ext ddl_magic").error is None
    yield kernel
    kernel.close()


def test_ddp_over_gloo_ends_cleanly_in_a_horovod_cell(kernel):
    for run in range(RUNS):
        out = kernel.run("%%horovod -np 2\n" + DDP_OVER_GLOO, timeout=120)
        assert out.error is None, f"run {run}: {out.error}\n{out.text}"
        assert "trained rank 0" in out.text and "trained rank 1" in out.text


def hold_the_gil_on_rank_1(seconds: int) -> float:
    import ctypes

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="before")
    if hvd.rank() == 1:
        # libc's sleep() called through PyDLL keeps the GIL for its whole length: to every
        # Python thread of this rank, the process is gone, as in a long torch.save or C call.
        ctypes.PyDLL(None).sleep(seconds)
    return hvd.allreduce(torch.ones(1), name="after").item()  # rank 0 waits here meanwhile


def test_a_rank_holding_its_gil_in_native_code_for_30_s_is_alive(monkeypatch):
    from ddl_magic.wire.channel import DEFAULT_PEER_TIMEOUT_S, PEER_TIMEOUT_VARIABLE

    monkeypatch.delenv(PEER_TIMEOUT_VARIABLE, raising=False)
    seconds = 30
    assert seconds > 2 * DEFAULT_PEER_TIMEOUT_S  # it outlasts the peer timeout, twice over
    assert run_on_ranks(hold_the_gil_on_rank_1, 2, timeout_s=120, seconds=seconds) == [1.0, 1.0]


def one_rank_never_joins(absent: int, plane: str) -> None:
    import threading

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    process_set = hvd.add_process_set([0, 1]) if plane == "process set" else None
    if plane == "ddl backend":
        import torch.distributed as dist

        dist.init_process_group("ddl")
    if hvd.rank() == absent:
        threading.Event().wait(120)  # alive, and elsewhere in its code
        return
    if process_set is not None and not process_set.included():
        return
    tensor = torch.ones(2)
    if plane == "ddl backend":
        dist.all_reduce(tensor)
    elif process_set is not None:
        hvd.allreduce(tensor, name="gradient.0", process_set=process_set)
    else:
        hvd.allreduce(tensor, name="gradient.0")


PLANES = {  # plane -> (np, the environment that selects it, the rank that never comes)
    "shared memory": (2, {}, 1),
    "tcp": (2, {"DDL_MAGIC_TRANSPORT": "tcp"}, 1),
    "tcp, the coordinator absent": (2, {"DDL_MAGIC_TRANSPORT": "tcp"}, 0),
    "hierarchical": (4, {"DDL_MAGIC_TEST_HOSTS": "a,a,b,b"}, 1),
    "process set": (3, {}, 1),
    "ddl backend": (2, {}, 1),
    "torch.distributed (gloo)": (2, {"DDL_MAGIC_TORCH_PLANE": "gloo"}, 1),
}


@pytest.mark.parametrize("plane", PLANES)
def test_a_collective_that_one_rank_never_joins_fails_after_the_timeout(plane, monkeypatch):
    np, env, absent = PLANES[plane]
    for name, value in env.items():  # (host names are read as the ranks register)
        monkeypatch.setenv(name, value)
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(one_rank_never_joins, np, timeout_s=60, env={"DDL_MAGIC_TIMEOUT": "3"},
                     absent=absent, plane=plane)
    error = failure.value
    assert error.rank != absent and error.reason == "collective timed out", error
    assert "timed out after 3 s (DDL_MAGIC_TIMEOUT)" in error.traceback
    assert f"ranks [{absent}] never submitted it" in error.traceback
    if plane != "ddl backend":  # (torch.distributed names its tensors itself)
        assert "'gradient.0'" in error.traceback
    assert error.run.ranks[absent].status == "stopped"  # alive, and stopped by the driver


def test_the_stall_report_comes_before_the_timeout(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import threading, torch, ddl_magic.torch as hvd
        hvd.init()
        if hvd.rank() == 0:
            hvd.allreduce(torch.ones(3), name="grads")
        else:
            threading.Event().wait(120)
    """))
    finished = subprocess.run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "2", "--env",
                               "DDL_MAGIC_TIMEOUT=3", "python", str(script)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "HOROVOD_STALL_CHECK_TIME_SECONDS": "60"})
    assert finished.returncode == 1
    output = finished.stdout + finished.stderr
    stall = output.index("stall: tensor 'grads' was submitted by ranks [0]")
    assert stall < output.index("timed out after 3 s"), output


def hang_after_finishing() -> int:
    import atexit
    import signal
    import threading

    import ddl_magic.torch as hvd

    hvd.init()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and the driver's SIGTERM goes unheard
    atexit.register(threading.Event().wait)  # runs after the rank reported: hangs for ever
    return hvd.rank()


def test_a_rank_that_hangs_after_reporting_is_killed_and_the_run_stands():
    from ddl_magic.driver.job import Job, JobOptions
    from ddl_magic.launch.local import LocalLauncher
    from ddl_magic.wire.tasks import FunctionTask

    options = JobOptions(timeout_s=60, return_all=True, hide_output=True)
    run = Job(FunctionTask(hang_after_finishing), 2, LocalLauncher(), options).run()
    assert run.status == "done" and run.results == [0, 1]
    for rank in run.ranks:
        assert rank.status == "done" and rank.exit_code == -9
        assert "this rank had finished, but its process did not exit" in run.log(rank.rank)
