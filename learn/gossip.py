"""One gossip round of one member: which partners to pull, and what came back in time."""

from __future__ import annotations

import random


class GossipRound:
    """Pull ``d`` random live partners; a partner that fails or misses the
    deadline (``now + timeout``) is skipped and the round goes on."""

    def __init__(self, me: bytes, live: list[bytes], d: int, rng: random.Random, now: float, timeout: float):
        others = sorted(p for p in live if p != me)
        self.partners = rng.sample(others, min(d, len(others)))
        self.deadline = now + timeout
        self._results: dict[bytes, object] = {}
        self._failed: set[bytes] = set()

    def received(self, peer: bytes, state: object, now: float) -> bool:
        """Take ``peer``'s state; False (ignored) if it is late or not a partner."""
        if peer not in self.partners or now > self.deadline or peer in self._failed:
            return False
        self._results[peer] = state
        return True

    def failed(self, peer: bytes) -> None:
        self._failed.add(peer)

    def done(self, now: float) -> bool:
        """Every partner answered or failed, or the deadline passed."""
        return now > self.deadline or len(self._results) + len(self._failed) >= len(self.partners)

    def result(self) -> list:
        """The states received, in partner order (so merging is deterministic)."""
        return [self._results[p] for p in self.partners if p in self._results]
