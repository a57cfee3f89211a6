"""DHT record and provider stores (in memory and on SQLite) and the rate limiter."""

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.ids import Contact, distance, key_id, node_id
from dht.ratelimit import RateLimiter
from dht.records import MAX_KEY, MAX_TTL, RecordError
from dht.validators import Validators
from dht.storage import Database, ProviderStore, RecordStore, StoreFull
from test_dht_records import NOW, Author

OWN_ID = node_id(b"\x01" * 32)


@pytest.fixture(params=["memory", "sqlite"])
def db(request, tmp_path):
    """Every store test runs on a memory-only store and on a SQLite-backed one."""
    database = Database(None if request.param == "memory" else tmp_path / "dht.sqlite")
    yield database
    database.close()


@pytest.fixture
def author() -> Author:
    return Author()


def record_store(db, **limits) -> RecordStore:
    return RecordStore(db, OWN_ID, Validators.default(), now=NOW, **limits)


def by_closeness(keys):
    return sorted(keys, key=lambda key: distance(key_id(key), OWN_ID))


def provider(n: int, *addrs: str) -> Contact:
    return Contact(bytes([n]) * 32, addrs)


# -- records ---------------------------------------------------------------


def test_a_copy_of_the_record_held_is_not_checked_again(db, author, monkeypatch):
    store = record_store(db)
    record = author.record(b"/open/k", b"v1")
    assert store.put(record, NOW)
    checked = []
    monkeypatch.setattr(store._validators, "validate", lambda r, now: checked.append(r))
    assert not store.put(record, NOW)  # the same record again: kept, not verified
    assert checked == []
    newer = author.record(b"/open/k", b"v2", seq=record.seq + 1)
    assert store.put(newer, NOW) and checked == [newer]


def test_put_then_get(db, author):
    store = record_store(db)
    record = author.record(b"/open/k", b"v1")
    assert store.put(record, NOW)
    assert store.get(b"/open/k", NOW) == record
    assert store.get(b"/open/other", NOW) is None
    assert len(store) == 1
    assert store.stats() == {"records": 1, "bytes": record.encoded_size}


def test_put_replaces_only_with_a_better_record(db, author):
    store = record_store(db)
    v2 = author.record(b"/open/k", b"v2", seq=2)
    assert store.put(v2, NOW)
    assert not store.put(author.record(b"/open/k", b"v1", seq=1), NOW)
    assert not store.put(v2, NOW)
    assert store.get(b"/open/k", NOW) == v2
    v3 = author.record(b"/open/k", b"v3", seq=3)
    assert store.put(v3, NOW)
    assert store.get(b"/open/k", NOW) == v3
    assert store.stats() == {"records": 1, "bytes": v3.encoded_size}


def test_put_rejects_an_invalid_record(db, author):
    store = record_store(db)
    with pytest.raises(RecordError, match="expired"):
        store.put(author.record(b"/open/k", expires=NOW - 1), NOW)
    with pytest.raises(RecordError, match="unknown namespace"):
        store.put(author.record(b"/nope/k"), NOW)
    assert len(store) == 0


def test_expired_records_are_removed(db, author):
    store = record_store(db)
    store.put(author.record(b"/open/short", expires=NOW + 10), NOW)
    store.put(author.record(b"/open/long", expires=NOW + 100), NOW)
    assert store.get(b"/open/short", NOW + 10) is None
    assert len(store) == 1
    store.put(author.record(b"/open/short2", expires=NOW + 20), NOW)
    assert store.expire(NOW + 50) == 1
    assert [record.key for record in store.records()] == [b"/open/long"]


def test_an_expired_record_does_not_block_a_lower_seq(db, author):
    store = record_store(db)
    store.put(author.record(b"/open/k", seq=9, expires=NOW + 10), NOW)
    fresh = author.record(b"/open/k", seq=1, expires=NOW + 100)
    assert store.put(fresh, NOW + 20)
    assert store.get(b"/open/k", NOW + 20) == fresh


def test_records_is_a_snapshot(db, author):
    store = record_store(db)
    for i in range(3):
        store.put(author.record(b"/open/%d" % i, expires=NOW + 10), NOW)
    for record in store.records():
        store.get(record.key, NOW + 10)  # removes it while we walk
    assert len(store) == 0


