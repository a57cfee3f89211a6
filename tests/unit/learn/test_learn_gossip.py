"""learn.gossip: one member's gossip round: random partners, and what came back in time."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from learn.gossip import GossipRound

ME = b"m" * 32
PEERS = [bytes([i]) * 32 for i in range(10)]


def test_partners_are_d_random_live_members_other_than_me():
    round_ = GossipRound(ME, PEERS + [ME], 4, random.Random(0), now=0.0, timeout=5.0)
    assert len(round_.partners) == 4 == len(set(round_.partners))
    assert set(round_.partners) <= set(PEERS)
    seen = {tuple(GossipRound(ME, PEERS, 4, random.Random(seed), 0.0, 5.0).partners) for seed in range(20)}
    assert len(seen) > 10  # random ...
    again = GossipRound(ME, list(reversed(PEERS)), 4, random.Random(0), now=0.0, timeout=5.0)
    assert again.partners == round_.partners  # ... but a function of the rng and the set of live members


def test_with_fewer_live_members_than_d_it_asks_them_all():
    assert GossipRound(ME, [ME, PEERS[0]], 4, random.Random(1), now=0.0, timeout=5.0).partners == [PEERS[0]]
    alone = GossipRound(ME, [ME], 4, random.Random(1), now=0.0, timeout=5.0)
    assert alone.partners == [] and alone.done() and alone.result() == []


def test_the_result_is_in_partner_order_whatever_the_order_of_answers():
    round_ = GossipRound(ME, PEERS, 3, random.Random(2), now=10.0, timeout=5.0)
    for peer in reversed(round_.partners):
        assert round_.received(peer, f"state of {peer[0]}", now=11.0)
    assert round_.done()
    assert round_.result() == [f"state of {p[0]}" for p in round_.partners]


def test_a_partner_that_fails_is_skipped_and_the_round_goes_on():
    round_ = GossipRound(ME, PEERS, 3, random.Random(3), now=0.0, timeout=5.0)
    first, second, third = round_.partners
    round_.failed(second)
    assert round_.received(first, "one", now=1.0)
    assert not round_.done()
    assert round_.received(third, "three", now=2.0)
    assert round_.done() and round_.result() == ["one", "three"]
    assert not round_.received(second, "too late: it failed", now=3.0)


def test_a_partner_slower_than_the_timeout_is_skipped():
    round_ = GossipRound(ME, PEERS, 3, random.Random(4), now=100.0, timeout=5.0)
    first, second, third = round_.partners
    assert round_.deadline == 105.0
    assert round_.received(first, "in time", now=105.0)
    assert not round_.received(second, "late", now=105.5)  # late: skipped, not waited for
    assert not round_.done()
    assert round_.expired(now=104.0) == []  # not yet
    assert round_.expired(now=105.1) == [third]  # the one still silent
    assert round_.done() and round_.result() == ["in time"]
    assert not round_.received(third, "later still", now=106.0)
    assert round_.expired(now=200.0) == []


def test_answers_from_members_that_are_not_partners_are_ignored():
    round_ = GossipRound(ME, PEERS, 2, random.Random(5), now=0.0, timeout=5.0)
    stranger = next(p for p in PEERS if p not in round_.partners)
    assert not round_.received(stranger, "unasked", now=1.0)
    round_.failed(stranger)
    assert round_.received(round_.partners[0], "asked", now=1.0)
    assert not round_.received(round_.partners[0], "again", now=1.5)  # the first answer counts
    round_.failed(round_.partners[0])  # after its answer: changes nothing
    assert round_.result() == ["asked"]


def test_a_round_refuses_a_negative_fan_out_or_timeout():
    with pytest.raises(ValueError):
        GossipRound(ME, PEERS, -1, random.Random(0), now=0.0, timeout=5.0)
    with pytest.raises(ValueError):
        GossipRound(ME, PEERS, 2, random.Random(0), now=0.0, timeout=-1.0)


@given(st.integers(0, 12), st.integers(0, 2**32), st.lists(st.sampled_from(["ok", "fail", "late", "silent"]),
                                                           min_size=12, max_size=12))
@settings(max_examples=100, deadline=None)
def test_every_partner_ends_received_or_skipped_and_the_round_always_ends(d, seed, fates):
    round_ = GossipRound(ME, PEERS + [ME], d, random.Random(seed), now=0.0, timeout=5.0)
    assert len(round_.partners) == min(d, len(PEERS))
    for peer, fate in zip(round_.partners, fates):
        if fate == "ok":
            assert round_.received(peer, peer, now=1.0)
        elif fate == "fail":
            round_.failed(peer)
        elif fate == "late":
            assert not round_.received(peer, peer, now=6.0)
    round_.expired(now=6.0)
    assert round_.done()
    expected = [p for p, fate in zip(round_.partners, fates) if fate == "ok"]
    assert round_.result() == expected
