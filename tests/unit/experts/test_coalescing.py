"""Coalescing a client's calls: a lone call leaves at once, calls wait only while
``depth`` requests are in flight (and not once they fill one), leave together
by signature, oldest group first, never split; and (with hypothesis) no call
is lost, duplicated or reordered, and no request carries more than its limit
unless one call alone does."""

import pytest
from hypothesis import given, settings, strategies as st

from experts.coalescing import Coalescer


def test_a_lone_call_leaves_at_once():
    c = Coalescer(depth=1)
    c.add("a", "sig", rows=1, limit=64, now=0.0)
    assert c.take(0.0) == [("sig", ["a"])]
    assert c.in_flight == 1 and c.pending == 0


def test_calls_wait_while_depth_requests_are_in_flight_and_then_leave_as_one():
    c = Coalescer(depth=2)
    for key in "ab":
        c.add(key, "sig", 1, 64, now=0.0)
        assert c.take(0.0) == [("sig", [key])]  # each found a free slot
    for i, key in enumerate("cdef"):
        c.add(key, "sig", 1, 64, now=0.1 * i)
    assert c.take(1.0) == [] and c.pending == 4  # two in flight: they wait, however long
    c.done()
    assert c.take(1.0) == [("sig", ["c", "d", "e", "f"])]
    assert c.in_flight == 2


def test_calls_that_fill_a_request_leave_without_waiting_and_none_is_split():
    c = Coalescer(depth=1)
    c.add("first", "sig", 1, 3, now=0.0)
    assert c.take(0.0) == [("sig", ["first"])]
    c.add("a", "sig", 2, 3, now=0.0)
    assert c.take(0.0) == []
    c.add("b", "sig", 2, 3, now=0.0)  # 4 rows wait: a request (3 rows) is full
    assert c.take(0.0) == [("sig", ["a"])]  # b does not fit beside a
    assert c.take(0.0) == [] and c.pending == 1
    c.add("big", "sig", 5, 3, now=0.0)  # over the limit: it goes, alone, after b
    assert c.take(0.0) == [("sig", ["b"]), ("sig", ["big"])]
    assert c.in_flight == 4


def test_only_calls_of_one_signature_share_a_request_and_the_oldest_group_goes_first():
    c = Coalescer(depth=1)
    c.add("x0", "x", 1, 8, now=0.0)
    assert c.take(0.0) == [("x", ["x0"])]
    c.add("y1", "y", 1, 8, now=1.0)
    c.add("x1", "x", 1, 8, now=2.0)
    c.add("y2", "y", 1, 8, now=3.0)
    c.done()
    assert c.take(4.0) == [("y", ["y1", "y2"])]  # one slot: the group waiting longest
    c.done()
    assert c.take(4.0) == [("x", ["x1"])]


def test_a_group_keeps_the_limit_it_opened_with():
    c = Coalescer(depth=1)
    c.add("busy", "sig", 1, 1, now=0.0)
    assert c.take(0.0) == [("sig", ["busy"])]
    c.add("a", "sig", 1, 2, now=0.0)
    c.add("b", "sig", 1, 64, now=0.0)  # 2 rows: the group's limit (2) is full
    assert c.take(0.0) == [("sig", ["a", "b"])]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="depth"):
        Coalescer(depth=0)
    c = Coalescer()
    with pytest.raises(ValueError, match="rows"):
        c.add("a", "sig", 0, 8, now=0.0)
    with pytest.raises(ValueError, match="max_batch"):
        c.add("a", "sig", 1, 0, now=0.0)
    assert c.pending == 0 and c.take(0.0) == []
    with pytest.raises(ValueError, match="in flight"):
        c.done()


@settings(max_examples=200, deadline=None)
@given(depth=st.integers(1, 3), limit=st.integers(1, 6),
       steps=st.lists(st.tuples(st.sampled_from(["add", "done"]), st.sampled_from("xy"), st.integers(1, 8)),
                      max_size=60))
def test_every_call_leaves_once_in_order_and_within_its_limit(depth, limit, steps):
    c = Coalescer(depth=depth)
    rows, sent = {}, {"x": [], "y": []}
    for i, (step, signature, n) in enumerate(steps):
        if step == "add":
            rows[i] = n
            c.add(i, signature, n, limit, now=float(i))
        elif c.in_flight:
            c.done()
        for sig, keys in c.take(float(i)):
            assert keys and (len(keys) == 1 or sum(rows[k] for k in keys) <= limit)
            sent[sig] += keys
        assert not c.pending or c.in_flight >= depth  # calls wait only while depth requests are in flight
    while c.in_flight:
        c.done()
        for sig, keys in c.take(1e9):
            sent[sig] += keys
    assert c.pending == 0
    for sig in "xy":
        assert sent[sig] == sorted(k for k, (step, s, _) in enumerate(steps) if step == "add" and s == sig)