def test_a_full_store_keeps_the_keys_closest_to_this_node(db, author):
    store = record_store(db, max_records=5)
    keys = [b"/open/%d" % i for i in range(20)]
    for key in keys:
        try:
            assert store.put(author.record(key), NOW)
        except StoreFull:
            pass
    assert sorted(record.key for record in store.records()) == sorted(by_closeness(keys)[:5])


def test_a_full_store_refuses_a_farther_key_and_keeps_what_it_has(db, author):
    *near, far = by_closeness([b"/open/%d" % i for i in range(4)])
    store = record_store(db, max_records=3)
    for key in near:
        store.put(author.record(key), NOW)
    with pytest.raises(StoreFull, match="store full"):
        store.put(author.record(far), NOW)
    assert sorted(record.key for record in store.records()) == sorted(near)
    better = author.record(near[-1], b"new", seq=1)
    assert store.put(better, NOW)  # replacing needs no room
    assert store.get(near[-1], NOW) == better


def test_the_byte_limit_evicts_farthest_records(db, author):
    keys = by_closeness([b"/open/%d" % i for i in range(4)])
    small = [author.record(key, b"x" * 1000) for key in keys]
    store = record_store(db, max_bytes=sum(record.encoded_size for record in small[:3]))
    for record in small[1:]:
        store.put(record, NOW)
    big = author.record(keys[0], b"x" * 2000)
    assert store.put(big, NOW)
    assert sorted(record.key for record in store.records()) == sorted(keys[:2])
    assert store.stats()["bytes"] == big.encoded_size + small[1].encoded_size


def test_a_record_larger_than_the_store_is_refused(db, author):
    store = record_store(db, max_bytes=500)
    with pytest.raises(StoreFull):
        store.put(author.record(b"/open/k", b"x" * 1000), NOW)
    assert len(store) == 0


def test_an_author_may_hold_only_so_many_records(db, author):
    store = record_store(db, max_per_author=2)
    store.put(author.record(b"/open/a"), NOW)
    store.put(author.record(b"/open/b"), NOW)
    with pytest.raises(RecordError, match=f"author {author.public_key.hex()} has too many records here"):
        store.put(author.record(b"/open/c"), NOW)
    assert store.put(author.record(b"/open/b", seq=1), NOW)  # replacing one of theirs is fine
    assert store.put(Author().record(b"/open/c"), NOW)


def test_an_overwritten_open_key_counts_for_its_new_author(db, author):
    store = record_store(db, max_per_author=1)
    other = Author()
    store.put(author.record(b"/open/a"), NOW)
    store.put(other.record(b"/open/a", seq=1), NOW)
    assert store.put(author.record(b"/open/b"), NOW)
    with pytest.raises(RecordError, match="too many records"):
        store.put(other.record(b"/open/c"), NOW)


_AUTHORS = [Author() for _ in range(3)]
_POOL = [
    author.record(b"/open/%d" % key, b"x" * (key * 300), seq=seq, expires=NOW + expires)
    for author in _AUTHORS
    for key in range(6)
    for seq in range(2)
    for expires in (10, 100)
]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_POOL), st.integers(0, 120)), max_size=30))
def test_store_stays_within_its_limits_and_accounts_exactly(puts):
    store = record_store(None, max_records=4, max_bytes=3000, max_per_author=3)
    for record, now in puts:
        try:
            store.put(record, NOW + now)
        except RecordError:
            pass
        held = list(store.records())
        assert store.stats() == {"records": len(held), "bytes": sum(r.encoded_size for r in held)}
        assert len(held) <= 4 and store.stats()["bytes"] <= 3000
        assert all(sum(r.public_key == a.public_key for r in held) <= 3 for a in _AUTHORS)


# -- persistence -----------------------------------------------------------


def test_records_survive_reopening(tmp_path, author):
    path = tmp_path / "dht.sqlite"
    with Database(path) as db:
        store = record_store(db)
        kept = author.record(b"/open/kept", b"v", seq=2, expires=NOW + 1000)
        store.put(author.record(b"/open/kept", seq=1, expires=NOW + 1000), NOW)
        store.put(kept, NOW)
        store.put(author.record(b"/open/short", expires=NOW + 10), NOW)
    with Database(path) as db:
        reopened = RecordStore(db, OWN_ID, Validators.default(), now=NOW + 100)
        assert list(reopened.records()) == [kept]
    with Database(path) as db:  # the expired record was deleted from the file too
        assert len(RecordStore(db, OWN_ID, Validators.default(), now=NOW)) == 1


