"""The XOR metric, k-buckets, eviction and the lookup state machine (no network)."""

import os
import random

import pytest
from hypothesis import given, strategies as st

from dht.ids import Contact, ContactError, bucket_index, distance, key_id, node_id
from dht.lookup import Lookup
from dht.routing import RoutingTable, ip_prefix

ids = st.binary(min_size=32, max_size=32)


def contact(addr: str | None = None) -> Contact:
    return Contact(os.urandom(32), (addr,) if addr else ())


def contact_in_bucket(table: RoutingTable, index: int, addr: str | None = None) -> Contact:
    """A fresh contact that falls in ``table``'s bucket ``index`` (found by trying keys)."""
    for _ in range(100_000):
        c = contact(addr)
        if table.bucket_of(c) == index:
            return c
    raise AssertionError("no key found for the bucket")


@given(ids, ids, ids)
def test_xor_is_a_metric(a, b, c):
    assert distance(a, a) == 0
    assert distance(a, b) == distance(b, a)
    assert distance(a, c) <= distance(a, b) + distance(b, c)
    assert distance(a, b) ^ distance(b, c) == distance(a, c)  # XOR is "unidirectional"


def test_ids_are_sha256_and_buckets_follow_the_highest_differing_bit():
    pk = bytes(range(32))
    assert node_id(pk) == key_id(pk)
    assert len(node_id(pk)) == 32
    own = bytes(32)
    assert bucket_index(own, bytes(31) + b"\x01") == 0
    assert bucket_index(own, b"\x80" + bytes(31)) == 255
    with pytest.raises(ValueError):
        bucket_index(own, own)


def test_contact_wire_checks():
    c = Contact(os.urandom(32), ("127.0.0.1:4100",))
    assert Contact.from_wire(c.to_wire()) == c
    for bad in [None, {"pk": b"short"}, {"pk": bytes(32), "a": ["x"] * 9}, {"pk": bytes(32), "a": [1]},
                {"pk": bytes(32), "a": ["x" * 200]}]:
        with pytest.raises(ContactError):
            Contact.from_wire(bad)


def test_full_bucket_keeps_old_live_entries_and_caches_newcomers():
    table = RoutingTable(os.urandom(32), k=4, replacements=2)
    members = [contact_in_bucket(table, 255) for _ in range(4)]
    for c in members:
        assert table.update(c) is None
    newcomer = contact_in_bucket(table, 255)
    assert table.update(newcomer, now=30.0) is None  # the oldest was heard from recently
    oldest = table.update(newcomer, now=100.0)
    assert oldest == members[0]  # least recently seen is the one to check
    assert newcomer not in table
    table.seen(oldest, now=100.0)  # it answered: it stays and moves to the back
    assert oldest in table and newcomer not in table
    assert table.update(contact_in_bucket(table, 255), now=100.0) == members[1]  # the next-oldest is checked now


def test_failed_liveness_check_promotes_the_freshest_replacement():
    table = RoutingTable(os.urandom(32), k=2, replacements=2)
    a, b = contact_in_bucket(table, 255), contact_in_bucket(table, 255)
    table.update(a)
    table.update(b)
    r1, r2, r3 = (contact_in_bucket(table, 255) for _ in range(3))
    assert table.update(r1, now=100.0) == a
    assert table.update(r2, now=100.0) is None  # one check at a time per bucket
    table.update(r3, now=100.0)  # the cache holds 2: r1 falls out
    table.failed(a)
    assert a not in table and r3 in table and r1 not in table
    assert len(table) == 2


def test_entry_without_replacement_survives_a_few_failures():
    table = RoutingTable(os.urandom(32), k=4, max_failures=3)
    c = contact_in_bucket(table, 255)
    table.update(c)
    table.failed(c)
    table.failed(c)
    assert c in table
    table.update(c)  # heard from again: the count resets
    table.failed(c)
    table.failed(c)
    assert c in table
    table.failed(c)
    assert c not in table


def test_ip_prefix_limit_per_bucket_exempts_loopback():
    table = RoutingTable(os.urandom(32), k=10, max_per_prefix=2)
    same_net = [contact_in_bucket(table, 255, f"203.0.113.{i}:4100") for i in range(1, 5)]
    for c in same_net:
        table.update(c)
    assert sum(c in table for c in same_net) == 2
    other_net = contact_in_bucket(table, 255, "198.51.100.7:4100")
    table.update(other_net)
    assert other_net in table
    local = [contact_in_bucket(table, 255, "127.0.0.1:%d" % (5000 + i)) for i in range(5)]
    for c in local:
        table.update(c)
    assert all(c in table for c in local)
    assert ip_prefix(Contact(bytes(32), ("[2001:db8:1:2::5]:4100",))) == "2001:db8:1::/48"


