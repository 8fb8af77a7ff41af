"""Who is in an elastic run's next world (`driver/elastic_plan.py`): pure, no processes."""

from collections import Counter

import pytest

from ddl_magic.driver.run_options import elastic_bounds
from ddl_magic.driver.elastic_plan import (ElasticBounds, ResetRound, choose_next_world,
                                           over_reset_limit, too_few_ranks)

BOUNDS = ElasticBounds(min_np=2, max_np=4, reset_limit=3, wait_s=60.0, blacklist_after=2)
ONE_HOST = {slot: "a" for slot in range(4)}


def test_a_round_is_complete_once_every_member_asked_or_was_lost():
    round_ = ResetRound(0, (0, 1, 2, 3), started_at=0.0, ask_timeout_s=10.0)
    round_.ask(1, commits=7)
    round_.lose(2, "killed by SIGKILL")
    round_.ask(0, commits=7)
    assert not round_.complete
    round_.ask(3, commits=7)
    assert round_.complete and round_.survivors == [0, 1, 3]
    assert round_.left() == [(2, "killed by SIGKILL")]


def test_a_rank_lost_after_it_asked_is_lost_and_a_stranger_is_ignored():
    round_ = ResetRound(0, (0, 1), started_at=0.0, ask_timeout_s=10.0)
    round_.ask(1, commits=3)
    round_.lose(1, "connection lost")
    round_.ask(1, commits=3)  # a lost rank does not come back in this round
    round_.ask(5, commits=3)  # not a member of the world that ended
    assert round_.lost == {1: "connection lost"} and round_.asked == {}


def test_members_that_neither_ask_nor_are_lost_are_hung_after_the_ask_timeout():
    round_ = ResetRound(2, (4, 1, 0), started_at=100.0, ask_timeout_s=10.0)
    round_.ask(4, commits=1)
    assert round_.hung(now=109.0) == []
    assert round_.hung(now=110.5) == [1, 0]


def test_survivors_keep_their_order_so_rank_0_is_the_oldest_and_replacements_come_last():
    choice = choose_next_world([1, 3], [], [0, 2], ONE_HOST, Counter(), BOUNDS)
    assert choice.members == (1, 3, 0, 2) and choice.start == choice.newcomers == (0, 2)
    assert choice.short_by == 0 and choice.retired == ()


def test_replacements_that_join_later_are_started_but_the_world_forms_without_them():
    choice = choose_next_world([3, 1], [], [0, 2], ONE_HOST, Counter(), BOUNDS, join_later=True)
    assert choice.members == (3, 1) and choice.start == (0, 2) and choice.newcomers == ()
    assert choice.short_by == 0


def test_ready_replacements_join_after_the_survivors_and_fill_room_first():
    choice = choose_next_world([3], [0], [1, 2], ONE_HOST, Counter(), BOUNDS, join_later=True)
    assert choice.members == (3, 0) and choice.newcomers == (0,) and choice.start == (1, 2)
    bounds = ElasticBounds(min_np=1, max_np=2, reset_limit=3, wait_s=1.0, blacklist_after=2)
    choice = choose_next_world([3], [0, 2], [1], ONE_HOST, Counter(), bounds, join_later=True)
    assert choice.members == (3, 0) and choice.start == ()


def test_below_min_np_the_ready_replacements_count_and_the_started_ones_do_not():
    bounds = ElasticBounds(min_np=3, max_np=4, reset_limit=3, wait_s=1.0, blacklist_after=2)
    choice = choose_next_world([0], [1], [2, 3], ONE_HOST, Counter(), bounds, join_later=True)
    assert choice.members == (0, 1) and choice.short_by == 1


def test_no_replacement_starts_on_a_blacklisted_host_and_the_world_may_be_short():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    choice = choose_next_world([0], [], [1, 2, 3], hosts, Counter(b=2), BOUNDS)
    assert choice.members == (0, 1) and choice.short_by == 0
    choice = choose_next_world([2], [], [0, 1, 3], hosts, Counter(a=2, b=2), BOUNDS)
    assert choice.members == (2,) and choice.short_by == 1


def test_survivors_above_max_np_are_retired():
    bounds = ElasticBounds(min_np=1, max_np=2, reset_limit=3, wait_s=1.0, blacklist_after=2)
    choice = choose_next_world([0, 1, 2], [], [3], ONE_HOST, Counter(), bounds)
    assert choice.members == (0, 1) and choice.retired == (2,) and choice.start == ()


def test_the_reset_limit_and_too_few_ranks_say_what_happened_and_what_to_do():
    assert over_reset_limit(2, BOUNDS) is None
    assert "reset 3 times, its limit (DDL_MAGIC_ELASTIC_RESET_LIMIT=3)" in over_reset_limit(3, BOUNDS)
    message = too_few_ranks(1, BOUNDS, 60.0, ["a"])
    assert "has 1 rank left and needs at least 2 (min_np)" in message
    assert "within 60 s" in message and "on a any more" in message


def test_bounds_default_to_np_and_are_checked(monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_TIMEOUT", "5")
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_RESET_LIMIT", "4")
    bounds = elastic_bounds(4, 2, None)
    assert (bounds.min_np, bounds.max_np, bounds.wait_s, bounds.reset_limit) == (2, 4, 5.0, 4)
    with pytest.raises(ValueError, match="min_np <= np <= max_np"):
        elastic_bounds(4, 5, None)
    with pytest.raises(ValueError, match="min_np <= np <= max_np"):
        elastic_bounds(4, None, 3)
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_BLACKLIST_AFTER", "0")
    with pytest.raises(ValueError, match="DDL_MAGIC_ELASTIC_BLACKLIST_AFTER='0'"):
        elastic_bounds(4, 2, None)
