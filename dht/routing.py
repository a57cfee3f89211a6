"""The Kademlia routing table: 256 k-buckets with replacement caches.

Sans-IO: the table never sends anything.  When a full bucket meets a new
contact, :meth:`RoutingTable.update` answers with the bucket's least-recently
seen entry; the caller pings it and reports back with :meth:`seen` (it
stays, the newcomer waits in the replacement cache) or :meth:`failed` (it is
dropped and the freshest replacement takes its place).  Long-lived nodes are
kept over newcomers, which is what makes Kademlia hard to flood.

A bucket also admits at most ``max_per_prefix`` contacts from one IP prefix
(by default /24 for IPv4, /48 for IPv6), so one network cannot fill it.
Loopback addresses are exempt: they are this machine.
"""

from __future__ import annotations

import functools
import ipaddress
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from .ids import ID_BITS, Contact

V4_PREFIX = 24  # bits of an address that make its prefix, by default
V6_PREFIX = 48


@dataclass
class _Bucket:
    entries: "OrderedDict[bytes, Contact]" = field(default_factory=OrderedDict)  # least recently seen first
    replacements: "OrderedDict[bytes, Contact]" = field(default_factory=OrderedDict)  # freshest last
    failures: dict[bytes, int] = field(default_factory=dict)
    heard: dict[bytes, float] = field(default_factory=dict)  # when each entry last answered or asked
    checking: bytes | None = None  # public key of the entry whose liveness is being checked
    touched: float | None = None  # when a lookup last went through this bucket's range


def ip_prefix(contact: Contact, v4_bits: int = V4_PREFIX, v6_bits: int = V6_PREFIX) -> str | None:
    """The IP prefix (``v4_bits`` or ``v6_bits`` long) a contact's first address
    is in, or None when exempt (no address, not an IP literal, or loopback)."""
    return _address_prefix(contact.addrs[0], v4_bits, v6_bits) if contact.addrs else None


