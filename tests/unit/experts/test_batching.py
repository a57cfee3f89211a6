"""Dynamic batching: a free worker takes full batches at once and partial ones
after max_wait, oldest first, never splitting a request; and (with hypothesis)
no request is lost, duplicated, reordered or packed past max_batch."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from experts.batching import Batcher


def test_a_full_batch_is_ready_at_once_and_takes_what_fits_oldest_first():
    b = Batcher(max_batch=8, max_wait=1.0)
    b.add("a", 3, now=0.0)
    b.add("b", 4, now=0.1)
    assert not b.ready(0.2) and b.take(0.2) == []
    b.add("c", 2, now=0.2)  # 9 rows: a batch is full
    assert b.ready(0.2) and (b.pending, b.rows_pending) == (3, 9)
    assert b.take(0.2) == ["a", "b"]  # c does not fit with them
    assert (b.pending, b.rows_pending) == (1, 2) and not b.ready(0.3)


def test_requests_wait_max_wait_for_others_and_then_go_together():
    b = Batcher(max_batch=100, max_wait=0.5)
    b.add("a", 1, now=10.0)
    b.add("b", 1, now=10.3)
    assert b.deadline() == 10.5 and not b.ready(10.49)
    assert b.take(10.5) == ["a", "b"]
    assert b.take(11.0) == [] and b.deadline() is None


def test_what_queues_while_the_worker_is_busy_leaves_as_one_batch():
    b = Batcher(max_batch=64, max_wait=0.002)
    for i in range(20):  # one every millisecond while a 20 ms batch runs
        b.add(i, 1, now=i / 1000)
    assert b.take(0.020) == list(range(20))  # not ten batches of two


def test_max_wait_zero_lets_a_free_worker_take_whatever_waits():
    b = Batcher(max_batch=4, max_wait=0.0)
    b.add("a", 1, now=0.0)
    b.add("b", 2, now=0.0)
    assert b.take(0.0) == ["a", "b"]


def test_an_oversize_request_is_a_batch_alone():
    b = Batcher(max_batch=4, max_wait=1.0)
    b.add("big", 9, now=0.0)
    b.add("a", 1, now=0.0)
    assert b.take(0.0) == ["big"]
    assert b.take(1.0) == ["a"]


def test_flush_hands_out_everything_in_batches_that_fit():
    b = Batcher(max_batch=3, max_wait=10.0)
    for i, key in enumerate("abcdefg"):
        b.add(key, 1, now=float(i))
    assert b.flush() == [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    assert b.flush() == [] and b.pending == 0 and b.oldest() is None


@pytest.mark.parametrize("max_batch, max_wait", [(0, 1.0), (-1, 1.0), (2.5, 1.0), (True, 1.0), (4, -0.1),
                                                 (4, math.inf), (4, math.nan)])
def test_bad_limits_are_value_errors(max_batch, max_wait):
    with pytest.raises(ValueError):
        Batcher(max_batch, max_wait)


@pytest.mark.parametrize("rows", [0, -3, 1.5, True])
def test_a_request_of_no_rows_is_a_value_error_and_changes_nothing(rows):
    b = Batcher(max_batch=4, max_wait=1.0)
    b.add("a", 1, now=0.0)
    with pytest.raises(ValueError):
        b.add("bad", rows, now=0.0)
    assert (b.pending, b.rows_pending) == (1, 1)


events = st.lists(st.tuples(st.sampled_from(["add", "take"]), st.integers(1, 10), st.floats(0, 0.5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(max_batch=st.integers(1, 8), max_wait=st.floats(0, 2.0), events=events)
def test_no_request_is_lost_duplicated_reordered_or_packed_past_max_batch(max_batch, max_wait, events):
    b, rows, added, taken, now = Batcher(max_batch, max_wait), {}, [], [], 0.0
    for i, (kind, n, step) in enumerate(events):
        now += step
        if kind == "add":
            b.add(i, n, now)
            rows[i] = n
            added.append(i)
        else:
            was_ready = b.ready(now)
            batch = b.take(now)
            assert bool(batch) == was_ready
            assert len(batch) == 1 or sum(rows[k] for k in batch) <= max_batch
            taken += batch
    taken += [k for batch in b.flush() for k in batch]
    assert taken == added
