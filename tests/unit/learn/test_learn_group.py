"""learn.group: who is live in a group, who may contribute to a round, and timeouts that follow measurements."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from learn.group import HASH_HISTORY, GroupView, Member, RoundClock, majority, state_source

A, B, C, ME = b"a" * 32, b"b" * 32, b"c" * 32, b"m" * 32


def _hello(round=0, joined=0, **more):
    return {"round": round, "joined": joined, "hash": None, "hash_round": -1, **more}


def test_a_member_not_heard_for_dead_after_seconds_is_not_live():
    view = GroupView(ME, heartbeat_interval=1.0, min_timeout=2.0)
    assert view.dead_after() == 3.0  # 3 heartbeats, above the floor
    assert GroupView(ME, heartbeat_interval=1.0, min_timeout=10.0).dead_after() == 10.0
    view.heard(A, _hello(), now=0.0)
    view.heard(B, _hello(), now=2.0)
    assert view.live(now=2.9) == [A, B]
    assert view.live(now=3.0) == [B]  # silent for dead_after: gone
    view.heard(A, {}, now=4.0)  # any message from it counts
    assert view.live(now=4.0) == [A, B]


def test_live_members_are_sorted_and_never_include_me():
    view = GroupView(ME)
    for peer in [C, A, B]:
        view.heard(peer, _hello(), now=0.0)
    assert view.live(now=1.0) == [A, B, C]
    with pytest.raises(ValueError, match="itself"):
        view.heard(ME, _hello(), now=0.0)


def test_a_hello_is_recorded_and_a_later_message_keeps_what_it_does_not_say():
    view = GroupView(ME)
    member = view.heard(A, _hello(round=7, joined=3, role="observer", throughput=120.5,
                                  hash=bytes(32), hash_round=6), now=1.0)
    assert member == Member(peer=A, round=7, joined=3, role="observer", throughput=120.5, hash=bytes(32),
                            hash_round=6, last_seen=1.0, hashes={6: bytes(32)})
    view.heard(A, {"round": 8}, now=2.0)
    assert view.members[A] == Member(A, 8, 3, "observer", 120.5, bytes(32), 6, 2.0, {6: bytes(32)})


def test_a_member_heard_of_only_through_other_messages_has_defaults_and_contributes_nothing():
    view = GroupView(ME)
    assert view.heard(A, {}, now=0.0) == Member(A, 0, None, "trainer", 0.0, None, -1, 0.0)
    assert view.live(now=0.0) == [A]
    assert view.eligible(100, now=0.0) == []  # it has not said from which round it contributes


def test_a_member_that_joins_during_round_r_contributes_from_round_r_plus_1():
    view = GroupView(ME)
    view.heard(A, _hello(round=5, joined=0), now=0.0)
    view.heard(B, _hello(round=5, joined=6), now=0.0)  # joined while the group was in round 5
    assert view.eligible(5, now=1.0) == [A]
    assert view.eligible(6, now=1.0) == [A, B]


def test_only_live_trainers_are_eligible():
    view = GroupView(ME, heartbeat_interval=1.0, min_timeout=3.0)
    view.heard(A, _hello(), now=0.0)
    view.heard(B, _hello(role="observer"), now=5.0)
    view.heard(C, _hello(), now=5.0)
    assert view.live(now=5.0) == [B, C]
    assert view.eligible(0, now=5.0) == [C]


def test_a_dropped_member_is_forgotten_until_heard_again():
    view = GroupView(ME)
    view.heard(A, _hello(joined=2), now=0.0)
    view.drop(A)
    view.drop(B)  # unknown: nothing to do
    assert view.live(now=0.0) == [] and A not in view.members
    view.heard(A, {}, now=1.0)
    assert view.members[A].joined is None


@pytest.mark.parametrize("bad", [
    {"round": -1}, {"round": 1.5}, {"round": True}, {"joined": -2}, {"joined": "3"},
    {"role": "boss"}, {"role": 1}, {"throughput": -1.0}, {"throughput": float("nan")},
    {"throughput": float("inf")}, {"throughput": True}, {"hash": b"short"}, {"hash": "x" * 32},
    {"hash_round": -2}, {"hash_round": 0.5},
    {"hashes": {1: bytes(32)}}, {"hashes": [[1, b"short"]]}, {"hashes": [[-1, bytes(32)]]}, {"hashes": [[1]]},
    {"hashes": [[1.0, bytes(32)]]}, {"hashes": [[r, bytes(32)] for r in range(HASH_HISTORY + 1)]},
])
def test_a_malformed_hello_is_refused_and_changes_nothing(bad):
    view = GroupView(ME)
    view.heard(A, _hello(round=1), now=0.0)
    before = dict(view.members)
    with pytest.raises(ValueError):
        view.heard(A, {**_hello(round=2), **bad}, now=1.0)
    with pytest.raises(ValueError):
        view.heard(B, bad, now=1.0)
    with pytest.raises(ValueError, match="map"):
        view.heard(B, [bad], now=1.0)
    assert view.members == before


def test_the_round_clock_has_a_sane_default_before_any_measurement():
    assert RoundClock().timeout() == 30.0
    assert RoundClock(floor=40.0).timeout() == 40.0
    assert RoundClock(ceiling=10.0).timeout() == 10.0


def test_the_round_timeout_follows_measured_rounds():
    clock = RoundClock(floor=1.0, ceiling=100.0)
    for _ in range(20):
        clock.observe(2.0)
    assert clock.timeout() == 6.0
    for _ in range(20):
        clock.observe(10.0)  # the network got slower: the timeout follows
    assert clock.timeout() == 30.0
    for _ in range(20):
        clock.observe(50.0)
    assert clock.timeout() == 100.0  # the ceiling
    for _ in range(20):
        clock.observe(0.01)
    assert clock.timeout() == 1.0  # the floor


def test_rounds_that_ran_to_their_deadline_do_not_stretch_the_timeout():
    clock = RoundClock(floor=1.0, ceiling=600.0)
    for _ in range(5):
        clock.observe(2.0)
    assert clock.timeout() == 6.0
    for _ in range(10):  # a dead contributor: each round waits out the timeout, then stretched it 3x
        clock.observe(clock.timeout(), complete=False)
    assert clock.timeout() == 6.0
    clock.observe(2.5)
    assert clock.timeout() == 7.5


def test_the_round_timeout_is_three_times_the_90th_percentile_of_the_last_20():
    clock = RoundClock(floor=0.0, ceiling=1e9)
    for seconds in range(1, 101):  # only 81..100 are kept
        clock.observe(float(seconds))
    assert clock.timeout() == 3 * 98.0  # nearest rank: the 18th of 20
    clock = RoundClock(floor=0.0, ceiling=1e9)
    for seconds in [1.0] * 18 + [500.0] * 2:  # two stragglers out of 20 do not set it
        clock.observe(seconds)
    assert clock.timeout() == 3.0


@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=60))
@settings(max_examples=100, deadline=None)
def test_the_round_timeout_stays_within_floor_and_ceiling_and_covers_most_rounds(seen):
    clock = RoundClock(floor=2.0, ceiling=3600.0)
    for seconds in seen:
        clock.observe(seconds)
    timeout = clock.timeout()
    assert 2.0 <= timeout <= 3600.0
    last = seen[-20:]
    covered = sum(s <= timeout for s in last)
    assert covered >= 0.9 * len(last) or timeout == 3600.0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_the_round_clock_refuses_a_duration_that_is_not_one(bad):
    with pytest.raises(ValueError):
        RoundClock().observe(bad)


def test_the_round_clock_refuses_bounds_that_do_not_make_sense():
    with pytest.raises(ValueError):
        RoundClock(floor=10.0, ceiling=5.0)
    with pytest.raises(ValueError):
        RoundClock(window=0)


def test_many_members_heard_at_random_times_are_live_exactly_when_heard_lately():
    rng = random.Random(3)
    view = GroupView(ME, heartbeat_interval=1.0, min_timeout=4.0)
    last = {}
    for step in range(500):
        peer, now = bytes([rng.randrange(40)]) * 32, step * 0.1
        view.heard(peer, {}, now=now)
        last[peer] = now
    now = 50.0
    assert view.live(now) == sorted(p for p, t in last.items() if now - t < 4.0)


H1, H2, H3 = b"1" * 32, b"2" * 32, b"3" * 32


def test_a_member_keeps_the_hashes_of_its_last_rounds_so_one_that_moved_on_still_votes_on_them():
    view = GroupView(ME)
    view.heard(A, _hello(round=5, hash=H1, hash_round=4), now=0.0)
    view.heard(A, _hello(round=6, hash=H2, hash_round=5), now=1.0)  # its hellos, round after round
    assert view.members[A].hashes == {4: H1, 5: H2}
    view.heard(B, _hello(round=9, hash=H3, hash_round=8, hashes=[[6, H1], [7, H2], [8, H3]]), now=1.0)
    assert view.members[B].hashes == {6: H1, 7: H2, 8: H3}  # what it says of its rounds before
    view.heard(B, _hello(round=9, hash=H1, hash_round=8, hashes=[[7, H1], [8, H1]]), now=2.0)  # it resynced
    assert view.members[B].hashes == {6: H1, 7: H1, 8: H1}
    for r in range(9, 9 + HASH_HISTORY):
        view.heard(B, _hello(round=r + 1, hash=H2, hash_round=r), now=3.0)
    assert sorted(view.members[B].hashes) == list(range(9, 9 + HASH_HISTORY))  # only the latest rounds


def test_the_majority_hash_has_most_votes_and_is_taken_from_its_holder_furthest_ahead():
    assert majority({}) is None
    assert majority({A: (H1, 5), B: (H2, 5), C: (H2, 4)}) == (H2, B)
    assert majority({A: (H1, 5), B: (H2, 7), C: (H2, 7), ME: (H2, 6)}) == (H2, B)  # lowest key among equals


def test_in_a_tie_the_hash_of_the_member_furthest_ahead_wins_not_the_lowest_key():
    """Two members that disagree on round r: the one still working on round r+1 while the other
    is in r+3 is the one behind (a restarted member whose exchange missed the group's), whatever its key."""
    assert majority({A: (H1, 5), B: (H2, 7)}) == (H2, B)
    assert majority({A: (H1, 7), B: (H2, 7)}) == (H1, A)  # equal rounds too: then the lowest key


def test_the_state_to_take_is_the_furthest_ahead_that_another_member_holds_too():
    """A state is corroborated when two live members hold the same hash for its round (the one
    that says it as its latest, and one that reached it too, maybe moved on)."""
    group = {A: (10, {8: H1, 9: H2}), B: (10, {8: H1, 9: H2}), C: (9, {8: H1}), ME: (5, {4: H3})}
    assert state_source(group) == (A, 2)  # A and B hold round 9's H2: the lowest key among equals
    group[C] = (11, {8: H1, 9: H2, 10: H3})  # C finished round 10, which nobody else holds yet
    assert state_source(group) == (A, 3)


def test_a_member_alone_in_claiming_a_round_far_ahead_is_not_followed():
    """One member that says it is 1,000 rounds ahead (a runaway that trained alone, or a
    liar), with hashes copied from the others' history, is not where the state comes from."""
    honest = {A: (10, {8: H1, 9: H2}), B: (10, {8: H1, 9: H2}), ME: (10, {8: H1, 9: H2})}
    liar = {8: H1, 9: H2, 1009: H3}
    assert state_source({**honest, C: (1010, liar)}) == (A, 4)  # C holds round 9's hash too
    assert state_source({ME: (10, {9: H1}), C: (1010, liar)}) == (C, 1)  # nothing corroborated: furthest ahead


def test_members_silent_a_moment_still_vouch_for_the_state_they_held():
    """This node's loop stalled past the others' liveness, and the first hello it read after is
    the liar's: the honest members' last hashes still corroborate its state, so it stays on it."""
    liar = {1009: H3}
    assert state_source({ME: (10, {9: H2}), C: (1010, liar)}, silent=[{8: H1, 9: H2}]) == (ME, 2)
    assert state_source({ME: (10, {9: H2}), C: (1010, liar)}, silent=[{8: H1}]) == (C, 1)  # they never held it
    assert state_source({ME: (10, {}), C: (1010, liar)}, silent=[{1009: H3}]) == (C, 2)  # a silent one can vouch for any


def test_with_no_state_corroborated_the_member_furthest_ahead_is_the_source():
    """A run's start (no hashes yet), or two members that ran apart: the furthest ahead, then the lowest key."""
    assert state_source({ME: (0, {}), A: (0, {}), B: (0, {})}) == (A, 1)
    assert state_source({ME: (3, {2: H1}), B: (7, {6: H2})}) == (B, 1)
    assert state_source({ME: (3, {})}) == (ME, 1)


def test_a_member_that_goes_back_to_an_earlier_round_leaves_no_hash_of_the_rounds_after():
    view = GroupView(ME)
    view.heard(A, _hello(round=50, hash=H1, hash_round=49, hashes=[[47, H1], [48, H2], [49, H1]]), now=0.0)
    view.heard(A, _hello(round=10, hash=H3, hash_round=9, hashes=[[9, H3]]), now=1.0)  # it rejoined round 9's state
    assert view.members[A].hashes == {9: H3}
    assert state_source({ME: (10, {9: H3}), A: (10, view.members[A].hashes)}) == (A, 2)