@functools.lru_cache(maxsize=65536)
def _address_prefix(address: str, v4_bits: int, v6_bits: int) -> str | None:
    host = address.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return None
    bits = v4_bits if ip.version == 4 else v6_bits
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class RoutingTable:
    """Contacts by XOR distance from ``own_id``, ``k`` per bucket."""

    def __init__(self, own_id: bytes, *, k: int = 20, replacements: int = 20,
                 max_per_prefix: int = 3, max_failures: int = 3, check_after: float = 60.0,
                 prefix_bits: tuple[int, int] = (V4_PREFIX, V6_PREFIX),
                 on_change: Callable[[], None] = lambda: None):
        self.own_id = own_id
        self.own_num = int.from_bytes(own_id, "big")
        self.k = k
        self.max_replacements = replacements
        self.max_per_prefix = max_per_prefix
        self.prefix_bits = prefix_bits  # (IPv4, IPv6) lengths of the prefixes max_per_prefix counts
        self.max_failures = max_failures
        self.check_after = check_after
        self._on_change = on_change  # called when a contact enters, leaves or moves
        self._buckets: dict[int, _Bucket] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, contact: Contact) -> bool:
        return self.get(contact) is not None

    def get(self, contact: Contact) -> Contact | None:
        """The table's entry for ``contact``'s key (with the addresses it holds), if any."""
        if contact.num == self.own_num:
            return None
        bucket = self._buckets.get(self.bucket_of(contact))
        return None if bucket is None else bucket.entries.get(contact.public_key)

    def bucket_of(self, contact: Contact) -> int:
        """The index of the bucket ``contact`` belongs in (ValueError for our own id)."""
        d = contact.num ^ self.own_num
        if d == 0:
            raise ValueError("the table does not hold its own node")
        return d.bit_length() - 1

    # --- learning about contacts ----------------------------------------------------

    def update(self, contact: Contact, now: float = 0.0) -> Contact | None:
        """Record that ``contact`` was heard from (answered us, or asked us in server mode).

        Returns None, or the least-recently-seen entry of a full bucket, which
        the caller should ping and report with :meth:`seen` or :meth:`failed`.
        An entry heard from within ``check_after`` seconds is not checked: the
        newcomer just waits in the replacement cache.
        """
        index = self.bucket_of(contact)
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = _Bucket()
        pk = contact.public_key
        if pk in bucket.entries:
            if bucket.entries[pk].addrs != contact.addrs:
                bucket.entries[pk] = contact
                self._on_change()
            bucket.entries.move_to_end(pk)
            bucket.failures.pop(pk, None)
            bucket.heard[pk] = now
            return None
        if not self._prefix_allows(bucket, contact):
            return None
        if len(bucket.entries) < self.k:
            bucket.entries[pk] = contact
            bucket.heard[pk] = now
            bucket.replacements.pop(pk, None)
            self._size += 1
            self._on_change()
            return None
        bucket.replacements[pk] = contact
        bucket.replacements.move_to_end(pk)
        while len(bucket.replacements) > self.max_replacements:
            bucket.replacements.popitem(last=False)
        oldest = next(iter(bucket.entries.values()))
        if bucket.checking is not None or now - bucket.heard[oldest.public_key] < self.check_after:
            return None
        bucket.checking = oldest.public_key
        return oldest

    def _prefix_allows(self, bucket: _Bucket, contact: Contact) -> bool:
        prefix = ip_prefix(contact, *self.prefix_bits)
        if prefix is None:
            return True
        same = sum(1 for other in bucket.entries.values() if ip_prefix(other, *self.prefix_bits) == prefix)
        return same < self.max_per_prefix

    def seen(self, contact: Contact, now: float = 0.0) -> None:
        """``contact`` answered a liveness check: it becomes the most recently seen."""
        bucket = self._buckets.get(self.bucket_of(contact))
        if bucket is None:
            return
        if bucket.checking == contact.public_key:
            bucket.checking = None
        if contact.public_key in bucket.entries:
            bucket.entries.move_to_end(contact.public_key)
            bucket.failures.pop(contact.public_key, None)
            bucket.heard[contact.public_key] = now

    def failed(self, contact: Contact) -> None:
        """``contact`` did not answer.  An entry that failed a liveness check, or
        failed ``max_failures`` times in a row, or that has a replacement
        waiting, is dropped and the freshest replacement takes its place."""
        bucket = self._buckets.get(self.bucket_of(contact))
        pk = contact.public_key
        if bucket is None or pk not in bucket.entries:
            return
        checked = bucket.checking == pk
        if checked:
            bucket.checking = None
        failures = bucket.failures.get(pk, 0) + 1
        if checked or bucket.replacements or failures >= self.max_failures:
            self._drop(bucket, pk)
        else:
            bucket.failures[pk] = failures

    def remove(self, contact: Contact) -> None:
        """Forget ``contact`` (for example, it turned out to be in client mode)."""
        bucket = self._buckets.get(self.bucket_of(contact))
        if bucket is not None:
            bucket.replacements.pop(contact.public_key, None)
            if contact.public_key in bucket.entries:
                self._drop(bucket, contact.public_key)

    def _drop(self, bucket: _Bucket, pk: bytes) -> None:
        del bucket.entries[pk]
        bucket.failures.pop(pk, None)
        when = bucket.heard.pop(pk)
        self._size -= 1
        self._on_change()
        while bucket.replacements:
            _, replacement = bucket.replacements.popitem(last=True)
            if self._prefix_allows(bucket, replacement):
                bucket.entries[replacement.public_key] = replacement
                bucket.heard[replacement.public_key] = when  # unknown: no fresher than the entry it replaces
                self._size += 1
                return

    # --- queries --------------------------------------------------------------------

    def closest(self, target: bytes, count: int | None = None) -> list[Contact]:
        """Up to ``count`` (default k) contacts nearest ``target``, nearest first.

        Only the buckets that can hold the answer are sorted: the target's own
        bucket, then every nearer bucket pooled, then the farther ones in turn.
        """
        count = self.k if count is None else count
        target_num = int.from_bytes(target, "big")
        d = target_num ^ self.own_num
        first = d.bit_length() - 1  # -1 when the target is our own id
        groups: list[list[int]] = []
        if first >= 0:
            groups.append([first])
        groups.append([i for i in self._buckets if i < first] if first >= 0 else list(self._buckets))
        groups.extend([i] for i in range(first + 1, ID_BITS))
        out: list[Contact] = []
        for group in groups:
            found = [c for i in group if i in self._buckets for c in self._buckets[i].entries.values()]
            found.sort(key=lambda c: c.num ^ target_num)
            out.extend(found)
            if len(out) >= count:
                break
        return out[:count]

    def contacts(self) -> list[Contact]:
        """Every contact in the table, nearest buckets first."""
        return [c for i in sorted(self._buckets) for c in self._buckets[i].entries.values()]

    def bucket_sizes(self) -> dict[int, tuple[int, int]]:
        """``{index: (entries, replacements)}`` for each bucket that holds anything."""
        return {i: (len(b.entries), len(b.replacements)) for i, b in sorted(self._buckets.items())
                if b.entries or b.replacements}

    # --- refresh --------------------------------------------------------------------

    def touch(self, target: bytes, now: float) -> None:
        """A lookup for ``target`` ran: its bucket counts as refreshed."""
        d = int.from_bytes(target, "big") ^ self.own_num
        if d:
            self._buckets.setdefault(d.bit_length() - 1, _Bucket()).touched = now

    def looked_up_since(self, target: bytes, since: float) -> bool:
        """Whether a lookup went through ``target``'s bucket at ``since`` or later."""
        d = int.from_bytes(target, "big") ^ self.own_num
        bucket = self._buckets.get(d.bit_length() - 1) if d else None
        return bucket is not None and bucket.touched is not None and bucket.touched >= since

    def stale_buckets(self, now: float, interval: float) -> list[int]:
        """Indices of buckets not looked through for ``interval`` seconds, from
        the farthest down to the nearest bucket that holds a contact."""
        if not self._buckets:
            return []
        nearest = min(i for i, b in self._buckets.items() if b.entries) if self._size else ID_BITS - 1
        return [i for i in range(ID_BITS - 1, nearest - 1, -1)
                if (touched := self._buckets.get(i, _Bucket()).touched) is None or now - touched >= interval]

    def random_id_in_bucket(self, index: int, rng: random.Random | None = None) -> bytes:
        """A random id whose bucket (seen from us) is ``index``."""
        rng = rng or random
        d = (1 << index) | rng.getrandbits(index) if index else 1
        return (self.own_num ^ d).to_bytes(ID_BITS // 8, "big")
