"""The membership view, adaptive timeouts and a gossip round."""

import random

import pytest

from learn.gossip import GossipRound
from learn.group import GroupView, RoundClock

A, B, C, ME = b"a" * 32, b"b" * 32, b"c" * 32, b"m" * 32


def _hello(round=0, joined=0):
    return {"round": round, "joined": joined, "hash": None, "hash_round": -1}


def test_a_member_that_stops_saying_hello_drops_out():
    view = GroupView(ME, heartbeat_interval=1.0, min_timeout=3.0)
    view.heard(A, _hello(), now=0.0)
    view.heard(B, _hello(), now=2.0)
    assert view.live(now=3.0) == [A, B]
    assert view.live(now=4.5) == [B]


def test_a_joining_member_contributes_from_its_join_round():
    view = GroupView(ME)
    view.heard(A, _hello(round=5, joined=0), now=0.0)
    view.heard(B, _hello(round=5, joined=6), now=0.0)
    assert view.eligible(5, now=1.0) == [A]
    assert view.eligible(6, now=1.0) == [A, B]


def test_a_malformed_hello_is_refused():
    view = GroupView(ME)
    with pytest.raises(ValueError):
        view.heard(A, {"round": -1, "joined": 0, "hash": None, "hash_round": 0}, now=0.0)
    with pytest.raises(ValueError):
        view.heard(A, {**_hello(), "hash": b"short"}, now=0.0)
    assert view.members == {}


def test_round_timeouts_follow_measured_rounds():
    clock = RoundClock(floor=1.0, ceiling=100.0, default=30.0)
    assert clock.timeout() == 30.0
    for _ in range(20):
        clock.observe(2.0)
    assert clock.timeout() == 6.0
    for _ in range(20):
        clock.observe(50.0)
    assert clock.timeout() == 100.0  # the ceiling
    for _ in range(20):
        clock.observe(0.01)
    assert clock.timeout() == 1.0  # the floor


def test_a_gossip_round_skips_a_partner_that_fails_or_is_late():
    round_ = GossipRound(ME, [A, B, C, ME], 2, random.Random(0), now=0.0, timeout=5.0)
    assert len(round_.partners) == 2 and ME not in round_.partners
    first, second = round_.partners
    assert round_.received(first, "state", now=1.0)
    assert not round_.received(second, "late", now=6.0)
    assert not round_.done(now=2.0)
    round_.failed(second)
    assert round_.done(now=2.0) and round_.result() == ["state"]


def test_a_gossip_round_with_few_live_members_asks_them_all():
    round_ = GossipRound(ME, [ME, A], 4, random.Random(1), now=0.0, timeout=5.0)
    assert round_.partners == [A]
