"""Gossip averaging of many members in one process, over an in-memory network.

Each member holds a float32 vector (random at the start) and runs the real
round logic: a :class:`~learn.group.GroupView` fed by heartbeats, and a
:class:`~learn.gossip.GossipRound` over the members that view says are live,
whose partners' vectors it averages with its own.  Time is virtual and the
rounds synchronous: round r starts at r × ``period``, everyone heartbeats to
everyone, each member pulls the vectors its partners held at the start of
the round, and all update at its end.

Each link has a latency drawn once (lognormal: median ``latency``, σ
``jitter``); a pull takes a round trip, and a partner whose answer comes
after ``timeout`` is skipped.  Churn: from round 1 on, a fraction of the
members leave without a word (members still counting them live pull them
and wait for the timeout) and as many join, each starting from a random live
member's copy and knowing the current members.  A pull moves what the wire
would carry (:func:`wire_bytes`).  The run stops once every live member is
within ``tolerance`` of the live members' mean (relative L2 distance).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import msgpack
import torch

from .encoded import Encoded
from .gossip import GossipRound
from .group import GroupView
from .wire import Contribution, frames


@dataclass(frozen=True)
class RoundStats:
    round: int
    live: int  # members at the end of the round
    joined: int
    left: int
    pulls: int  # partners asked, by all members together
    late: int  # ... that answered after the timeout over a slow link: skipped
    gone: int  # ... that had left: never answered, skipped at the timeout
    spread: float  # the largest relative L2 distance of a live member from the mean


@dataclass(frozen=True)
class SimResult:
    rounds: int  # rounds run: to convergence, or rounds_max
    bytes_per_member_per_round: float  # pulled, averaged over members and rounds
    converged: bool
    history: list[RoundStats]


def wire_bytes(dim: int) -> int:
    """What one pull of a ``dim``-value float32 vector carries: the signed
    contribution that heads it and the tensor's frames, msgpack-encoded."""
    contribution = Contribution("sim", 0, bytes(32), "params", 0, bytes(32))
    head = {"contribution": contribution.to_wire(), "signature": bytes(64)}
    named = [("x", Encoded("none", "float32", (dim,), 64, bytes(4 * dim)))]
    return len(msgpack.packb(head)) + sum(len(msgpack.packb(frame)) for frame in frames(named))


@dataclass
class _Member:
    vector: torch.Tensor
    view: GroupView
    rng: random.Random


def simulate(members: int = 256, d: int = 4, churn: float = 0.1, rounds_max: int = 200, seed: int = 0, *,
             dim: int = 1000, tolerance: float = 0.01, latency: float = 0.05, jitter: float = 1.0,
             timeout: float = 0.5, period: float = 1.0) -> SimResult:
    """Run gossip averaging among ``members`` members pulling ``d`` partners a
    round, ``churn`` of them replaced each round, until they agree within
    ``tolerance`` or ``rounds_max`` rounds have run; the same arguments give
    the same result."""
    if members < 2 or d < 0 or dim < 1 or rounds_max < 1 or not 0 <= churn < 1:
        raise ValueError("a simulation needs 2+ members, d >= 0, dim >= 1, rounds_max >= 1, 0 <= churn < 1")
    if not 0 < timeout < period or latency < 0 or jitter < 0:
        raise ValueError("a simulation needs 0 < timeout < period and non-negative latency and jitter")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    links: dict[tuple[bytes, bytes], float] = {}
    pull = wire_bytes(dim)

    def new_member(vector: torch.Tensor) -> tuple[bytes, _Member]:
        key = rng.randbytes(32)
        view = GroupView(key, heartbeat_interval=period, min_timeout=2 * period)
        return key, _Member(vector, view, random.Random(rng.getrandbits(64)))

    def round_trip(a: bytes, b: bytes) -> float:
        link = (min(a, b), max(a, b))
        if link not in links:
            links[link] = latency * math.exp(jitter * rng.gauss(0.0, 1.0))
        return 2 * links[link]

    alive = dict(new_member(torch.randn(dim, generator=gen)) for _ in range(members))
    history: list[RoundStats] = []
    moved = 0  # bytes pulled, all members, all rounds
    for round_ in range(rounds_max):
        now = round_ * period
        left = rng.sample(sorted(alive), int(churn * len(alive))) if round_ else []
        for key in left:
            del alive[key]
        stayed = sorted(alive)
        for _ in left:
            key, member = new_member(alive[rng.choice(stayed)].vector.clone())
            alive[key] = member
        keys = sorted(alive)
        live = {}
        for key in keys:
            view = alive[key].view
            for other in keys:
                if other != key:
                    view.heard(other, {}, now)
            live[key] = view.live(now)
            for stale in sorted(view.members.keys() - set(live[key])):
                view.drop(stale)
        start = {key: member.vector for key, member in alive.items()}
        pulls = late = gone = 0
        for key in keys:
            member = alive[key]
            gossip = GossipRound(key, live[key], d, member.rng, now, timeout)
            for partner in gossip.partners:
                if partner in start:
                    moved += pull
                    late += not gossip.received(partner, start[partner], now + round_trip(key, partner))
            gone += len(gossip.expired(now + period))
            pulls += len(gossip.partners)
            member.vector = torch.stack([start[key], *gossip.result()]).mean(dim=0)
        spread = _spread(torch.stack([alive[key].vector for key in keys]))
        history.append(RoundStats(round_, len(alive), len(left), len(left), pulls, late, gone, spread))
        if spread <= tolerance:
            break
    per_member = moved / sum(h.live for h in history)
    return SimResult(len(history), per_member, history[-1].spread <= tolerance, history)


def _spread(vectors: torch.Tensor) -> float:
    """The largest L2 distance of a row from the rows' mean, relative to the mean's norm."""
    mean = vectors.mean(dim=0)
    return float((vectors - mean).norm(dim=1).max() / mean.norm())
