"""Choosing a server: ordering by EWMA, newcomers tried, back-off after a
failure that doubles and expires, and the hedge delay's percentile."""

import pytest
from hypothesis import given, settings, strategies as st

from experts import servers as mod
from experts.servers import Servers


def test_known_servers_are_ordered_by_their_latency_ewma():
    s = Servers()
    s.observe("slow", 0.30, True, now=0.0)
    s.observe("fast", 0.05, True, now=0.0)
    s.observe("mid", 0.10, True, now=0.0)
    assert s.order(["slow", "mid", "fast"], now=1.0) == ["fast", "mid", "slow"]


def test_the_ewma_follows_new_samples_with_weight_alpha():
    s = Servers()
    s.observe("a", 1.0, True, now=0.0)
    s.observe("a", 2.0, True, now=1.0)
    assert s.ewma("a") == pytest.approx((1 - mod.ALPHA) * 1.0 + mod.ALPHA * 2.0)
    assert s.ewma("never") is None


def test_a_server_that_slows_down_loses_its_place():
    s = Servers()
    s.observe("a", 0.05, True, now=0.0)
    s.observe("b", 0.10, True, now=0.0)
    for i in range(5):
        s.observe("a", 1.0, True, now=float(i))
    assert s.order(["a", "b"], now=10.0) == ["b", "a"]


def test_an_unknown_server_is_tried_before_the_known_ones_until_measured():
    s = Servers()
    s.observe("b", 0.05, True, now=0.0)
    s.observe("c", 0.20, True, now=0.0)
    assert s.order(["c", "b", "new"], now=1.0) == ["new", "b", "c"]
    s.observe("new", 0.10, True, now=1.0)
    assert s.order(["c", "b", "new"], now=2.0) == ["b", "new", "c"]


def test_ties_are_broken_by_key_whatever_the_input_order():
    s = Servers()
    for key in ("z", "m", "a"):
        s.observe(key, 0.1, True, now=0.0)
    assert s.order(["z", "a", "m"], now=1.0) == s.order(["m", "z", "a"], now=1.0) == ["a", "m", "z"]
    assert Servers().order(["y", "x", "x"], now=0.0) == ["x", "y"]  # and duplicates go
    assert Servers().order([b"k", 3, ("t",)], now=0.0) == Servers().order([("t",), 3, b"k"], now=0.0)


def test_a_failed_server_goes_last_until_its_back_off_expires():
    s = Servers()
    s.observe("a", 0.01, True, now=0.0)
    s.observe("b", 0.50, True, now=0.0)
    s.observe("a", 0.01, False, now=10.0)  # back-off max(1 s, 2 × 0.01 s) = 1 s
    assert s.backing_off("a", now=10.5)
    assert s.order(["a", "b"], now=10.5) == ["b", "a"]
    assert s.order(["a", "b"], now=11.0) == ["a", "b"]
    assert s.failures("a") == 1


def test_the_back_off_scales_with_the_ewma_doubles_per_failure_and_is_capped():
    s = Servers()
    s.observe("a", 2.0, True, now=0.0)
    ends = []
    for i in range(6):
        s.observe("a", 2.0, False, now=100.0)
        lo, hi = 100.0, 200.0
        while hi - lo > 1e-6:  # find when the back-off ends
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if s.backing_off("a", mid) else (lo, mid)
        ends.append(round(hi - 100.0, 3))
    assert ends == [4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    s.observe("a", 2.0, True, now=101.0)  # a success clears it
    assert not s.backing_off("a", now=101.0) and s.failures("a") == 0


def test_servers_backing_off_are_ordered_by_when_they_may_be_retried():
    s = Servers()
    s.observe("x", 0.1, False, now=0.0)  # unmeasured: retry at 1 s
    s.observe("y", 0.1, False, now=0.0)
    s.observe("y", 0.1, False, now=0.0)  # twice: retry at 2 s
    s.observe("z", 0.1, False, now=0.5)  # retry at 1.5 s
    assert s.order(["y", "z", "x", "ok"], now=0.9) == ["ok", "x", "z", "y"]


def test_the_hedge_delay_is_a_default_before_any_sample_and_floored():
    s = Servers()
    assert s.hedge_delay() == mod.HEDGE_DEFAULT == 0.1
    s.observe("a", 0.001, True, now=0.0)
    assert s.hedge_delay() == mod.HEDGE_FLOOR == 0.005


def test_the_hedge_delay_is_one_and_a_half_times_the_95th_percentile_across_servers():
    s = Servers()
    for i in range(1, 101):  # 1 ms .. 100 ms, over two servers
        s.observe("a" if i % 2 else "b", i / 1000, True, now=float(i))
    recent = sorted(i / 1000 for i in range(37, 101))  # only the last 64 are kept
    assert s.hedge_delay() == pytest.approx(1.5 * recent[60])  # nearest rank: ceil(0.95 × 64) = 61
    s.observe("a", 5.0, False, now=200.0)  # failures are not latencies
    assert s.hedge_delay() == pytest.approx(1.5 * recent[60])


@settings(max_examples=50, deadline=None)
@given(samples=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=150))
def test_the_hedge_delay_covers_95_percent_of_the_recent_latencies(samples):
    s = Servers()
    for i, x in enumerate(samples):
        s.observe(i % 3, x, True, now=float(i))
    recent = samples[-64:]
    delay = s.hedge_delay()
    assert sum(x * 1.5 <= delay for x in recent) >= 0.95 * len(recent)
    assert delay >= 0.005 and delay <= max(1.5 * max(recent), 0.005)


@pytest.mark.parametrize("seconds", [-0.1, float("inf"), float("nan")])
def test_a_bad_duration_is_a_value_error(seconds):
    with pytest.raises(ValueError):
        Servers().observe("a", seconds, True, now=0.0)


def test_health_says_ok_backed_off_failing_or_unknown_in_one_word():
    s = Servers()
    assert s.health("never", now=0.0) is None and s.known() == []
    s.observe("a", 0.1, True, now=0.0)
    assert s.health("a", now=0.0) == "ok"
    s.observe("a", 0.1, False, now=1.0)  # back-off: max(BACKOFF_MIN, 2 x EWMA) = 1 s
    assert s.health("a", now=1.5) == "backed-off"
    assert s.health("a", now=2.5) == "failing"  # the back-off passed, no answer since
    s.observe("a", 0.2, True, now=3.0)
    assert s.health("a", now=3.0) == "ok" and s.known() == ["a"]
