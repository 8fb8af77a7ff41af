"""The lockstep negotiation (`runtime/lockstep.py`) and the hypercube schedules under it, on
simulated ranks in one process (`hypercube.run_in_memory`): the same code the op queue runs
over sockets, every rank's side of every cycle."""

from __future__ import annotations

import math

import pytest
import torch

from ddl_magic.runtime.lockstep import LockstepNegotiator
from ddl_magic.runtime.negotiation import Request
from ddl_magic.runtime.planes.binomial_tree import broadcast, gather
from ddl_magic.runtime.planes.hypercube import links_to_open, partners, run_in_memory
from ddl_magic.runtime.planes.recursive_doubling import (TensorReducible, recursive_doubling,
                                                         rounds)


def grad(name: str, shape=(4,)) -> Request:
    return Request(name, "allreduce", torch.float32, shape, 1)


def negotiators(size: int, stall_time_s: float = 60.0, timeout_s: float = 300.0):
    return [LockstepNegotiator(tuple(range(size)), p, tuple(range(size)), 1 << 20, 0.001,
                               stall_time_s, timeout_s) for p in range(size)]


def cycle(ranks, now: float):
    outcomes, counts = run_in_memory({p: n.cycle(now) for p, n in enumerate(ranks)})
    answers = {repr(outcomes[p].cycle.responses) for p in outcomes}
    assert len(answers) == 1, "ranks disagree on the cycle's responses"
    return outcomes[0], counts


@pytest.mark.parametrize("size", range(1, 18))
def test_recursive_doubling_gives_every_rank_the_exact_sum(size):
    numel = 5
    buffers = [torch.arange(numel, dtype=torch.int64) * 1000 + p for p in range(size)]
    expected = sum(buffers, torch.zeros(numel, dtype=torch.int64))
    scratch = [torch.empty(numel, dtype=torch.int64) for _ in range(size)]
    _, counts = run_in_memory({p: recursive_doubling(
        p, size, TensorReducible(buffers[p], scratch[p], lambda dst, src: dst.add_(src)))
        for p in range(size)})
    assert all(torch.equal(buffer, expected) for buffer in buffers)
    assert (size - 1).bit_length() <= max(c.rounds for c in counts.values()) + 1 <= rounds(size) + 1


@pytest.mark.parametrize("size", range(1, 18))
def test_the_binomial_tree_gathers_at_0_and_broadcasts_from_it_in_log_rounds(size):
    gathered, counts = run_in_memory({p: gather(p, size, bytes([p])) for p in range(size)})
    assert gathered[0] == [bytes([p]) for p in range(size)]
    assert counts[0].messages_received == (size - 1).bit_length()
    spread, counts = run_in_memory({p: broadcast(p, size, b"x" if p == 0 else None)
                                    for p in range(size)})
    assert set(spread.values()) == {b"x"}
    assert max(c.rounds for c in counts.values()) <= (size - 1).bit_length()


def test_every_link_joins_positions_one_bit_apart_and_is_opened_once():
    members = tuple(range(11))
    for rank in members:
        assert all(bin(rank ^ partner).count("1") == 1 for partner in partners(rank, 11))
        assert len(partners(rank, 11)) <= math.ceil(math.log2(11))
    opened = [(rank, to) for rank in members for to in links_to_open(rank, members)[0]]
    accepted = [(frm, rank) for rank in members for frm in links_to_open(rank, members)[1]]
    assert sorted(opened) == sorted(accepted) and len(set(opened)) == len(opened)


def test_the_first_step_goes_through_rank_0_and_the_next_through_the_cache_alone():
    ranks = negotiators(6)
    for n in ranks:
        n.add([grad("a"), grad("b")], 0.0)
    first, _ = cycle(ranks, 0.0)
    assert first.coordinated and [r.names for r in first.cycle.responses] == [("a", "b")]
    for n in ranks:
        n.add([grad("a"), grad("b")], 1.0)
    steady, counts = cycle(ranks, 1.0)
    assert not steady.coordinated and [r.names for r in steady.cycle.responses] == [("a", "b")]
    assert counts[0].messages_received <= math.ceil(math.log2(6)) + 2


