"""Dynamic batching: full batches, the waiting limit, oversize requests, FIFO
order, the deadline, and (with hypothesis) that no request is lost,
duplicated, reordered or packed past max_batch."""

import pytest
from hypothesis import given, settings, strategies as st

from experts.batching import Batcher


def test_a_batch_is_handed_out_when_the_next_request_would_not_fit():
    b = Batcher(max_batch=8, max_wait=1.0)
    assert b.add("a", 3, now=0.0) == []
    assert b.add("b", 4, now=0.1) == []
    assert (b.pending, b.rows_pending) == (2, 7)
    assert b.add("c", 2, now=0.2) == [["a", "b"]]  # 9 rows would not fit
    assert (b.pending, b.rows_pending) == (1, 2)


def test_a_batch_that_is_exactly_full_goes_at_once():
    b = Batcher(max_batch=8, max_wait=1.0)
    assert b.add("a", 5, now=0.0) == []
    assert b.add("b", 3, now=0.0) == [["a", "b"]]
    assert b.pending == 0 and b.deadline() is None


def test_requests_wait_max_wait_for_others_and_then_go():
    b = Batcher(max_batch=100, max_wait=0.5)
    b.add("a", 1, now=10.0)
    b.add("b", 1, now=10.3)
    assert b.due(now=10.49) == []
    assert b.due(now=10.5) == [["a", "b"]]
    assert b.due(now=11.0) == [] and b.pending == 0


def test_a_request_arriving_when_the_oldest_is_overdue_rides_with_it():
    b = Batcher(max_batch=100, max_wait=0.5)
    b.add("a", 1, now=0.0)
    assert b.add("b", 1, now=0.7) == [["a", "b"]]


def test_max_wait_zero_runs_every_request_at_once():
    b = Batcher(max_batch=4, max_wait=0.0)
    assert b.add("a", 1, now=0.0) == [["a"]]
    assert b.add("b", 2, now=0.0) == [["b"]]


def test_an_oversize_request_is_a_batch_alone_after_those_waiting():
    b = Batcher(max_batch=4, max_wait=1.0)
    b.add("a", 2, now=0.0)
    assert b.add("big", 9, now=0.1) == [["a"], ["big"]]
    assert b.pending == 0
    assert b.add("big2", 5, now=0.2) == [["big2"]]


def test_batches_keep_arrival_order():
    b = Batcher(max_batch=3, max_wait=10.0)
    out = []
    for i, key in enumerate("abcdefg"):
        out += b.add(key, 1, now=float(i))
    out += b.flush()
    assert out == [["a", "b", "c"], ["d", "e", "f"], ["g"]]


def test_the_deadline_is_when_the_oldest_waiting_request_is_due():
    b = Batcher(max_batch=10, max_wait=2.0)
    assert b.deadline() is None
    b.add("a", 1, now=5.0)
    b.add("b", 1, now=6.0)
    assert b.deadline() == 7.0
    assert b.due(b.deadline()) == [["a", "b"]]
    assert b.deadline() is None
    b.add("c", 1, now=8.0)
    assert b.deadline() == 10.0


def test_flush_hands_out_whatever_waits():
    b = Batcher(max_batch=10, max_wait=2.0)
    assert b.flush() == []
    b.add("a", 2, now=0.0)
    assert b.flush() == [["a"]] and b.pending == 0 and b.rows_pending == 0


@pytest.mark.parametrize("max_batch, max_wait", [(0, 1.0), (-1, 1.0), (2.5, 1.0), (4, -0.1),
                                                 (4, float("inf")), (4, float("nan"))])
def test_bad_limits_are_value_errors(max_batch, max_wait):
    with pytest.raises(ValueError):
        Batcher(max_batch, max_wait)


@pytest.mark.parametrize("rows", [0, -3, 1.5, True])
def test_a_request_of_no_rows_is_a_value_error_and_changes_nothing(rows):
    b = Batcher(4, 1.0)
    b.add("a", 1, now=0.0)
    with pytest.raises(ValueError, match="rows"):
        b.add("b", rows, now=0.0)
    assert (b.pending, b.rows_pending) == (1, 1)


events = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.floats(0, 1.0)),
    st.tuples(st.just("due"), st.just(0), st.floats(0, 1.0)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(max_batch=st.integers(1, 8), max_wait=st.floats(0, 2.0), events=events)
def test_no_request_is_lost_duplicated_reordered_or_packed_past_max_batch(max_batch, max_wait, events):
    b = Batcher(max_batch, max_wait)
    rows, batches, now, sent = {}, [], 0.0, 0
    for kind, n, step in events:
        now += step
        if kind == "add":
            rows[sent] = n
            got = b.add(sent, n, now)
            sent += 1
        else:
            got = b.due(now)
        assert all(got)  # no empty batch
        batches += got
        deadline = b.deadline()
        assert deadline is None or deadline > now  # anything overdue was handed out
        assert b.rows_pending <= max_batch
        assert b.rows_pending == sum(rows[k] for k in range(sent)) - sum(rows[k] for bt in batches for k in bt)
    batches += b.flush()
    assert [k for batch in batches for k in batch] == list(range(sent))  # each once, in order
    for batch in batches:
        total = sum(rows[k] for k in batch)
        assert total <= max_batch or len(batch) == 1
