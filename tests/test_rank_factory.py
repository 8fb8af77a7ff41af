"""The rank factory: ranks are forked from a warm process that never initialises CUDA, and a
factory that died is replaced."""

import os

from ddl_magic.launch import local
from ranks import run_on_ranks

CUDA_RECORDING_STUB = '''"""A CUDA-free torch.cuda: each call that would initialise CUDA is recorded
("pid name" into $DDL_MAGIC_TEST_CUDA_CALLS) and answers as a machine without a GPU."""
import os

import torch


def _recording(name, answer):
    def call(*args, **kwargs):
        with open(os.environ["DDL_MAGIC_TEST_CUDA_CALLS"], "a") as calls:
            calls.write(f"{os.getpid()} {name}\\n")
        return answer
    return call


for _name, _answer in (("init", None), ("_lazy_init", None), ("is_available", False),
                       ("device_count", 0), ("set_device", None), ("current_device", 0)):
    setattr(torch.cuda, _name, _recording(_name, _answer))
'''


def rank_and_pid():
    import os

    import ddl_magic.torch as hvd

    hvd.init()
    return hvd.rank(), os.getpid(), os.getppid()


def test_ranks_are_children_of_the_factory():
    factory = local.rank_factory()
    results = run_on_ranks(rank_and_pid, 2)
    assert [rank for rank, _, _ in results] == [0, 1]
    assert {parent for _, _, parent in results} == {factory._process.pid}


def rank_that_asks_for_cuda():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    torch.cuda.is_available()  # as a user's cell does: recorded, under this rank's pid
    return os.getpid()


def test_the_factory_never_initialises_cuda_so_a_kernel_that_did_still_launches(tmp_path, monkeypatch):
    """A notebook kernel that touched CUDA cannot fork ranks; the factory can, as long as it
    never touches CUDA itself: every CUDA call of a factory started with a recording stub
    comes from a rank, after the fork."""
    (tmp_path / "sitecustomize.py").write_text(CUDA_RECORDING_STUB)
    calls = tmp_path / "cuda_calls"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DDL_MAGIC_TEST_CUDA_CALLS", str(calls))
    previous = local.rank_factory()  # replaced by one that starts with the stub
    previous._process.kill()
    previous._process.wait(timeout=10)
    try:
        rank_pids = run_on_ranks(rank_that_asks_for_cuda, 1)
        factory = local.rank_factory()
        callers = {int(line.split()[0]) for line in calls.read_text().splitlines()}
        assert callers == set(rank_pids)  # the ranks' own calls, recorded: the stub was there
        assert factory._process.pid not in callers
    finally:
        stubbed = local.rank_factory()
        stubbed._process.kill()  # the next run starts a factory without the stub
        stubbed._process.wait(timeout=10)


def test_a_factory_that_died_is_replaced_by_the_next_run():
    dead = local.rank_factory()
    dead._process.kill()
    dead._process.wait(timeout=10)
    results = run_on_ranks(rank_and_pid, 2)
    assert [rank for rank, _, _ in results] == [0, 1]
    assert local.rank_factory() is not dead
