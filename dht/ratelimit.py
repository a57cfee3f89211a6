"""Per-peer token buckets, with time passed in and bounded memory."""

from __future__ import annotations

from typing import Hashable


class RateLimiter:
    """A token bucket per peer: each holds up to ``burst`` tokens and refills
    at ``rate`` tokens per second; a peer never seen starts full.

    At most ``max_peers`` buckets are kept.  Beyond that the least recently
    used peer is forgotten: its bucket has had the longest to refill, so it is
    the likeliest to be full, and forgetting a full bucket loses nothing (at
    worst a forgotten peer gets a fresh burst).
    """

    def __init__(self, rate: float, burst: int, max_peers: int = 10000) -> None:
        if rate <= 0 or burst < 1 or max_peers < 1:
            raise ValueError("rate must be positive, burst and max_peers at least 1")
        self._rate = rate
        self._burst = burst
        self._max_peers = max_peers
        # peer -> (tokens, time of last update), least recently used first
        self._buckets: dict[Hashable, tuple[float, float]] = {}

    def allow(self, peer: Hashable, now: float, cost: float = 1) -> bool:
        """Take ``cost`` tokens from ``peer``'s bucket at time ``now`` if it
        holds that many, and say whether it did.  A cost above ``burst`` is
        never allowed.  Time running backwards refills nothing."""
        tokens, updated = self._buckets.pop(peer, (self._burst, now))
        tokens = min(self._burst, tokens + max(0.0, now - updated) * self._rate)
        allowed = tokens >= cost
        self._buckets[peer] = (tokens - cost if allowed else tokens, max(now, updated))
        if len(self._buckets) > self._max_peers:
            del self._buckets[next(iter(self._buckets))]
        return allowed

    def __len__(self) -> int:
        """How many peers are being tracked."""
        return len(self._buckets)
