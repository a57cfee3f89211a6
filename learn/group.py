"""One member's view of its training group, and timeouts that follow measurements.

:class:`GroupView` keeps what each member's last hello said and when it came;
a member not heard from for ``dead_after`` seconds is no longer live.
:class:`RoundClock` sets exchange timeouts from the durations it has seen,
so nobody has to tune them (hivemind's most common complaint).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Member:
    peer: bytes
    round: int  # the round it works on
    joined: int  # the first round it contributes to
    hash: bytes | None  # its state hash after round hash_round
    hash_round: int
    last_seen: float


class GroupView:
    """The members of one group that ``me`` has heard from."""

    def __init__(self, me: bytes, *, heartbeat_interval: float = 2.0, min_timeout: float = 6.0):
        self.me = me
        self.heartbeat_interval = heartbeat_interval
        self.min_timeout = min_timeout
        self.members: dict[bytes, Member] = {}

    def dead_after(self) -> float:
        """Seconds of silence after which a member is not live."""
        return max(self.min_timeout, 3 * self.heartbeat_interval)

    def heard(self, peer: bytes, info: dict, now: float) -> Member:
        """Record ``peer``'s hello ``info``; ValueError if a field is malformed."""
        round_, joined = info.get("round"), info.get("joined")
        hash_, hash_round = info.get("hash"), info.get("hash_round")
        if type(round_) is not int or type(joined) is not int or round_ < 0 or joined < 0:
            raise ValueError("round and joined are non-negative integers")
        if not (hash_ is None or (isinstance(hash_, bytes) and len(hash_) == 32)) or type(hash_round) is not int:
            raise ValueError("hash is 32 bytes or nil, hash_round an integer")
        member = self.members[peer] = Member(peer, round_, joined, hash_, hash_round, now)
        return member

    def live(self, now: float) -> list[bytes]:
        """Members heard from within :meth:`dead_after` (sorted)."""
        return sorted(p for p, m in self.members.items() if now - m.last_seen <= self.dead_after())

    def eligible(self, round: int, now: float) -> list[bytes]:
        """Live members expected to contribute to ``round`` (joined by then)."""
        return [p for p in self.live(now) if self.members[p].joined <= round]

    def drop(self, peer: bytes) -> None:
        self.members.pop(peer, None)


class RoundClock:
    """Timeouts from measured durations: 3 × the 90th percentile of the last 20,
    within [floor, ceiling]; ``default`` before the first measurement."""

    def __init__(self, *, floor: float = 5.0, ceiling: float = 600.0, default: float = 30.0, window: int = 20):
        self.floor, self.ceiling, self.default = floor, ceiling, default
        self._seen: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._seen.append(max(0.0, seconds))

    def timeout(self) -> float:
        if not self._seen:
            return min(max(self.default, self.floor), self.ceiling)
        ordered = sorted(self._seen)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return min(max(3 * p90, self.floor), self.ceiling)
