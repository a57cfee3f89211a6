"""A training group's membership entries, sans-IO: what one member writes of itself, and how readers judge it.

Each member of a group keeps one entry in the group's replicated membership
document: when it joined, its role, its measured throughput, its round, when
it last wrote (``seen``) and how often it means to (``every``), and, once it
has left, when.  This module holds the pure parts:

* :func:`entry` builds the map a member writes; :func:`check_entry` checks
  one a peer wrote (every field, strictly) and :func:`state_of` says whether
  its member is ``live``, ``quiet`` (missed :data:`QUIET_AFTER` refreshes)
  or ``left``;
* :class:`Throughput` measures samples and steps per second between writes;
* :class:`Refresh` bounds how often a member writes: every ``interval``, or
  sooner (never within ``min_gap``) when its role changes;
* :func:`choose_owner` picks the document the group converges on when
  members started documents of their own at the same time;
* :func:`suspect` says when a reducer's count of clipped rounds makes a
  member worth reporting; :func:`clipped_by_group` sums what the entries
  say their rules clipped of whom (``clipped``: peer -> [rounds clipped,
  rounds used], for the members each clipped at least once) and counts the
  entries that find each a suspect, and :func:`suspect_of_group` makes it
  the group's when most do.

Times are seconds; ``joined``, ``seen`` and ``left`` are wall-clock (Unix)
times, since readers on other machines compare them with their own clocks.
"""

from __future__ import annotations

import math
from typing import Hashable, Iterable

ROLES = ("joining", "contributor", "follower")
"""joining: no round finished yet; contributor: its update was in the last round's
average (DiLoCo) or it offered and merged parameters (gossip); follower: it took the
last round's outcome without contributing (off the round's roster)."""

STATES = ("live", "quiet", "left")
QUIET_AFTER = 3  # refreshes an entry may miss before its member reads as quiet
MAX_ISLAND = 1 << 20  # processes one member may speak for (an island's size)
MAX_EVERY = 86_400.0  # the longest refresh interval an entry may announce
MAX_CLIPPED = 32  # members an entry reports clipped (the most clipped first)
MAX_PEER_TEXT = 128  # characters of a peer's name in an entry's ``clipped``
SUSPECT_AFTER = 3  # rounds clipped before a member is reported


def suspect(clipped: int, used: int) -> bool:
    """Whether a member whose contribution was clipped in ``clipped`` of the ``used``
    rounds it was averaged in is worth reporting: :data:`SUSPECT_AFTER` rounds or
    more, and most of them."""
    return clipped >= SUSPECT_AFTER and 2 * clipped > used


def entry(*, joined: float, role: str, island: int, samples_s: float, steps_s: float, round: int,
          seen: float, every: float, left: float | None = None, clipped: dict | None = None) -> dict:
    """The map a member writes of itself (``left``: when it left, None while it is a member;
    ``clipped``: peer -> [rounds clipped, rounds used] as its rule saw them, at most
    :data:`MAX_CLIPPED`)."""
    return check_entry({"joined": joined, "role": role, "island": island, "samples_s": samples_s,
                        "steps_s": steps_s, "round": round, "seen": seen, "every": every, "left": left,
                        "clipped": clipped or {}}, strict=True)


def check_entry(value: object, *, strict: bool = False) -> dict | None:
    """``value`` as an entry (the known fields, numbers as float) if every field is well-formed;
    None otherwise, or ValueError with ``strict``.  Unknown keys are ignored."""
    try:
        if not isinstance(value, dict):
            raise ValueError("an entry is a map")
        out = {name: _number(value.get(name), name) for name in ("joined", "seen")}
        out["left"] = None if value.get("left") is None else _number(value["left"], "left")
        role = value.get("role")
        if role not in ROLES:
            raise ValueError(f"role is one of {', '.join(ROLES)}")
        out["role"] = role
        island = value.get("island")
        if type(island) is not int or not 1 <= island <= MAX_ISLAND:
            raise ValueError(f"island is 1 to {MAX_ISLAND} processes")
        out["island"] = island
        round_ = value.get("round")
        if type(round_) is not int or not 0 <= round_ < 1 << 63:
            raise ValueError("round is a non-negative integer")
        out["round"] = round_
        for name in ("samples_s", "steps_s"):
            out[name] = _number(value.get(name), name)
        out["every"] = _number(value.get("every"), "every")
        if not 0 < out["every"] <= MAX_EVERY:
            raise ValueError(f"every is more than 0 and at most {MAX_EVERY:g} seconds")
        out["clipped"] = _clipped(value.get("clipped", {}))
    except ValueError:
        if strict:
            raise
        return None
    return out