def test_reopening_drops_records_that_no_longer_validate(tmp_path, author):
    path = tmp_path / "dht.sqlite"
    with Database(path) as db:
        record_store(db).put(author.record(b"/open/k"), NOW)
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE dht_records SET value = ?", (b"tampered",))
        raw.execute("INSERT INTO dht_records VALUES (?, ?, ?, ?, ?, ?)", (b"/open/x", "text", b"pk", -1, 0, b""))
    with Database(path) as db:
        assert len(record_store(db)) == 0
        assert db.load_records() == []


def test_reopening_with_smaller_limits_keeps_the_closest(tmp_path, author):
    path = tmp_path / "dht.sqlite"
    keys = [b"/open/%d" % i for i in range(6)]
    with Database(path) as db:
        store = record_store(db)
        for key in keys:
            store.put(author.record(key), NOW)
    with Database(path) as db:
        assert sorted(r.key for r in record_store(db, max_records=2).records()) == sorted(by_closeness(keys)[:2])
    with Database(path) as db:
        assert len(record_store(db)) == 2


def test_database_uses_wal(tmp_path):
    Database(tmp_path / "dht.sqlite").close()
    with sqlite3.connect(tmp_path / "dht.sqlite") as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_contacts_survive_reopening(tmp_path):
    path = tmp_path / "dht.sqlite"
    first = [provider(1, "udp/10.0.0.1:4000"), provider(2), provider(3, "udp/10.0.0.3:1", "udp/[::1]:2")]
    with Database(path) as db:
        db.save_contacts([provider(9)])
        db.save_contacts(first)
    with Database(path) as db:
        loaded = db.load_contacts()
    assert [(c.public_key, c.addrs) for c in loaded] == [(c.public_key, c.addrs) for c in first]


def test_damaged_contact_rows_are_skipped(tmp_path):
    path = tmp_path / "dht.sqlite"
    with Database(path) as db:
        db.save_contacts([provider(1, "udp/10.0.0.1:4000")])
    with sqlite3.connect(path) as raw:
        raw.executemany(
            "INSERT INTO dht_contacts VALUES (?, ?)",
            [
                (b"short", b"\x90"),  # public key of the wrong size
                (b"\x02" * 32, b"\xc1garbage"),  # not msgpack
                (b"\x03" * 32, "text"),  # not bytes
                (b"\x04" * 32, b"\x91\x01"),  # [1]: an address that is not a string
            ],
        )
    with Database(path) as db:
        assert db.load_contacts() == [provider(1)]


def test_a_memory_database_keeps_nothing():
    with Database(None) as db:
        db.save_contacts([provider(1)])
        assert db.load_contacts() == []


def test_providers_survive_reopening(tmp_path):
    path = tmp_path / "dht.sqlite"
    with Database(path) as db:
        store = ProviderStore(db, now=NOW)
        store.add(b"model", provider(1, "udp/10.0.0.1:1"), NOW + 500, NOW)
        store.add(b"model", provider(2), NOW + 50, NOW)
        store.add(b"other", provider(3), NOW + 20, NOW)
    with Database(path) as db:
        reopened = ProviderStore(db, now=NOW + 30)
        assert reopened.stats() == {"keys": 1, "providers": 2}
        [(first, first_expires), (second, _)] = reopened.get(b"model", NOW + 30)
    assert (first, first.addrs, first_expires) == (provider(1), ("udp/10.0.0.1:1",), NOW + 500)
    assert second == provider(2)


# -- providers -------------------------------------------------------------


def test_providers_come_latest_expiry_first(db):
    store = ProviderStore(db, now=NOW)
    store.add(b"k", provider(1), NOW + 10, NOW)
    store.add(b"k", provider(2), NOW + 30, NOW)
    store.add(b"k", provider(3), NOW + 20, NOW)
    assert store.get(b"k", NOW) == [(provider(2), NOW + 30), (provider(3), NOW + 20), (provider(1), NOW + 10)]
    assert store.get(b"nothing", NOW) == []


def test_adding_a_listed_provider_refreshes_it(db):
    store = ProviderStore(db, now=NOW)
    store.add(b"k", provider(1, "udp/old:1"), NOW + 10, NOW)
    store.add(b"k", provider(1, "udp/new:1"), NOW + 99, NOW)
    [(contact, expires)] = store.get(b"k", NOW)
    assert (contact.addrs, expires) == (("udp/new:1",), NOW + 99)
    assert store.stats() == {"keys": 1, "providers": 1}


