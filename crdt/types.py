"""The replicated data types: states that form a join-semilattice.

Every state has ``join(other)`` (in place; commutative, associative and
idempotent) and ``value()`` (the plain Python view).  A change to a document
carries small *deltas*: each operation is the encoding of a tiny state of the
same type, and applying it is joining that delta in.  A replica therefore
never ships whole states, and replicas that saw the same deltas, in any order
and any number of times, hold equal states.

Dots name the events that created elements: ``(lamport, author, index)`` of
the change and the operation inside it.  Removals list the dots they observed
(observed-remove), so an add that the remover did not see survives: adds win.
Dots sort by lamport first, which makes them the timestamps of the
last-writer-wins register as well.

Counters keep one entry per author (the author's running total) and join by
maximum, so a key should be incremented by one writer key per process.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import msgpack

Dot = tuple[int, bytes, int]

LWW, MV, GCOUNTER, PNCOUNTER, SET, MAP = "lww", "mv", "gcounter", "pncounter", "set", "map"
KINDS = (LWW, MV, GCOUNTER, PNCOUNTER, SET, MAP)


def _order(value: object) -> bytes:
    """A total order on msgpack values: their encoding."""
    return msgpack.packb(value, use_bin_type=True)


class LWWRegister:
    """Last writer wins: the value with the greatest dot, unless that dot was removed."""

    kind = LWW
    __slots__ = ("dot", "val", "removed")

    def __init__(self) -> None:
        self.dot: Dot | None = None
        self.val: object = None
        self.removed: set[Dot] = set()

    def assign(self, dot: Dot, value: object) -> None:
        """Join the delta ``{dot: value}``."""
        if self.dot is None or dot > self.dot or (
                dot == self.dot and _order(value) > _order(self.val)):
            self.dot, self.val = dot, value
            self.removed = {d for d in self.removed if d >= dot}

    def join(self, other: "LWWRegister") -> None:
        if other.dot is not None:
            self.assign(other.dot, other.val)
        self.discard(other.removed)

    def discard(self, dots: Iterable[Dot]) -> None:
        floor = self.dot
        self.removed.update(d for d in dots if floor is None or d >= floor)

    def live(self) -> bool:
        return self.dot is not None and self.dot not in self.removed

    def value(self) -> object:
        return self.val if self.live() else None

    def dots(self) -> Iterator[Dot]:
        if self.live():
            yield self.dot

    def encode(self) -> list:
        return [self.dot and list(self.dot), self.val, sorted(map(list, self.removed))]

    @classmethod
    def decode(cls, data: list) -> "LWWRegister":
        state = cls()
        state.dot = tuple(data[0]) if data[0] else None
        state.val, state.removed = data[1], {tuple(d) for d in data[2]}
        return state


class _DottedEntries:
    """Shared shape of MV-Register and OR-Set: the items each live dot carries, and removed dots.

    A dot normally carries one item; it carries several only when an author
    equivocated (signed two changes at one position), and then all of them
    stay, so that the state does not depend on which change arrived first.
    """

    __slots__ = ("entries", "removed")

    def __init__(self) -> None:
        self.entries: dict[Dot, list] = {}
        self.removed: set[Dot] = set()

    def put(self, dot: Dot, item: object) -> bool:
        """Join the delta ``{dot: item}``; True if it added something."""
        if dot in self.removed:
            return False
        items = self.entries.get(dot)
        if items is None:
            self.entries[dot] = [item]
            return True
        if any(_order(i) == _order(item) for i in items):
            return False
        items.append(item)
        items.sort(key=_order)
        return True

    def discard(self, dots: Iterable[Dot]) -> None:
        for dot in dots:
            self.removed.add(dot)
            self.entries.pop(dot, None)

    def join(self, other: "_DottedEntries") -> None:
        self.discard(other.removed)
        for dot, items in other.entries.items():
            for item in items:
                self.put(dot, item)

    def dots(self) -> Iterator[Dot]:
        return iter(self.entries)

    def encode(self) -> list:
        return [sorted([list(d), items] for d, items in self.entries.items()),
                sorted(map(list, self.removed))]

    @classmethod
    def decode(cls, data: list):
        state = cls()
        state.removed = {tuple(d) for d in data[1]}
        for dot, items in data[0]:
            for item in items:
                state.put(tuple(dot), item)
        return state


class MVRegister(_DottedEntries):
    """Multi-value register: an assignment replaces the values it saw; concurrent
    assignments all stay visible until one that saw them replaces them."""

    kind = MV
    __slots__ = ()

    def value(self) -> list:
        return [item for dot in sorted(self.entries) for item in self.entries[dot]]


class ORSet(_DottedEntries):
    """Observed-remove set, adds win: an element is in the set while it has a live dot.

    Elements are int, str or bytes (never equal across those types), indexed
    so that finding an element's dots does not scan the set.
    """

    kind = SET
    __slots__ = ("_dots",)

    def __init__(self) -> None:
        super().__init__()
        self._dots: dict[object, set[Dot]] = {}

    def put(self, dot: Dot, item: object) -> bool:
        added = super().put(dot, item)
        if added:
            self._dots.setdefault(item, set()).add(dot)
        return added

    def discard(self, dots: Iterable[Dot]) -> None:
        for dot in dots:
            self.removed.add(dot)
            for item in self.entries.pop(dot, ()):
                live = self._dots[item]
                live.discard(dot)
                if not live:
                    del self._dots[item]

    def dots_of(self, element: object) -> list[Dot]:
        return list(self._dots.get(element, ()))

    def value(self) -> set:
        return set(self._dots)


class GCounter:
    """Grow-only counter: each author's running total, joined by maximum."""

    kind = GCOUNTER
    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[bytes, int] = {}

    def raise_to(self, author: bytes, total: int) -> None:
        """Join the delta ``{author: total}``."""
        if total > self.counts.get(author, 0):
            self.counts[author] = total

    def join(self, other: "GCounter") -> None:
        for author, total in other.counts.items():
            self.raise_to(author, total)

    def discard(self, dots: Iterable[Dot]) -> None:
        """Counters keep their totals when their key is removed."""

    def dots(self) -> Iterator[Dot]:
        return iter(())

    def value(self) -> int:
        return sum(self.counts.values())

    def encode(self) -> list:
        return sorted([a, n] for a, n in self.counts.items())

    @classmethod
    def decode(cls, data: list) -> "GCounter":
        state = cls()
        state.counts = {a: n for a, n in data}
        return state