def test_a_cached_tensor_runs_once_every_rank_has_submitted_it():
    ranks = negotiators(4)
    for n in ranks:
        n.add([grad("a")], 0.0)
    cycle(ranks, 0.0)
    for n in ranks[:3]:
        n.add([grad("a")], 1.0)
    waiting, _ = cycle(ranks, 1.0)
    assert waiting.cycle.responses == [] and not waiting.coordinated
    ranks[3].add([grad("a")], 1.1)
    done, _ = cycle(ranks, 1.1)
    assert [r.names for r in done.cycle.responses] == [("a",)] and not done.coordinated


def test_a_changed_shape_on_one_rank_is_a_mismatch_error_on_every_rank():
    ranks = negotiators(3)
    for n in ranks:
        n.add([grad("a")], 0.0)
    cycle(ranks, 0.0)
    ranks[0].add([grad("a")], 1.0)
    ranks[1].add([grad("a")], 1.0)
    ranks[2].add([grad("a", shape=(5,))], 1.0)
    outcome, _ = cycle(ranks, 1.0)
    [response] = outcome.cycle.responses
    assert outcome.coordinated and "mismatched" in response.error and "[0, 2]" in response.error


def test_a_joined_rank_takes_part_with_zeros_through_rank_0():
    ranks = negotiators(3)
    for n in ranks:
        n.add([grad("a")], 0.0)
    cycle(ranks, 0.0)
    ranks[2].add([Request.of("join", "join", None)], 1.0)
    ranks[0].add([grad("a")], 1.0)
    ranks[1].add([grad("a")], 1.0)
    outcome, _ = cycle(ranks, 1.0)
    [response] = outcome.cycle.responses
    assert outcome.coordinated and response.names == ("a",) and response.for_joined_ranks


def test_a_long_wait_goes_to_rank_0_which_reports_the_stall_then_times_it_out():
    ranks = negotiators(3, stall_time_s=10.0, timeout_s=20.0)
    for n in ranks:
        n.add([grad("a")], 0.0)
    cycle(ranks, 0.0)
    ranks[0].add([grad("a")], 100.0)
    ranks[1].add([grad("a")], 100.0)
    assert ranks[0].next_cycle_at() == pytest.approx(100.001)
    cycle(ranks, 100.001)  # rank 2 has not submitted it: nothing runs
    assert ranks[0].next_cycle_at() == pytest.approx(105.0)  # half the stall time
    announced, _ = cycle(ranks, 105.0)
    assert announced.coordinated and not announced.warnings
    assert ranks[0].next_cycle_at() == pytest.approx(110.0)  # the stall report, from submission
    stalled, _ = cycle(ranks, 110.0)
    assert stalled.warnings and "ranks [2] have not submitted" in stalled.warnings[0]
    timed_out, _ = cycle(ranks, 120.0)
    assert "timed out after 20 s" in timed_out.timed_out and "ranks [2] never" in timed_out.timed_out


def test_an_allgather_is_never_cached_and_always_asks_rank_0():
    ranks = negotiators(2)
    for step in range(2):
        for p, n in enumerate(ranks):
            n.add([Request("g", "allgather", torch.float32, (p + 1, 2))], float(step))
        outcome, _ = cycle(ranks, float(step))
        assert outcome.coordinated and outcome.cycle.responses[0].first_dims == (1, 2)


def test_a_name_that_comes_back_with_a_shape_it_had_before_stays_cached():
    # The ddl backend names a kind's collectives by call count modulo a window, so DDP's
    # buckets of different sizes come back under one name with either shape, step after step.
    ranks = negotiators(4)
    coordinated = []
    for step, shape in enumerate([(4,), (8,), (4,), (8,), (4,)]):
        for n in ranks:
            n.add([grad("allreduce.0", shape)], float(step))
        outcome, _ = cycle(ranks, float(step))
        assert [r.names for r in outcome.cycle.responses] == [("allreduce.0",)]
        coordinated.append(outcome.coordinated)
    assert coordinated == [True, True, False, False, False]
