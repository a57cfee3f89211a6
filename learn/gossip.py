"""One gossip round of one member: which partners to pull, and what came back in time.

The round picks ``d`` random live partners; each ends received (its state
came by the deadline), failed (the caller could not reach it) or late (no
state by the deadline: skipped, and the round goes on without it).  The
states come out in partner order, so merging them (the caller's business,
with :mod:`learn.merge`) gives the same result whatever order they came in.
"""

from __future__ import annotations

import random

_SKIPPED = object()  # a partner that failed or was late


class GossipRound:
    """Pull ``d`` random live partners (not ``me``; all of them if fewer are
    live); a partner that fails or misses the deadline ``now + timeout`` is
    skipped."""

    def __init__(self, me: bytes, live: list[bytes], d: int, rng: random.Random, now: float, timeout: float):
        if d < 0 or timeout < 0:
            raise ValueError("a gossip round needs d >= 0 partners and a timeout >= 0")
        others = sorted(set(live) - {me})
        self.partners: list[bytes] = rng.sample(others, min(d, len(others)))
        self.deadline = now + timeout
        self._ended: dict[bytes, object] = {}  # partner -> its state, or _SKIPPED

    def received(self, peer: bytes, state: object, now: float) -> bool:
        """Take ``peer``'s state, which came at ``now``; True if it counts.  An
        answer after the deadline is late (the partner is skipped); one from a
        member not asked, or from a partner already over, is ignored."""
        if peer not in self.partners or peer in self._ended:
            return False
        self._ended[peer] = state if now <= self.deadline else _SKIPPED
        return now <= self.deadline

    def failed(self, peer: bytes) -> None:
        """``peer`` could not be asked or did not answer: skip it (if it has not answered)."""
        if peer in self.partners:
            self._ended.setdefault(peer, _SKIPPED)

    def expired(self, now: float) -> list[bytes]:
        """Once ``now`` is past the deadline, skip the partners still silent; returns them."""
        if now <= self.deadline:
            return []
        silent = [p for p in self.partners if p not in self._ended]
        for peer in silent:
            self._ended[peer] = _SKIPPED
        return silent

    def done(self) -> bool:
        """Every partner answered or was skipped."""
        return len(self._ended) == len(self.partners)

    def result(self) -> list:
        """The states received in time, in partner order (so merging is deterministic)."""
        states = (self._ended.get(p, _SKIPPED) for p in self.partners)
        return [state for state in states if state is not _SKIPPED]