def _clipped(value: object) -> dict[str, list[int]]:
    if not isinstance(value, dict) or len(value) > MAX_CLIPPED:
        raise ValueError(f"clipped is a map of at most {MAX_CLIPPED} members")
    out = {}
    for peer, counts in value.items():
        if not (isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_TEXT and isinstance(counts, list | tuple)
                and len(counts) == 2 and all(type(c) is int for c in counts) and 0 <= counts[0] <= counts[1] < 1 << 63):
            raise ValueError("clipped maps a peer to [rounds clipped, rounds used], 0 <= clipped <= used")
        out[peer] = [counts[0], counts[1]]
    return out


def clipped_by_group(entries: dict[str, dict]) -> dict[str, tuple[int, int, int]]:
    """Per peer named in the ``clipped`` of the checked ``entries`` (peer -> entry): its
    rounds clipped and rounds used, summed over the other entries (each member counts
    the slices it reduced), and how many of those entries find it a :func:`suspect`
    on their own counts (a vote: one lying entry cannot make a suspect of anyone)."""
    sums: dict[str, list[int]] = {}
    for author, checked in entries.items():
        for peer, (clipped, used) in checked["clipped"].items():
            if peer != author:
                total = sums.setdefault(peer, [0, 0, 0])
                total[0] += clipped
                total[1] += used
                total[2] += suspect(clipped, used)
    return {peer: (c, u, n) for peer, (c, u, n) in sums.items()}


def suspect_of_group(suspecting: int, voters: int) -> bool:
    """Whether a member is the group's suspect: most of the ``voters`` (the live
    entries of the other members) find it one on their own counts."""
    return 2 * suspecting > voters


def _number(value: object, name: str) -> float:
    if type(value) not in (int, float) or not 0 <= value < math.inf:
        raise ValueError(f"{name} is a finite non-negative number")
    return float(value)


def state_of(checked: dict, now: float) -> str:
    """``left`` if the entry says its member left; ``quiet`` if it was last written more
    than :data:`QUIET_AFTER` of its own refresh intervals before ``now``; else ``live``."""
    if checked["left"] is not None:
        return "left"
    return "quiet" if now - checked["seen"] > QUIET_AFTER * checked["every"] else "live"


def choose_owner(current: bytes | None, named: Iterable[bytes], live: Iterable[bytes]) -> bytes | None:
    """The owner of the membership document a member should use.

    ``current`` is the one it uses (None: none yet), ``named`` the owners live
    members name in their hellos, ``live`` the live members (itself included).
    A member with none takes the lowest live owner named, or else the lowest
    named; a member with one moves only to a lower owner that is live (two
    members that started documents at once end on the lower one's), so a
    document is not left because its owner went quiet for a while, nor for
    an owner nobody hears.  None: nobody names one (the member may start its own).
    """
    live = set(live)
    named = set(named)
    live_named = named & live
    if current is None:
        pool = live_named or named
        return min(pool) if pool else None
    lower = [owner for owner in live_named if owner < current]
    return min(lower) if lower else current


class Throughput:
    """Samples and steps per second, each measured over the time between two
    :meth:`measure` calls (the first from ``start``)."""

    def __init__(self, start: float):
        self._since = start
        self._steps = 0
        self._samples = 0
        self.samples_s = 0.0
        self.steps_s = 0.0

    def add(self, steps: int = 0, samples: int = 0) -> None:
        """Count ``steps`` and ``samples`` done (cheap: call it every step)."""
        self._steps += steps
        self._samples += samples

    def measure(self, now: float) -> tuple[float, float]:
        """(samples/s, steps/s) since the last measurement, and start a new one;
        the last rates again if no time has passed."""
        elapsed = now - self._since
        if elapsed > 0:
            self.samples_s, self.steps_s = self._samples / elapsed, self._steps / elapsed
            self._since, self._steps, self._samples = now, 0, 0
        return self.samples_s, self.steps_s


class Refresh:
    """When a member writes its entry: at once the first time, then every
    ``interval`` seconds, and sooner when what it says of itself changes
    (``key``: its role, ...), but never twice within ``min_gap``."""

    def __init__(self, interval: float, min_gap: float):
        if not 0 <= min_gap <= interval:
            raise ValueError("a refresh needs 0 <= min_gap <= interval")
        self.interval, self.min_gap = interval, min_gap
        self._last: float | None = None
        self._key: Hashable = None

    def due(self, now: float, key: Hashable) -> bool:
        """Whether to write now, saying ``key``."""
        if self._last is None:
            return True
        waited = now - self._last
        return waited >= self.interval or (key != self._key and waited >= self.min_gap)

    def written(self, now: float, key: Hashable) -> None:
        """Note a write at ``now`` that said ``key``."""
        self._last, self._key = now, key

    def reset(self) -> None:
        """Write at the next chance (another document, say)."""
        self._last, self._key = None, None