def test_closest_matches_a_full_sort():
    rng = random.Random(3)
    table = RoutingTable(rng.randbytes(32), k=20)
    everyone = [Contact(rng.randbytes(32)) for _ in range(3000)]
    for c in everyone:
        table.update(c)
    members = table.contacts()
    for _ in range(50):
        target = rng.randbytes(32)
        expected = sorted(members, key=lambda c: distance(c.id, target))[:20]
        assert table.closest(target) == expected
    assert table.closest(table.own_id, 5) == sorted(members, key=lambda c: distance(c.id, table.own_id))[:5]


def test_stale_buckets_and_random_ids_in_a_bucket():
    table = RoutingTable(os.urandom(32))
    table.update(contact_in_bucket(table, 250))
    assert table.stale_buckets(now=100.0, interval=50.0) == list(range(255, 249, -1))
    table.touch(table.random_id_in_bucket(253), now=90.0)
    assert 253 not in table.stale_buckets(now=100.0, interval=50.0)
    for index in (0, 7, 200, 255):
        rid = table.random_id_in_bucket(index)
        assert bucket_index(table.own_id, rid) == index


# --- the lookup state machine --------------------------------------------------------

def _world(n: int, seed: int = 1) -> list[Contact]:
    rng = random.Random(seed)
    return [Contact(rng.randbytes(32)) for _ in range(n)]


def _truth(world, target, k):
    return sorted(world, key=lambda c: distance(c.id, target))[:k]


def test_lookup_keeps_alpha_in_flight_and_stops_when_the_k_closest_answered():
    world = _world(200)
    target = os.urandom(32)
    lookup = Lookup(target, world[:5], k=8, alpha=3)
    first = lookup.next_queries()
    assert len(first) == 3 and lookup.next_queries() == []  # alpha reached
    # Everyone answers with the whole truth: the lookup must end with exactly the true 8.
    pending = list(first)
    while pending:
        c = pending.pop(0)
        lookup.answered(c, _truth(world, target, 8))
        pending += lookup.next_queries()
        assert lookup.in_flight <= 3
    assert lookup.finished
    assert lookup.closest() == _truth(world, target, 8)


def test_lookup_routes_around_failures():
    world = _world(100)
    target = os.urandom(32)
    truth = _truth(world, target, 6)
    dead = set(truth[:2])
    lookup = Lookup(target, world[50:53], k=4, alpha=2)
    pending = lookup.next_queries()
    while pending:
        c = pending.pop(0)
        if c in dead:
            lookup.failed(c)
        else:
            lookup.answered(c, truth)
        pending += lookup.next_queries()
    assert lookup.finished
    assert lookup.closest() == truth[2:6]


def test_an_overdue_query_frees_its_slot_and_stops_holding_the_lookup_until_it_answers():
    world = _world(60)
    target = os.urandom(32)
    truth = _truth(world, target, 4)
    lookup = Lookup(target, truth, k=3, alpha=1, beta=1)
    [nearest] = lookup.next_queries()
    assert nearest == truth[0] and lookup.next_queries() == []  # the one slot is taken
    lookup.slow(nearest)
    assert lookup.overdue() == [nearest] and lookup.in_flight == 0
    [second] = lookup.next_queries()  # the slot went to the next nearest
    assert second == truth[1]
    lookup.answered(second, truth)
    assert lookup.finished and lookup.closest() == truth[1:4]  # without the silent one
    lookup.answered(nearest, truth)  # a late answer still counts, and frees no second slot
    assert lookup.in_flight == 0 and lookup.overdue() == [] and lookup.closest() == truth[:3]


def test_lookup_is_not_finished_while_closer_answers_are_pending_and_stop_ends_it():
    world = _world(50)
    target = os.urandom(32)
    lookup = Lookup(target, world[:2], k=2, alpha=1)
    [c] = lookup.next_queries()
    assert not lookup.finished
    lookup.answered(c, _truth(world, target, 2))
    assert not lookup.finished  # the two closest have not answered yet
    lookup.stop()
    assert lookup.finished and lookup.next_queries() == []


def test_lookup_ignores_itself_duplicates_and_unsolicited_answers():
    world = _world(30)
    me = world[0]
    lookup = Lookup(os.urandom(32), world[1:3], k=5, alpha=3, exclude=me.public_key)
    queried = lookup.next_queries()
    lookup.answered(world[10], world[10:20])  # never asked: ignored
    lookup.answered(queried[0], [me, queried[1], world[5]])
    assert me not in lookup.next_queries()
    lookup.answered(queried[0], world[20:30])  # a second answer from the same peer is ignored
    assert lookup.queries == 3  # world[1], world[2], world[5]
    assert lookup.max_queries > 0
    assert lookup.hops() == 1


def test_lookup_query_budget_bounds_the_work():
    world = _world(500)
    lookup = Lookup(os.urandom(32), world[:3], k=20, alpha=3, max_queries=10)
    pending = lookup.next_queries()
    rng = random.Random(0)
    while pending:
        lookup.answered(pending.pop(0), rng.sample(world, 20))  # an endless supply of new names
        pending += lookup.next_queries()
    assert lookup.queries == 10 and lookup.finished
