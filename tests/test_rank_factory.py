"""The rank factory: ranks are forked from a warm process that never initialises CUDA, and a
factory that died is replaced."""

import os
import time

from ddl_magic.launch import local
from ddl_magic.rank.factory import SPARE_NAME
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


# ---- spares: ranks forked ahead of the next run's requests --------------------------------

def spares_of(factory) -> list:
    import psutil

    spares = []
    for child in psutil.Process(factory._process.pid).children():
        try:
            if child.name() == SPARE_NAME:
                spares.append(child)
        except psutil.NoSuchProcess:  # a rank of the last run that ended since it was listed
            continue
    return spares


def wait_for_spares(factory, count: int, timeout_s: float = 30) -> list:
    """The factory's spares, once it has `count` of them (it forks them while idle)."""
    deadline = time.monotonic() + timeout_s
    while len(spares := spares_of(factory)) < count:
        assert time.monotonic() < deadline, f"the factory has {len(spares)} spares, not {count}"
        time.sleep(0.05)  # polling the process table: nothing to wait on
    return spares


def test_after_a_run_the_factory_keeps_as_many_spares_and_the_next_run_s_ranks_are_them():
    factory = local.rank_factory()
    run_on_ranks(rank_and_pid, 3)
    spares = wait_for_spares(factory, 3)
    assert len(spares) == 3
    results = run_on_ranks(rank_and_pid, 3)
    assert {pid for _, pid, _ in results} == {spare.pid for spare in spares}
    assert {parent for _, _, parent in results} == {factory._process.pid}


def open_descriptors() -> list:
    import os

    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))


def test_a_spare_holds_nothing_of_the_factory_and_a_rank_made_of_it_is_named_as_any_rank():
    import psutil

    factory = local.rank_factory()
    run_on_ranks(rank_and_pid, 2)
    spare = wait_for_spares(factory, 2)[0]
    # stdin, its stdout and stderr pipes, the socket its request comes on: nothing else (no
    # other spare's socket, which would keep that spare alive after the factory)
    assert len(spare.open_files()) == 0 and spare.num_fds() == 4
    assert {spare.terminal()} == {None} and os.getsid(spare.pid) == spare.pid  # its own session
    ranks = run_on_ranks(lambda: __import__("psutil").Process().name(), 2)
    assert SPARE_NAME not in ranks and len(set(ranks)) == 1
    # the rank made of it exited (its exit was reported as it closed its output; the kernel
    # takes its memory down and the factory reaps it a moment later)
    _, alive = psutil.wait_procs([spare], timeout=10)
    assert not alive


def test_a_spare_killed_while_it_waits_is_not_a_rank_s_exit_and_runs_go_on():
    import psutil

    factory = local.rank_factory()
    run_on_ranks(rank_and_pid, 2)
    spares = wait_for_spares(factory, 2)
    for spare in spares:
        spare.kill()
    psutil.wait_procs(spares, timeout=10)
    results = run_on_ranks(rank_and_pid, 2)
    assert [rank for rank, _, _ in results] == [0, 1]


def test_spares_end_with_their_factory():
    import psutil

    factory = local.rank_factory()
    run_on_ranks(rank_and_pid, 2)
    spares = wait_for_spares(factory, 2)
    factory.end()
    gone, alive = psutil.wait_procs(spares, timeout=10)
    assert alive == []
