"""The abuse attacker says it is under way only once every one of its attacks is."""

from meshd.testing.attacks import ATTACKS, UNDER_WAY, _Counters


def test_every_attack_says_what_it_counts_once_under_way():
    assert set(UNDER_WAY) == set(ATTACKS)


def test_under_way_once_each_attack_counted_its_work_or_failed():
    stats = _Counters(["garbage", "call_flood", "slow_readers"])
    stats["garbage_bytes_sent"] += 40  # not what says it is under way
    stats["garbage_datagrams"] += 1
    stats["flood_RESOURCE_EXHAUSTED"] += 1  # refused calls are calls made
    assert not stats.under_way.is_set() and stats.late() == ["slow_readers"]
    stats["slow_readers_failed:DialError"] += 1
    assert stats.under_way.is_set() and stats.late() == []
    assert stats["garbage_datagrams"] == 1  # still a counter
