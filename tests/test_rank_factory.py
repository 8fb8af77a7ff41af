"""The rank factory: ranks are forked from a warm process, and a factory that died is replaced."""

from ddl_magic.launch import local
from ranks import run_on_ranks


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


def test_a_factory_that_died_is_replaced_by_the_next_run():
    dead = local.rank_factory()
    dead._process.kill()
    dead._process.wait(timeout=10)
    results = run_on_ranks(rank_and_pid, 2)
    assert [rank for rank, _, _ in results] == [0, 1]
    assert local.rank_factory() is not dead
