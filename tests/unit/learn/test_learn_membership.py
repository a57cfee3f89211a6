"""learn.membership: the entry a member writes of itself, how readers judge it, how often it is written,
and which document a group converges on."""

import math

import pytest

from learn.membership import QUIET_AFTER, Refresh, Throughput, check_entry, choose_owner, entry, state_of

A, B, C, D = (bytes([n]) * 32 for n in (1, 2, 3, 4))


def _entry(**changes) -> dict:
    fields = dict(joined=1000.0, role="contributor", island=1, samples_s=64.0, steps_s=4.0, round=7,
                  seen=1100.0, every=20.0)
    return entry(**{**fields, **changes})


def test_an_entry_round_trips_through_the_check():
    written = _entry(left=1200.0)
    assert check_entry(written) == written
    assert written["role"] == "contributor" and written["left"] == 1200.0 and written["round"] == 7


@pytest.mark.parametrize("field, bad", [
    ("role", "admin"), ("role", None), ("island", 0), ("island", True), ("island", 2.0),
    ("round", -1), ("round", 1.5), ("samples_s", math.nan), ("steps_s", -1.0), ("steps_s", math.inf),
    ("joined", "yesterday"), ("seen", None), ("every", 0), ("every", 1e9), ("left", "soon"),
])
def test_a_malformed_field_rejects_the_whole_entry(field, bad):
    value = {**_entry(), field: bad}
    assert check_entry(value) is None
    with pytest.raises(ValueError):
        check_entry(value, strict=True)


def test_unknown_keys_are_ignored_and_non_maps_rejected():
    assert check_entry({**_entry(), "later": [1, 2]}) == _entry()
    assert check_entry([1, 2]) is None and check_entry(None) is None


def test_a_member_is_quiet_after_missing_its_refreshes_and_left_once_it_says_so():
    e = _entry(seen=1000.0, every=10.0)
    assert state_of(e, 1000.0 + QUIET_AFTER * 10.0) == "live"
    assert state_of(e, 1000.0 + QUIET_AFTER * 10.0 + 0.1) == "quiet"
    assert state_of(_entry(seen=1000.0, left=1000.0), 1000.0) == "left"


def test_a_member_without_a_document_takes_the_lowest_live_owner_named():
    assert choose_owner(None, [C, B], live=[A, B, C]) == B
    assert choose_owner(None, [A, C], live=[C, D]) == C  # A is named but nobody hears it: a live one first
    assert choose_owner(None, [C, A], live=[D]) == A  # none live: the lowest named
    assert choose_owner(None, [], live=[A, B]) is None  # it may start its own


def test_a_member_moves_only_to_a_lower_live_owner():
    assert choose_owner(C, [B, D], live=[B, C, D]) == B  # two started at once: the lower one's wins
    assert choose_owner(B, [A], live=[B, C]) == B  # A is not heard: stay
    assert choose_owner(B, [C], live=[B, C]) == B  # higher: stay
    assert choose_owner(C, [], live=[A, C]) == C  # its owner went quiet: stay


def test_throughput_is_measured_between_measurements():
    meter = Throughput(start=10.0)
    for _ in range(8):
        meter.add(steps=1, samples=32)
    assert meter.measure(12.0) == (128.0, 4.0)
    meter.add(steps=1, samples=10)
    assert meter.measure(12.0) == (128.0, 4.0)  # no time passed: the last rates
    assert meter.measure(22.0) == (1.0, 0.1)
    assert meter.measure(32.0) == (0.0, 0.0)  # idle


def test_refresh_writes_at_once_then_every_interval_and_sooner_on_a_change_but_not_within_min_gap():
    refresh = Refresh(interval=10.0, min_gap=1.0)
    assert refresh.due(0.0, "joining")
    refresh.written(0.0, "joining")
    assert not refresh.due(5.0, "joining")
    assert not refresh.due(0.5, "contributor")  # changed, but within min_gap
    assert refresh.due(1.0, "contributor")
    refresh.written(1.0, "contributor")
    assert not refresh.due(10.9, "contributor")
    assert refresh.due(11.0, "contributor")
    refresh.reset()
    assert refresh.due(11.0, "contributor")
    with pytest.raises(ValueError):
        Refresh(interval=1.0, min_gap=2.0)


def test_entry_refuses_to_build_a_bad_one():
    with pytest.raises(ValueError, match="role"):
        _entry(role="boss")


def test_what_a_member_clipped_rides_in_its_entry_and_the_group_sums_it():
    from learn.membership import clipped_by_group, suspect_of_group

    written = {"a": _entry(clipped={"bad": [3, 4], "honest": [1, 4]}), "b": _entry(clipped={"bad": [4, 4]}),
               "honest": _entry(), "bad": _entry(clipped={"bad": [0, 4], "honest": [9, 9]})}
    assert [check_entry(e)["clipped"] for e in written.values()][:3] == [
        {"bad": [3, 4], "honest": [1, 4]}, {"bad": [4, 4]}, {}]
    assert check_entry({k: v for k, v in _entry().items() if k != "clipped"})["clipped"] == {}  # an older member's
    by_group = clipped_by_group({author: check_entry(e) for author, e in written.items()})
    assert by_group == {"bad": (7, 8, 2), "honest": (10, 13, 1)}  # its own entry's word on itself is left out
    assert suspect_of_group(2, 3) and not suspect_of_group(1, 3)  # one lying entry makes no suspect


@pytest.mark.parametrize("bad", [
    [1, 2], {"p": [2, 1]}, {"p": [1]}, {"p": [-1, 2]}, {"p": [1.0, 2]}, {"p": "1,2"}, {"": [0, 1]},
    {"p" * 129: [0, 1]}, {str(n): [0, 1] for n in range(33)},
])
def test_a_malformed_clipped_map_rejects_the_entry(bad):
    assert check_entry({**_entry(), "clipped": bad}) is None


def test_a_member_is_a_suspect_once_clipped_in_enough_rounds_and_most_of_them():
    from learn.membership import SUSPECT_AFTER, suspect

    assert suspect(SUSPECT_AFTER, SUSPECT_AFTER) and suspect(SUSPECT_AFTER, 2 * SUSPECT_AFTER - 1)
    assert not suspect(SUSPECT_AFTER - 1, SUSPECT_AFTER - 1)  # too few rounds to say
    assert not suspect(SUSPECT_AFTER, 2 * SUSPECT_AFTER)  # half of them: not most