def test_a_full_key_keeps_its_longest_lived_providers(db):
    store = ProviderStore(db, max_per_key=2, now=NOW)
    store.add(b"k", provider(1), NOW + 10, NOW)
    store.add(b"k", provider(2), NOW + 20, NOW)
    store.add(b"k", provider(3), NOW + 5, NOW)  # ignored: expires before all of them
    assert [contact for contact, _ in store.get(b"k", NOW)] == [provider(2), provider(1)]
    store.add(b"k", provider(4), NOW + 15, NOW)  # displaces provider 1
    assert [contact for contact, _ in store.get(b"k", NOW)] == [provider(2), provider(4)]
    assert store.stats() == {"keys": 1, "providers": 2}


def test_provider_store_limits(db):
    store = ProviderStore(db, max_keys=2, max_total=3, now=NOW)
    store.add(b"a", provider(1), NOW + 10, NOW)
    store.add(b"b", provider(1), NOW + 10, NOW)
    with pytest.raises(StoreFull, match="2 keys"):
        store.add(b"c", provider(1), NOW + 10, NOW)
    store.add(b"a", provider(2), NOW + 10, NOW)
    with pytest.raises(StoreFull, match="3 entries"):
        store.add(b"b", provider(2), NOW + 10, NOW)
    store.add(b"a", provider(2), NOW + 20, NOW)  # refreshing needs no room
    assert store.stats() == {"keys": 2, "providers": 3}


def test_provider_entries_are_checked(db):
    store = ProviderStore(db, now=NOW)
    with pytest.raises(RecordError, match="provider key must be"):
        store.add(b"x" * (MAX_KEY + 1), provider(1), NOW + 10, NOW)
    with pytest.raises(RecordError, match="provider key must be"):
        store.add(b"", provider(1), NOW + 10, NOW)
    with pytest.raises(RecordError, match="expired"):
        store.add(b"k", provider(1), NOW, NOW)
    with pytest.raises(RecordError, match="expires more than"):
        store.add(b"k", provider(1), NOW + MAX_TTL + 3600, NOW)
    assert store.stats() == {"keys": 0, "providers": 0}


def test_expired_providers_are_removed(db):
    store = ProviderStore(db, now=NOW)
    store.add(b"a", provider(1), NOW + 10, NOW)
    store.add(b"a", provider(2), NOW + 30, NOW)
    store.add(b"b", provider(1), NOW + 10, NOW)
    assert store.get(b"a", NOW + 10) == [(provider(2), NOW + 30)]
    assert store.expire(NOW + 10) == 1
    assert store.stats() == {"keys": 1, "providers": 1}
    assert store.expire(NOW + 30) == 1
    assert store.stats() == {"keys": 0, "providers": 0}


# -- rate limiter ----------------------------------------------------------


def test_rate_limiter_allows_a_burst_then_the_rate():
    limiter = RateLimiter(rate=2, burst=3)
    assert [limiter.allow("p", NOW) for _ in range(4)] == [True, True, True, False]
    assert not limiter.allow("p", NOW + 0.4)
    assert limiter.allow("p", NOW + 0.5)
    assert limiter.allow("q", NOW)  # peers are independent
    assert [limiter.allow("p", NOW + 100) for _ in range(4)] == [True, True, True, False]  # refills to burst only


def test_rate_limiter_costs_and_clock_going_backwards():
    limiter = RateLimiter(rate=1, burst=5)
    assert not limiter.allow("p", NOW, cost=6)
    assert limiter.allow("p", NOW, cost=5)
    assert not limiter.allow("p", NOW - 100)
    assert not limiter.allow("p", NOW + 0.5)
    assert limiter.allow("p", NOW + 1)


def test_rate_limiter_forgets_the_least_recently_seen_peers():
    limiter = RateLimiter(rate=1, burst=1, max_peers=2)
    assert limiter.allow("a", NOW) and limiter.allow("b", NOW)
    assert not limiter.allow("a", NOW)  # a is now the most recently seen
    assert limiter.allow("c", NOW)  # forgets b
    assert len(limiter) == 2
    assert not limiter.allow("a", NOW)  # a is still remembered as drained
    assert limiter.allow("b", NOW)  # b starts afresh


def test_rate_limiter_rejects_nonsense_settings():
    with pytest.raises(ValueError):
        RateLimiter(rate=0, burst=1)
