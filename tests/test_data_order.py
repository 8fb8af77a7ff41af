"""The loader's decisions, as pure functions: which rows each rank reads, in what order, and
how many steps every rank takes (`ddl_magic/data/order.py`)."""

import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddl_magic.data import order
from ddl_magic.data.order import (EpochOrder, coverage, pieces_of, split_rows,
                                  steps_per_epoch)


def test_doctests():
    assert doctest.testmod(order).failed == 0


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shares_cover_every_row_once_and_differ_by_one_at_most(total, parts):
    ranges = split_rows(total, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.data())
def test_pieces_of_a_range_are_exactly_its_rows(piece_rows, data):
    total = sum(piece_rows)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    covered = [sum(piece_rows[:piece.piece]) + row for piece in pieces_of(piece_rows, start, stop)
               for row in range(piece.start, piece.stop)]
    assert covered == list(range(start, stop))


def test_every_rank_takes_the_steps_of_the_smallest_share():
    assert steps_per_epoch([1000, 1000, 700], 100, drop_last=True) == 7
    assert steps_per_epoch([1000, 1000, 701], 100, drop_last=False) == 8
    assert steps_per_epoch([5, 0], 2, drop_last=True) == 0  # an empty share: nobody steps


def test_coverage_says_how_many_rows_an_epoch_leaves_out():
    seen = coverage([1000, 999], 1999, 256, drop_last=True)
    assert (seen.steps, seen.rows, seen.left_out) == (3, 1536, 463)
    line = seen.describe("train", 256)
    assert "1,536 of 1,999 rows per epoch (463 left out" in line
    assert coverage([10, 10], 20, 5, drop_last=False).left_out == 0
    waiting = coverage([10], 20, 5, drop_last=False, missing_shares=1)
    assert "1 of the shares have no rank" in waiting.describe("train", 5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=10), st.integers(0, 3),
       st.integers(1, 60), st.booleans())
def test_an_epoch_reads_every_row_exactly_once(block_rows, epoch, window_rows, shuffle):
    epoch_order = EpochOrder(block_rows, seed=7, epoch=epoch, slot=1, shuffle=shuffle,
                             window_rows=window_rows)
    rows = epoch_order.take(0, sum(block_rows))
    assert sorted(rows.tolist()) == list(range(sum(block_rows)))
    if not shuffle:
        assert rows.tolist() == list(range(sum(block_rows)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(1, 40), st.data())
def test_any_position_is_found_without_replaying_the_epoch(block_rows, window_rows, data):
    whole = EpochOrder(block_rows, seed=3, epoch=2, slot=0, shuffle=True,
                       window_rows=window_rows).take(0, sum(block_rows))
    position = data.draw(st.integers(0, sum(block_rows)))
    count = data.draw(st.integers(0, sum(block_rows)))
    fresh = EpochOrder(block_rows, seed=3, epoch=2, slot=0, shuffle=True, window_rows=window_rows)
    assert fresh.take(position, count).tolist() == whole[position:position + count].tolist()


def test_the_order_changes_every_epoch_and_is_the_same_for_the_same_seed():
    blocks = [100] * 20

    def first_rows(seed, epoch, slot=0):
        return EpochOrder(blocks, seed=seed, epoch=epoch, slot=slot, shuffle=True,
                          window_rows=300).take(0, 50).tolist()

    assert first_rows(1, 0) == first_rows(1, 0)
    assert first_rows(1, 0) != first_rows(1, 1)
    assert first_rows(1, 0) != first_rows(2, 0)
    assert first_rows(1, 0) != first_rows(1, 0, slot=1)


def test_a_window_holds_few_blocks_whatever_the_share_size():
    small = EpochOrder([1000] * 10, seed=0, epoch=0, slot=0, shuffle=True, window_rows=2000)
    large = EpochOrder([1000] * 10_000, seed=0, epoch=0, slot=0, shuffle=True, window_rows=2000)
    assert max(len(w.blocks) for w in small.windows) == max(len(w.blocks) for w in large.windows) == 2


def test_rows_are_shuffled_across_blocks_within_a_window():
    rows = EpochOrder([10] * 4, seed=0, epoch=0, slot=0, shuffle=True, window_rows=40).take(0, 10)
    assert len({row // 10 for row in rows.tolist()}) > 1
    assert not np.array_equal(rows, np.sort(rows))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="batch_size"):
        steps_per_epoch([10], 0, drop_last=True)
    with pytest.raises(ValueError, match="1 rank or more"):
        split_rows(10, 0)
