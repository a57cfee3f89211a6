"""One member's view of its training group, and timeouts that follow measurements.

:class:`GroupView` keeps what each other member last said about itself and
when it was last heard from (a heartbeat or any other message); a member
silent for :meth:`GroupView.dead_after` seconds is no longer live.  A member
that joins while the group is in round r announces r+1 as its join round and
contributes from then on, so a round's contributors are not changed by
members arriving during it.

:class:`RoundClock` sets exchange timeouts from the durations it has seen,
so nobody has to tune them (hivemind's most common complaint).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

ROLES = ("trainer", "observer")  # an observer follows the group and contributes nothing
HASH_HISTORY = 4  # rounds of a member's state hashes kept: one that has moved on still votes on them


@dataclass
class Member:
    peer: bytes
    round: int  # the round it works on
    joined: int | None  # the first round it contributes to; None until it says
    role: str  # one of ROLES
    throughput: float  # samples per second, as it reports them
    hash: bytes | None  # its state hash after round hash_round
    hash_round: int
    last_seen: float
    hashes: dict[int, bytes] = field(default_factory=dict)  # its hash after each of its latest rounds


class GroupView:
    """The other members of one group that ``me`` has heard from."""

    def __init__(self, me: bytes, *, heartbeat_interval: float = 5.0, min_timeout: float = 10.0):
        self.me = me
        self.heartbeat_interval = heartbeat_interval
        self.min_timeout = min_timeout
        self.members: dict[bytes, Member] = {}

    def dead_after(self) -> float:
        """Seconds of silence after which a member is not live: three missed
        heartbeats, and never less than ``min_timeout``."""
        return max(self.min_timeout, 3 * self.heartbeat_interval)

    def heard(self, peer: bytes, info: dict, now: float) -> Member:
        """Record a message from ``peer`` at ``now``, and what ``info`` says of it
        (any of ``round``, ``joined``, ``role``, ``throughput``, ``hash``,
        ``hash_round``, and ``hashes``: [round, hash] pairs for its latest
        rounds; what it leaves out stays as it was, other keys are the
        caller's).  Its hashes of the last :data:`HASH_HISTORY` rounds are
        kept, what it says now over what it said before, none of a round after
        its latest hash's (it went back to the group's state).  ValueError for a
        malformed field or for ``me``, and then nothing changes."""
        if peer == self.me:
            raise ValueError("a member does not hear itself")
        if not isinstance(info, dict):
            raise ValueError("what a member says of itself is a map")
        old = self.members.get(peer)
        if old is None:
            old = Member(peer, 0, None, "trainer", 0.0, None, -1, now)
        member = Member(peer, info.get("round", old.round), info.get("joined", old.joined),
                        info.get("role", old.role), info.get("throughput", old.throughput),
                        info.get("hash", old.hash), info.get("hash_round", old.hash_round), now,
                        {**old.hashes, **_said_hashes(info.get("hashes", []))})
        _check(member)
        if member.hash is not None:  # hashes of rounds after it are forgotten: it went back to the group's state
            member.hashes = {r: h for r, h in member.hashes.items() if r <= member.hash_round}
            if member.hash_round >= 0:
                member.hashes[member.hash_round] = member.hash
        member.hashes = {r: member.hashes[r] for r in sorted(member.hashes)[-HASH_HISTORY:]}
        self.members[peer] = member
        return member

    def live(self, now: float) -> list[bytes]:
        """The members heard from less than :meth:`dead_after` seconds ago (sorted)."""
        dead_after = self.dead_after()
        return sorted(p for p, m in self.members.items() if now - m.last_seen < dead_after)

    def eligible(self, round: int, now: float) -> list[bytes]:
        """The live trainers that contribute to ``round``: they said they joined by then (sorted)."""
        return [p for p in self.live(now)
                if self.members[p].role == "trainer" and self.members[p].joined is not None
                and self.members[p].joined <= round]

    def drop(self, peer: bytes) -> None:
        """Forget ``peer`` (it said goodbye, or is known gone) until it is heard again."""
        self.members.pop(peer, None)


def majority(held: dict[bytes, tuple[bytes, int]]) -> tuple[bytes, bytes] | None:
    """The majority's state hash for one round, and the member to take it from.

    ``held`` maps members to (their hash for that round, the round each works
    on now).  The hash with most votes wins; in a tie, the one held by the
    member furthest ahead, then by the lowest key (a member behind the others
    is likelier the one that missed their exchange).  Its source is its
    holder furthest ahead, the lowest key among equals.  None if ``held`` is empty."""
    holders: dict[bytes, list[tuple[int, bytes]]] = {}
    for member, (hash_, round_) in held.items():
        holders.setdefault(hash_, []).append((-round_, member))
    if not holders:
        return None
    best = {hash_: min(them) for hash_, them in holders.items()}
    top = min(holders, key=lambda h: (-len(holders[h]), best[h]))
    return top, best[top][1]


def state_source(states: dict[bytes, tuple[int, dict[int, bytes]]],
                 silent: Iterable[dict[int, bytes]] = ()) -> tuple[bytes, int]:
    """The member to take the group's state from, and how many members hold that state.

    ``states`` maps each live member (the caller too) to the round it works on
    and its latest hashes by round.  A member's state is its latest hash; it is
    *corroborated* when another member holds the same hash for that round (one
    there too, or one that has moved on).  The source is the member furthest
    ahead (the lowest key among equals) whose state is corroborated, so one
    member that says it is far ahead, a runaway that trained alone or a liar,
    is not followed while two others agree.  With no state corroborated (a run's
    start, or members that each went their own way) it is the member furthest
    ahead, and the count is 1.

    ``silent`` holds the hashes of members heard from before but not lately:
    they are no source, but still vouch for the states they held, so that a
    moment in which the others all look silent (this node's own loop stalled,
    and the first hello it reads after is the liar's) does not leave the one
    claiming to be far ahead as the only choice."""
    witnesses = [hashes for _, hashes in states.values()] + list(silent)

    def holders(member: bytes) -> int:
        hashes = states[member][1]
        if not hashes:
            return 1
        round_ = max(hashes)
        return sum(other.get(round_) == hashes[round_] for other in witnesses)

    held = {member: holders(member) for member in states}
    corroborated = [member for member, count in held.items() if count >= 2] or list(states)
    source = min(corroborated, key=lambda member: (-states[member][0], member))
    return source, held[source]


def _said_hashes(pairs: object) -> dict[int, bytes]:
    """The ``hashes`` a hello carries, checked: at most :data:`HASH_HISTORY` [round, 32-byte hash] pairs."""
    if not isinstance(pairs, list) or len(pairs) > HASH_HISTORY:
        raise ValueError(f"hashes is a list of at most {HASH_HISTORY} [round, hash] pairs")
    said = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
                and isinstance(pair[1], bytes) and len(pair[1]) == 32):
            raise ValueError("each of hashes is [round, 32-byte hash]")
        said[pair[0]] = pair[1]
    return said


def _check(member: Member) -> None:
    if type(member.round) is not int or member.round < 0:
        raise ValueError("round is a non-negative integer")
    if member.joined is not None and (type(member.joined) is not int or member.joined < 0):
        raise ValueError("joined is a non-negative integer or nil")
    if member.role not in ROLES:
        raise ValueError(f"role is one of {', '.join(ROLES)}")
    if type(member.throughput) not in (int, float) or not 0 <= member.throughput < math.inf:
        raise ValueError("throughput is a finite non-negative number")
    if not (member.hash is None or (isinstance(member.hash, bytes) and len(member.hash) == 32)):
        raise ValueError("hash is 32 bytes or nil")
    if type(member.hash_round) is not int or member.hash_round < -1:
        raise ValueError("hash_round is an integer, -1 for none")


class RoundClock:
    """Timeouts from measured durations: 3 × the 90th percentile of the last
    ``window``, within [floor, ceiling]; ``default`` (so clamped) before the
    first measurement."""

    def __init__(self, *, floor: float = 5.0, ceiling: float = 600.0, default: float = 30.0, window: int = 20):
        if not 0 <= floor <= ceiling or window < 1:
            raise ValueError("a round clock needs 0 <= floor <= ceiling and a window of at least 1")
        self.floor, self.ceiling, self.default = floor, ceiling, default
        self._seen: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float, complete: bool = True) -> None:
        """Record one round's (or exchange's) duration; ValueError unless finite and non-negative.

        A round that was not ``complete`` (a contributor's part never came, so it
        ran to its deadline) is not recorded: it measures the timeout, not the
        members, and each such round would stretch the next timeout 3x."""
        if not 0 <= seconds < math.inf:
            raise ValueError(f"a duration is finite and non-negative, not {seconds}")
        if complete:
            self._seen.append(seconds)

    def timeout(self) -> float:
        """How long to wait for the next round."""
        if not self._seen:
            return min(max(self.default, self.floor), self.ceiling)
        ordered = sorted(self._seen)
        p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank
        return min(max(3 * p90, self.floor), self.ceiling)