class PNCounter:
    """A counter that goes both ways: two grow-only counters, increments and decrements."""

    kind = PNCOUNTER
    __slots__ = ("inc", "dec")

    def __init__(self) -> None:
        self.inc, self.dec = GCounter(), GCounter()

    def join(self, other: "PNCounter") -> None:
        self.inc.join(other.inc)
        self.dec.join(other.dec)

    def discard(self, dots: Iterable[Dot]) -> None:
        """Counters keep their totals when their key is removed."""

    def dots(self) -> Iterator[Dot]:
        return iter(())

    def value(self) -> int:
        return self.inc.value() - self.dec.value()

    def encode(self) -> list:
        return [self.inc.encode(), self.dec.encode()]

    @classmethod
    def decode(cls, data: list) -> "PNCounter":
        state = cls()
        state.inc, state.dec = GCounter.decode(data[0]), GCounter.decode(data[1])
        return state


class ORMap:
    """Observed-remove map from str keys to nested states, updates win over removes.

    Every update below a key is a presence dot for it; only each author's
    newest presence dot is kept, since an author's later changes have seen its
    earlier ones.  Removing a key removes the presence dots and every dot
    below it that the remover saw (sets, registers and maps inside are reset;
    counters keep their totals), so an update the remover did not see keeps
    the key.  A key holds one state per kind; the visible one is the kind of
    the newest live presence dot.

    Removed dots are kept per key (``removed``) and, for the removal of this
    whole map by its parent, for every key (``cleared``).  Every child has
    discarded both, whenever it was created: that makes the state a function of
    the deltas joined, not of their order.
    """

    kind = MAP
    __slots__ = ("present", "children", "removed", "cleared")

    def __init__(self) -> None:
        self.present: dict[str, dict[bytes, tuple[Dot, str]]] = {}
        self.children: dict[str, dict[str, object]] = {}
        self.removed: dict[str, set[Dot]] = {}
        self.cleared: set[Dot] = set()

    def mark(self, key: str, kind: str, dot: Dot) -> None:
        """Join the presence delta ``{key: dot}`` of an update of a ``kind`` state."""
        authors = self.present.get(key)
        if authors is None:
            authors = self.present[key] = {}
        mine = authors.get(dot[1])
        if mine is None or (dot, kind) > mine:
            authors[dot[1]] = (dot, kind)

    def child(self, key: str, kind: str, dot: Dot | None = None) -> object:
        """The ``kind`` state under ``key``, created if missing, with presence ``dot`` joined."""
        if dot is not None:
            self.mark(key, kind, dot)
        slots = self.children.get(key)
        if slots is None:
            slots = self.children[key] = {}
        state = slots.get(kind)
        if state is None:
            state = slots[kind] = CLASSES[kind]()
            gone = self._gone(key)
            if gone:
                state.discard(gone)
        return state

    def _gone(self, key: str) -> set[Dot]:
        removed = self.removed.get(key)
        return self.cleared | removed if removed else self.cleared

    def visible_kind(self, key: str) -> str | None:
        gone = self._gone(key)
        live = [entry for entry in self.present.get(key, {}).values() if entry[0] not in gone]
        return max(live)[1] if live else None

    def get(self, key: str) -> object | None:
        """The visible state under ``key``, or None."""
        kind = self.visible_kind(key)
        return None if kind is None else self.children[key][kind]

    def keys(self) -> list[str]:
        return [key for key in self.present if self.visible_kind(key) is not None]

    def subtree_dots(self, key: str) -> list[Dot]:
        """Every live dot at and below ``key``: what removing the key must name."""
        gone = self._gone(key)
        out = [dot for dot, _ in self.present.get(key, {}).values() if dot not in gone]
        for state in self.children.get(key, {}).values():
            out.extend(state.dots())
        return out

    def remove_key(self, key: str, dots: Iterable[Dot]) -> None:
        """Join the delta that removes ``dots`` at and below ``key``."""
        dots = set(dots)
        self.removed.setdefault(key, set()).update(dots)
        for state in self.children.get(key, {}).values():
            state.discard(dots)

    def discard(self, dots: Iterable[Dot]) -> None:
        dots = set(dots)
        self.cleared |= dots
        for slots in self.children.values():
            for state in slots.values():
                state.discard(dots)

    def dots(self) -> Iterator[Dot]:
        for key in self.children:
            yield from self.subtree_dots(key)

    def join(self, other: "ORMap") -> None:
        for key, authors in other.present.items():
            for dot, kind in authors.values():
                self.mark(key, kind, dot)
        for key, dots in other.removed.items():
            self.removed.setdefault(key, set()).update(dots)
        self.cleared |= other.cleared
        for key, slots in other.children.items():
            for kind, state in slots.items():
                self.child(key, kind).join(state)
        for key, slots in self.children.items():
            gone = self._gone(key)
            for state in slots.values():
                state.discard(gone)

    def value(self) -> dict:
        return {key: self.get(key).value() for key in self.keys()}

    def encode(self) -> list:
        return [
            sorted([k, sorted([list(d), kind] for d, kind in a.values())] for k, a in self.present.items()),
            sorted([k, sorted([kind, s.encode()] for kind, s in slots.items())]
                   for k, slots in self.children.items()),
            sorted([k, sorted(map(list, dots))] for k, dots in self.removed.items() if dots),
            sorted(map(list, self.cleared)),
        ]

    @classmethod
    def decode(cls, data: list) -> "ORMap":
        state = cls()
        state.present = {k: {d[1]: (tuple(d), kind) for d, kind in a} for k, a in data[0]}
        state.children = {k: {kind: CLASSES[kind].decode(s) for kind, s in slots}
                          for k, slots in data[1]}
        state.removed = {k: {tuple(d) for d in dots} for k, dots in data[2]}
        state.cleared = {tuple(d) for d in data[3]}
        return state


CLASSES: dict[str, Callable[[], object]] = {
    LWW: LWWRegister, MV: MVRegister, GCOUNTER: GCounter, PNCOUNTER: PNCounter,
    SET: ORSet, MAP: ORMap,
}
