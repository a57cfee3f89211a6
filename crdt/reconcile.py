"""Range-based set reconciliation, sans-IO (after Meyer's paper and Negentropy).

Two replicas each hold an `ItemSet` of 40-byte keys (8-byte big-endian lamport
clock + 32-byte content hash) and want the symmetric difference.  Each side runs
a `Reconciler`; the initiator sends `initiate()`, then the sides alternate
`receive()` until one returns None.  Afterwards each side knows `have` (keys it
holds that the peer lacks) and `need` (keys the peer holds that it lacks), and
one side's `have` is the other side's `need`.

Bounds.  A bound is a byte string of at most 40 bytes, compared with keys as
plain bytes (lexicographic, a proper prefix sorting first), or None for +infinity.
A range [lo, hi) holds the keys k with lo <= k < hi.  A split bound between two
adjacent keys p < q is the shortest prefix of q that is greater than p.

Messages are msgpack-able lists of ranges ``[hi, mode, *payload]``.  Range n
covers [hi of range n-1, hi), the first starting at b""; bounds strictly
increase; space after the last range is settled (an implicit SKIP).

* ``[hi, SKIP]``: nothing to do here.
* ``[hi, FINGERPRINT, fp]``: the sender's 16-byte fingerprint of the range.  On
  a mismatch the receiver lists its keys there (IDS) if it has at most `leaf`,
  else splits the range into at most `branch` fingerprinted parts.
* ``[hi, IDS, keys]``: all the sender's keys in the range, sorted.  The receiver
  now knows the range's difference and replies with ANSWER.
* ``[hi, ANSWER, extra, bitmap]``: ``extra`` are the sorted keys the answerer
  holds in the range that were not listed; bit i of ``bitmap`` (a little-endian
  integer, trailing zero bytes dropped) is set iff listed key i is one the
  answerer lacks.  This is how both sides learn the whole difference.

A reply holds at most `max_ranges` ranges and `max_ids` keys.  When the work
would exceed that, the sender stops and sends one fingerprint from the current
bound to +infinity, which the peer takes up again next round; an IDS range whose
answer alone would exceed `max_ids` is split instead.  Both sides should use the
same limits.  A message that holds no FINGERPRINT or IDS range needs no reply:
its sender is done and its receiver returns None.

The fingerprint of a range is blake3(sum of its keys as 320-bit integers
mod 2**320, count) truncated to 16 bytes; prefix sums make each one O(log n).
The sum is additive, so a peer able to choose keys freely could forge a
collision; keys here are content hashes, which makes that expensive.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Iterable, Iterator

import blake3
from sortedcontainers import SortedList

KEY_SIZE = 40
FP_SIZE = 16
SKIP, FINGERPRINT, IDS, ANSWER = 0, 1, 2, 3
_PAYLOAD_FIELDS = {SKIP: 0, FINGERPRINT: 1, IDS: 1, ANSWER: 2}
_MOD = 1 << (8 * KEY_SIZE)


class ReconcileError(ValueError):
    """A malformed or over-limit message from the peer."""


class ItemSet:
    """Sorted set of 40-byte keys with fast range fingerprints.

    Bounds follow the module's convention: ``lo``/``hi`` are byte strings
    compared with keys as bytes, ``hi=None`` is +infinity; [lo, hi) is half-open.
    Queries use a sorted snapshot with prefix sums, rebuilt lazily after changes.
    """

    def __init__(self, keys: Iterable[bytes] = ()):
        """Hold the given keys (duplicates collapse); ValueError on a non-key."""
        self._keys = SortedList(set(map(_checked_key, keys)))
        self._index: tuple[list[bytes], list[int]] | None = None

    def add(self, key: bytes) -> bool:
        """Insert key; True if it was new.  ValueError if it is not 40 bytes."""
        if _checked_key(key) in self._keys:
            return False
        self._keys.add(key)
        self._index = None
        return True

    def discard(self, key: bytes) -> None:
        """Remove key if present."""
        if key in self._keys:
            self._keys.remove(key)
            self._index = None

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._keys)

    def fingerprint(self, lo: bytes = b"", hi: bytes | None = None) -> bytes:
        """16-byte fingerprint of the keys in [lo, hi); equal sets give equal ones."""
        return self._fingerprint(*self._span(lo, hi))

    def keys_between(self, lo: bytes = b"", hi: bytes | None = None) -> list[bytes]:
        """The keys in [lo, hi), sorted."""
        i, j = self._span(lo, hi)
        return self._sorted()[0][i:j]

    def _sorted(self) -> tuple[list[bytes], list[int]]:
        """The keys as a sorted list, and prefix sums of them as integers."""
        if self._index is None:
            keys = list(self._keys)
            self._index = keys, list(accumulate((int.from_bytes(k, "big") for k in keys), initial=0))
        return self._index

    def _span(self, lo: bytes, hi: bytes | None) -> tuple[int, int]:
        keys = self._sorted()[0]
        i = bisect_left(keys, lo)
        return i, len(keys) if hi is None else max(i, bisect_left(keys, hi))

    def _fingerprint(self, i: int, j: int) -> bytes:
        sums = self._sorted()[1]
        data = ((sums[j] - sums[i]) % _MOD).to_bytes(KEY_SIZE, "big") + (j - i).to_bytes(8, "big")
        return blake3.blake3(data).digest(length=FP_SIZE)


class Reconciler:
    """One side of a reconciliation session over an ItemSet.

    Sans-IO: it never does I/O; messages are plain msgpack-able lists, bytes and
    ints.  `have` and `need` grow as the session goes and are complete when the
    session is `done`.  The ItemSet must not change during a session.  Every
    message received is validated; anything malformed, over `max_ranges` ranges
    or `max_ids` keys, or past `max_rounds` messages raises ReconcileError.
    Sessions take about 3 + log_branch(len(items) / leaf) messages; differences
    big enough to fill many replies (~4000 ranges each) may need more rounds.
    """

    def __init__(self, items: ItemSet, *, branch: int = 16, leaf: int = 32,
                 max_ranges: int = 4096, max_ids: int = 65536, max_rounds: int = 64):
        """ValueError unless branch >= 2, leaf >= 1, max_ids >= leaf and
        max_ranges >= branch + 3 (so that any single step fits in a reply)."""
        if branch < 2 or leaf < 1 or max_ids < leaf or max_ranges < branch + 3:
            raise ValueError("need branch >= 2, leaf >= 1, max_ids >= leaf, max_ranges >= branch + 3")
        self.items, self.branch, self.leaf = items, branch, leaf
        self.max_ranges, self.max_ids, self.max_rounds = max_ranges, max_ids, max_rounds
        self.have: set[bytes] = set()
        self.need: set[bytes] = set()
        self.rounds = 0  # messages received
        self.done = False
        self._started = False
        self._listed: dict[tuple[bytes, bytes | None], list[bytes]] = {}  # IDS ranges we last sent

    def initiate(self) -> list:
        """The first message (initiator only): one fingerprint of the whole set.
        RuntimeError if this side has already initiated or received."""
        if self._started:
            raise RuntimeError("session already started")
        self._started = True
        return [[None, FINGERPRINT, self.items.fingerprint()]]

    def receive(self, message: object) -> list | None:
        """Take the peer's message; return the reply, or None once the peer's
        message needed none (the session is then over for both sides)."""
        if self.done:
            raise ReconcileError("message received after the session finished")
        self._started = True
        self.rounds += 1
        if self.rounds > self.max_rounds:
            raise ReconcileError(f"session exceeded {self.max_rounds} rounds")
        ranges = self._parse(message)
        listed, self._listed = self._listed, {}
        reply = _Reply(self.max_ranges, self.max_ids)
        for lo, hi, mode, payload in ranges:
            if mode == ANSWER:
                extra, bitmap = payload
                self.need.update(extra)
                mask = int.from_bytes(bitmap, "little")
                self.have.update(k for n, k in enumerate(listed[lo, hi]) if mask >> n & 1)
            elif mode == SKIP or reply.cut:
                continue
            elif mode == FINGERPRINT:
                i, j = self.items._span(lo, hi)
                if payload[0] != self.items._fingerprint(i, j):
                    self._emit(reply, lo, self._describe(i, j, hi))
            else:
                self._answer(reply, lo, hi, payload[0])
        if not any(r[2] in (FINGERPRINT, IDS) for r in ranges):
            self.done = True
            return None
        self.done = not any(r[1] in (FINGERPRINT, IDS) for r in reply.ranges)
        return reply.ranges

    def _describe(self, i: int, j: int, hi: bytes | None) -> list[list]:
        """Ranges telling the peer about our keys i..j-1: a list or a split."""
        keys = self.items._sorted()[0]
        if j - i <= self.leaf:
            return [[hi, IDS, keys[i:j]]]
        parts = min(self.branch, j - i)
        cuts = [i + (j - i) * t // parts for t in range(parts + 1)]
        bounds = [_separator(keys[c - 1], keys[c]) for c in cuts[1:-1]] + [hi]
        return [[b, FINGERPRINT, self.items._fingerprint(a, c)] for b, a, c in zip(bounds, cuts, cuts[1:])]

    def _answer(self, reply: _Reply, lo: bytes, hi: bytes | None, theirs: list[bytes]) -> None:
        """Reply to the peer's IDS for [lo, hi), learning that range's difference."""
        i, j = self.items._span(lo, hi)
        ours, listed = self.items._sorted()[0][i:j], set(theirs)
        extra = [k for k in ours if k not in listed]
        if len(extra) > self.max_ids:  # too big to ever answer: split it instead
            self._emit(reply, lo, self._describe(i, j, hi))
            return
        ours = set(ours)
        missing = [n for n, k in enumerate(theirs) if k not in ours]
        mask = sum(1 << n for n in missing)
        if self._emit(reply, lo, [[hi, ANSWER, extra, mask.to_bytes((mask.bit_length() + 7) // 8, "little")]]):
            self.have.update(extra)
            self.need.update(theirs[n] for n in missing)

    def _emit(self, reply: _Reply, lo: bytes, entries: list[list]) -> bool:
        """Add entries for [lo, ...) to the reply if they fit, else cut it off there
        with a fingerprint of [lo, +infinity) (room for which is always kept)."""
        if reply.add(lo, entries, sum(len(e[2]) for e in entries if e[1] in (IDS, ANSWER)), keep=2):
            self._listed.update(((lo, e[0]), e[2]) for e in entries if e[1] == IDS)
            return True
        reply.add(lo, [[None, FINGERPRINT, self.items.fingerprint(lo)]], 0, keep=0)
        reply.cut = True
        return False

    def _parse(self, message: object) -> list[tuple[bytes, bytes | None, int, list]]:
        """Validate a message into (lo, hi, mode, payload) tuples, or raise."""
        if not isinstance(message, (list, tuple)):
            raise ReconcileError("message must be a list of ranges")
        if len(message) > self.max_ranges:
            raise ReconcileError(f"message has {len(message)} ranges, over the limit of {self.max_ranges}")
        out, lo, budget = [], b"", self.max_ids
        for n, rng in enumerate(message):
            if not isinstance(rng, (list, tuple)) or len(rng) < 2:
                raise ReconcileError(f"range {n}: must be a list [bound, mode, *payload]")
            hi, mode = rng[0], rng[1]
            if lo is None:
                raise ReconcileError(f"range {n}: follows the +infinity bound")
            if hi is not None and not (isinstance(hi, bytes) and len(hi) <= KEY_SIZE and hi > lo):
                raise ReconcileError(f"range {n}: bound must be None or bytes of at most {KEY_SIZE}, above the last")
            if type(mode) is not int or mode not in _PAYLOAD_FIELDS:
                raise ReconcileError(f"range {n}: unknown mode {mode!r}")
            if len(rng) != 2 + _PAYLOAD_FIELDS[mode]:
                raise ReconcileError(f"range {n}: mode {mode} takes {_PAYLOAD_FIELDS[mode]} payload fields")
            payload = rng[2:]
            if mode == FINGERPRINT and not (isinstance(payload[0], bytes) and len(payload[0]) == FP_SIZE):
                raise ReconcileError(f"range {n}: fingerprint must be {FP_SIZE} bytes")
            if mode in (IDS, ANSWER):
                budget -= _parse_keys(payload[0], lo, hi, budget, n)
            if mode == ANSWER:
                listed, bitmap = self._listed.get((lo, hi)), payload[1]
                if listed is None:
                    raise ReconcileError(f"range {n}: answer for a range we did not list")
                if not set(payload[0]).isdisjoint(listed):
                    raise ReconcileError(f"range {n}: answer repeats keys we listed")
                if not isinstance(bitmap, bytes) or len(bitmap) > (len(listed) + 7) // 8 \
                        or int.from_bytes(bitmap, "little") >> len(listed):
                    raise ReconcileError(f"range {n}: bitmap must be bytes with one bit per listed key")
            out.append((lo, hi, mode, payload))
            lo = hi
        return out


class _Reply:
    """An outgoing message under construction, kept within the range and id limits."""

    def __init__(self, max_ranges: int, max_ids: int):
        self.ranges: list[list] = []
        self.cursor = b""  # where the next range starts
        self.room, self.ids, self.cut = max_ranges, max_ids, False

    def add(self, lo: bytes, entries: list[list], ids: int, keep: int) -> bool:
        """Append entries for [lo, ...) after a SKIP over any gap, unless that
        would leave fewer than `keep` ranges free or exceed the id limit."""
        cost = len(entries) + (lo != self.cursor)
        if cost > self.room - keep or ids > self.ids:
            return False
        if lo != self.cursor:
            self.ranges.append([lo, SKIP])
        self.ranges.extend(entries)
        self.room, self.ids, self.cursor = self.room - cost, self.ids - ids, entries[-1][0]
        return True


def _checked_key(key: object) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise ValueError(f"a key must be {KEY_SIZE} bytes")
    return key


def _parse_keys(keys: object, lo: bytes, hi: bytes | None, budget: int, n: int) -> int:
    """Validate a sorted key list inside [lo, hi) of at most budget keys; return its length."""
    if not isinstance(keys, (list, tuple)):
        raise ReconcileError(f"range {n}: keys must be a list")
    if len(keys) > budget:
        raise ReconcileError(f"range {n}: message carries more keys than the limit")
    prev = None
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_SIZE:
            raise ReconcileError(f"range {n}: each key must be {KEY_SIZE} bytes")
        if k < lo or (hi is not None and k >= hi) or (prev is not None and k <= prev):
            raise ReconcileError(f"range {n}: keys must be strictly increasing and inside the range")
        prev = k
    return len(keys)


def _separator(prev: bytes, key: bytes) -> bytes:
    """The shortest prefix of key that is greater than prev (prev < key)."""
    n = next(i for i, (a, b) in enumerate(zip(prev, key)) if a != b)
    return key[: n + 1]
