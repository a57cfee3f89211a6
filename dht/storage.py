"""Bounded stores for DHT records and provider entries, optionally durable.

The stores keep everything in dicts.  Given a ``Database`` backed by a file
they also write every change through to SQLite before the call returns, and
reload (and re-check) what is there when constructed; with no database, or
one opened on ``None``, they are memory only, which is what a simulation of
thousands of nodes in one process wants.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import sqlite3
import time
from collections import Counter
from typing import Iterable, Iterator

import msgpack

from .ids import Contact, distance, key_id
from .records import CLOCK_SKEW, MAX_KEY, MAX_TTL, Record, RecordError
from .validators import Validators

MiB = 1024 * 1024
# the stores' default limits (DhtConfig's, and so the [dht] keys')
MAX_RECORDS = 65536
MAX_RECORD_BYTES = 64 * MiB
MAX_PER_AUTHOR = 1024
MAX_PROVIDERS_PER_KEY = 64
MAX_PROVIDER_KEYS = 65536
MAX_PROVIDERS = 262144

_RECORD_COLUMNS = ", ".join(field.name for field in dataclasses.fields(Record))
_SCHEMA = """
CREATE TABLE IF NOT EXISTS dht_records (
    key BLOB PRIMARY KEY, value BLOB NOT NULL, public_key BLOB NOT NULL,
    seq INTEGER NOT NULL, expires INTEGER NOT NULL, signature BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS dht_providers (
    key BLOB NOT NULL, public_key BLOB NOT NULL, addrs BLOB NOT NULL, expires REAL NOT NULL,
    PRIMARY KEY (key, public_key));
CREATE TABLE IF NOT EXISTS dht_contacts (public_key BLOB PRIMARY KEY, addrs BLOB NOT NULL);
"""
_DELETE_RECORD = "DELETE FROM dht_records WHERE key = ?"
_DELETE_PROVIDER = "DELETE FROM dht_providers WHERE key = ? AND public_key = ?"


class StoreFull(RecordError):
    """A store is at its limits and refuses a new entry."""


def _pack_addrs(contact: Contact) -> bytes:
    return msgpack.packb(list(contact.addrs))


def _parse_contact(public_key: object, packed_addrs: object) -> Contact | None:
    """The contact a stored row describes, or None when the row is damaged."""
    try:
        return Contact.from_wire({"pk": public_key, "a": msgpack.unpackb(packed_addrs)})
    except (ValueError, TypeError):  # ContactError and msgpack's errors are ValueErrors
        return None


class Database:
    """The SQLite file holding a node's DHT records, providers and routing
    contacts, in WAL mode with ``synchronous=NORMAL``: a committed change
    survives the process being killed (though not necessarily a power cut).

    ``Database(None)`` (or ``":memory:"``) holds nothing: writes are no-ops and
    loads are empty, so stores built on it live in memory alone.
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self._conn = None if path is None or path == ":memory:" else sqlite3.connect(path)
        if self._conn is not None:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the file; the Database may not be used afterwards."""
        if self._conn is not None:
            self._conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, *statements: tuple[str, Iterable[tuple]]) -> None:
        """Run each statement once per row of parameters, all in one committed
        transaction."""
        if self._conn is None:
            return
        with self._conn:
            for sql, rows in statements:
                self._conn.executemany(sql, rows)

    def _read(self, sql: str) -> list[tuple]:
        return [] if self._conn is None else self._conn.execute(sql).fetchall()

    def save_record(self, record: Record, evict: Iterable[bytes] = ()) -> None:
        """Store ``record`` in place of any under its key and delete the
        records under the keys in ``evict``, atomically."""
        self._write(
            (f"INSERT OR REPLACE INTO dht_records ({_RECORD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
             [dataclasses.astuple(record)]),
            (_DELETE_RECORD, [(key,) for key in evict]),
        )

    def delete_records(self, keys: Iterable[bytes]) -> None:
        """Delete the records under ``keys``."""
        self._write((_DELETE_RECORD, [(key,) for key in keys]))

    def load_records(self) -> list[Record]:
        """Every stored record that is well-formed; rows that are not are
        deleted.  Signatures and expiry are left for the caller to check."""
        records, damaged = [], []
        for rowid, *fields in self._read(f"SELECT rowid, {_RECORD_COLUMNS} FROM dht_records"):
            try:
                records.append(Record(*fields))
            except RecordError:
                damaged.append((rowid,))
        self._write(("DELETE FROM dht_records WHERE rowid = ?", damaged))
        return records

    def save_provider(self, key: bytes, provider: Contact, expires: float, evict: Iterable[bytes] = ()) -> None:
        """Store ``provider`` for ``key`` until ``expires`` (replacing its
        earlier entry) and delete the providers of ``key`` whose public keys
        are in ``evict``, atomically."""
        self._write(
            ("INSERT OR REPLACE INTO dht_providers VALUES (?, ?, ?, ?)",
             [(key, provider.public_key, _pack_addrs(provider), expires)]),
            (_DELETE_PROVIDER, [(key, public_key) for public_key in evict]),
        )

    def delete_providers(self, entries: Iterable[tuple[bytes, bytes]]) -> None:
        """Delete the entries given as (key, provider public key)."""
        self._write((_DELETE_PROVIDER, entries))

    def load_providers(self) -> list[tuple[bytes, Contact, float]]:
        """Every stored (key, provider, expiry) whose provider parses; rows
        that do not are deleted.  Keys and expiry are left for the caller."""
        entries, damaged = [], []
        for rowid, key, public_key, addrs, expires in self._read(
            "SELECT rowid, key, public_key, addrs, expires FROM dht_providers"
        ):
            provider = _parse_contact(public_key, addrs)
            if provider is None or not isinstance(expires, (int, float)):
                damaged.append((rowid,))
            else:
                entries.append((key, provider, float(expires)))
        self._write(("DELETE FROM dht_providers WHERE rowid = ?", damaged))
        return entries

    def save_contacts(self, contacts: list[Contact]) -> None:
        """Replace the saved routing table with ``contacts``, in that order."""
        self._write(
            ("DELETE FROM dht_contacts", [()]),
            ("INSERT OR REPLACE INTO dht_contacts VALUES (?, ?)",
             [(contact.public_key, _pack_addrs(contact)) for contact in contacts]),
        )

    def load_contacts(self) -> list[Contact]:
        """The saved routing table, in saved order, skipping damaged rows."""
        rows = self._read("SELECT public_key, addrs FROM dht_contacts ORDER BY rowid")
        return [contact for contact in itertools.starmap(_parse_contact, rows) if contact is not None]


class RecordStore:
    """The records this node holds, bounded in count, bytes and records per
    author.

    When full, the store keeps the records whose key ids are closest (XOR) to
    ``own_id``, the ones Kademlia expects it to hold: a new record evicts the
    farthest ones, or is refused with StoreFull if it would itself be the
    farthest.
    """

    def __init__(
        self,
        db: Database | None,
        own_id: bytes,
        validators: Validators,
        *,
        max_records: int = MAX_RECORDS,
        max_bytes: int = MAX_RECORD_BYTES,
        max_per_author: int = MAX_PER_AUTHOR,
        now: float | None = None,
    ) -> None:
        """Open the store, loading the records saved in ``db`` that are still
        valid at ``now`` (default: the clock) and deleting the rest."""
        self._db = db if db is not None else Database(None)
        self._own_id = own_id
        self._validators = validators
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._max_per_author = max_per_author
        self._records: dict[bytes, Record] = {}
        self._by_distance: list[tuple[int, bytes]] = []  # (distance of key id, key), nearest first
        self._bytes = 0
        self._per_author: Counter[bytes] = Counter()
        self._load(time.time() if now is None else now)

    def _load(self, now: float) -> None:
        dropped = []
        for record in self._db.load_records():
            try:
                evicted = self._plan(record, now)
            except RecordError:
                dropped.append(record.key)
                continue
            if evicted is not None:  # always: saved keys are unique
                self._apply(record, evicted)
                dropped.extend(evicted)
        self._db.delete_records(dropped)

    def put(self, record: Record, now: float) -> bool:
        """Store ``record`` if no live record holds its key or it is better
        than the one that does; say whether it was stored.  Raises RecordError
        if it is invalid or its author has too many records here, StoreFull if
        there is no room for it.  Durable before returning."""
        evicted = self._plan(record, now)
        if evicted is None:
            return False
        self._db.save_record(record, evicted)
        self._apply(record, evicted)
        return True

    def get(self, key: bytes, now: float) -> Record | None:
        """The live record under ``key``, if any; an expired one is removed."""
        record = self._records.get(key)
        if record is not None and record.expires <= now:
            self._drop([key])
            return None
        return record

    def expire(self, now: float) -> int:
        """Remove the records expired at ``now``; return how many."""
        expired = [key for key, record in self._records.items() if record.expires <= now]
        self._drop(expired)
        return len(expired)

    def records(self) -> Iterator[Record]:
        """A snapshot of the stored records (expired ones included until
        ``expire`` runs), safe to walk while the store changes."""
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def stats(self) -> dict[str, int]:
        """``{"records": count, "bytes": approximate size}``."""
        return {"records": len(self._records), "bytes": self._bytes}

    def _distance(self, key: bytes) -> int:
        return distance(key_id(key), self._own_id)

    def _fits(self, count: int, size: int) -> bool:
        return count <= self._max_records and size <= self._max_bytes

    def _plan(self, record: Record, now: float) -> list[bytes] | None:
        """Check that ``record`` may be stored at ``now`` and return the keys
        to evict to make room, or None when the live record under its key is
        as good or better."""
        current = self._records.get(record.key)
        if record == current and current.expires > now:
            return None  # a copy of the one held, checked when it was stored
        self._validators.validate(record, now)
        if current is not None and current.expires > now and not self._validators.better(record, current):
            return None
        replaces_own = current is not None and current.public_key == record.public_key
        if not replaces_own and self._per_author[record.public_key] >= self._max_per_author:
            raise RecordError(
                f"author {record.public_key.hex()} has too many records here (limit {self._max_per_author})"
            )
        return self._room_for(record, current)

    def _room_for(self, record: Record, current: Record | None) -> list[bytes]:
        """The keys, farthest first, whose eviction lets ``record`` replace
        ``current`` within the limits; raises StoreFull if that would take
        evicting a key no farther than ``record``'s own."""
        count = len(self._records) + (current is None)
        size = self._bytes + record.encoded_size - (current.encoded_size if current else 0)
        own = self._distance(record.key)
        evicted = []
        for _, key in itertools.takewhile(lambda entry: entry[0] > own, reversed(self._by_distance)):
            if self._fits(count, size):
                break
            evicted.append(key)
            count -= 1
            size -= self._records[key].encoded_size
        if not self._fits(count, size):
            raise StoreFull(
                f"store full ({self._max_records} records, {self._max_bytes} bytes) "
                "and this record's key is no closer to this node than the records it would displace"
            )
        return evicted

    def _apply(self, record: Record, evicted: list[bytes]) -> None:
        for key in evicted:
            self._forget(key)
        if record.key in self._records:
            self._forget(record.key)
        self._records[record.key] = record
        bisect.insort(self._by_distance, (self._distance(record.key), record.key))
        self._bytes += record.encoded_size
        self._per_author[record.public_key] += 1

    def _forget(self, key: bytes) -> None:
        record = self._records.pop(key)
        del self._by_distance[bisect.bisect_left(self._by_distance, (self._distance(key), key))]
        self._bytes -= record.encoded_size
        self._per_author[record.public_key] -= 1
        if not self._per_author[record.public_key]:
            del self._per_author[record.public_key]

    def _drop(self, keys: list[bytes]) -> None:
        self._db.delete_records(keys)
        for key in keys:
            self._forget(key)


class ProviderStore:
    """Which contacts announced they can serve which keys, until when.

    A key keeps at most ``max_per_key`` providers.  When it is full, a new
    provider displaces the one expiring soonest if it will outlive it, and is
    otherwise ignored: the key is already well provided, and keeping the
    longest-lived announcements means fewer gaps before republishing.  Beyond
    ``max_keys`` keys or ``max_total`` entries in all, new ones are refused
    with StoreFull; expired entries count until ``expire`` removes them.
    """

    def __init__(
        self,
        db: Database | None,
        *,
        max_per_key: int = MAX_PROVIDERS_PER_KEY,
        max_keys: int = MAX_PROVIDER_KEYS,
        max_total: int = MAX_PROVIDERS,
        now: float | None = None,
    ) -> None:
        """Open the store, loading the entries saved in ``db`` that are still
        valid at ``now`` (default: the clock) and deleting the rest."""
        self._db = db if db is not None else Database(None)
        self._max_per_key = max_per_key
        self._max_keys = max_keys
        self._max_total = max_total
        self._providers: dict[bytes, dict[bytes, tuple[Contact, float]]] = {}  # key -> public key -> entry
        self._total = 0
        self._load(time.time() if now is None else now)

    def _load(self, now: float) -> None:
        dropped = []
        for key, provider, expires in self._db.load_providers():
            try:
                displaced = self._plan(key, provider, expires, now)
            except RecordError:
                displaced = None
            if displaced is None:
                dropped.append((key, provider.public_key))
            else:
                self._apply(key, provider, expires, displaced)
                dropped.extend((key, public_key) for public_key in displaced)
        self._db.delete_providers(dropped)

    def add(self, key: bytes, provider: Contact, expires: float, now: float) -> None:
        """Record that ``provider`` serves ``key`` until ``expires``, refreshing
        its expiry and addresses if it is already listed.  Raises RecordError
        for a key of the wrong size or an expiry not within MAX_TTL (+
        CLOCK_SKEW) from ``now``, StoreFull when the store is at its limits.
        Durable before returning."""
        displaced = self._plan(key, provider, expires, now)
        if displaced is None:
            return
        self._db.save_provider(key, provider, expires, displaced)
        self._apply(key, provider, expires, displaced)

    def get(self, key: bytes, now: float) -> list[tuple[Contact, float]]:
        """The live providers of ``key`` with their expiry, latest expiry
        first; expired ones are removed."""
        entries = self._providers.get(key, {})
        self._drop([(key, public_key) for public_key, (_, expires) in entries.items() if expires <= now])
        return sorted(entries.values(), key=lambda entry: entry[1], reverse=True)

    def expire(self, now: float) -> int:
        """Remove the entries expired at ``now``; return how many."""
        expired = [
            (key, public_key)
            for key, entries in self._providers.items()
            for public_key, (_, expires) in entries.items()
            if expires <= now
        ]
        self._drop(expired)
        return len(expired)

    def keys_of(self, public_key: bytes) -> list[bytes]:
        """The keys ``public_key`` is listed as a provider of."""
        return [key for key, entries in self._providers.items() if public_key in entries]

    def stats(self) -> dict[str, int]:
        """``{"keys": keys with providers, "providers": entries in all}``."""
        return {"keys": len(self._providers), "providers": self._total}

    def _plan(self, key: bytes, provider: Contact, expires: float, now: float) -> list[bytes] | None:
        """Check that the entry may be stored at ``now`` and return the public
        keys of the providers of ``key`` it displaces, or None when it is to
        be ignored."""
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY:
            raise RecordError(f"a provider key must be 1-{MAX_KEY} bytes")
        if expires <= now:
            raise RecordError(f"provider entry expired at {expires}")
        if expires > now + MAX_TTL + CLOCK_SKEW:
            raise RecordError(f"provider entry expires more than {MAX_TTL} s from now")
        entries = self._providers.get(key, {})
        if provider.public_key in entries:
            return []
        if len(entries) >= self._max_per_key:
            soonest, (_, soonest_expires) = min(entries.items(), key=lambda item: item[1][1])
            return [soonest] if expires > soonest_expires else None
        if not entries and len(self._providers) >= self._max_keys:
            raise StoreFull(f"provider store full: it holds providers for {self._max_keys} keys")
        if self._total >= self._max_total:
            raise StoreFull(f"provider store full: it holds {self._max_total} entries")
        return []

    def _apply(self, key: bytes, provider: Contact, expires: float, displaced: list[bytes]) -> None:
        entries = self._providers.setdefault(key, {})
        for public_key in displaced:
            del entries[public_key]
        self._total += (provider.public_key not in entries) - len(displaced)
        entries[provider.public_key] = (provider, expires)

    def _drop(self, entries: list[tuple[bytes, bytes]]) -> None:
        self._db.delete_providers(entries)
        for key, public_key in entries:
            providers = self._providers[key]
            del providers[public_key]
            self._total -= 1
            if not providers:
                del self._providers[key]
