"""Many members of one group in one process, over an in-memory network: gossip
averaging (:func:`simulate`) and DiLoCo's outer all-reduce (:func:`simulate_allreduce`).

Both run the real round logic, sans-IO, the way a member's shell drives it:
a :class:`~learn.group.GroupView` per member, fed by heartbeats, says who is
live; gossip rounds are :class:`~learn.gossip.GossipRound`, all-reduce rounds
:class:`~learn.allreduce.AllReduce`.  Time is virtual.  Each link between two
members has a one-way latency drawn once (:class:`Links`: lognormal, median
``latency``, σ ``jitter``), so a few links are slow enough to miss a deadline.
Messages are counted in the bytes the wire would carry: a signed
:class:`~learn.wire.Contribution` head and the tensor's frames.

**Gossip** (:func:`simulate`).  Each member holds a float32 vector (random at
the start).  Rounds are synchronous: round r starts at r × ``period``,
everyone heartbeats to everyone, each member pulls the vectors its partners
held at the start of the round (a pull takes a round trip; a partner whose
answer comes after ``timeout`` is skipped), and all average at its end.
Churn: from round 1 on, a fraction of the members leave without a word
(members still counting them live pull them and wait for the timeout) and as
many join, each starting from a random live member's copy.  The run stops
once every live member is within ``tolerance`` of the live members' mean
(relative L2 distance).

**All-reduce** (:func:`simulate_allreduce`, one round: :func:`allreduce_round`).
Each round, every contributor (the live members that joined by that round,
as its view says) averages a random float32 vector with the others through
its own :class:`~learn.allreduce.AllReduce`: it sends the parts ``outgoing``
names, feeds what arrives to ``received_part`` / ``received_reduced``, calls
``expire`` at the two deadlines and sends its reduced part to everyone once
it has one.  Messages leave through the sender's uplink one after another
(``bandwidth`` bytes a second; each member starts with the member after
itself, so not everyone queues at the same reducer first), then cross the
link.  Deaths: a fraction of the contributors die at a random time in the
round; a dead member sends nothing it had not finished sending and takes in
nothing.  As many new members join at the next round's start; they sit that
round out (they would take the state) and contribute from the one after.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass

import msgpack
import torch

from .allreduce import AllReduce
from .compress import decode, encode
from .encoded import Encoded
from .gossip import GossipRound
from .group import GroupView
from .robust import aggregate, parse_rule
from .tensors import tensor_bytes
from .wire import Contribution, frames

# --- what both simulations share --------------------------------------------------------------------


class Links:
    """One-way latencies between members, each link's drawn from ``rng`` the
    first time it is asked for (lognormal: median ``latency``, σ ``jitter``)
    and the same both ways ever after."""

    def __init__(self, rng: random.Random, latency: float, jitter: float):
        if latency < 0 or jitter < 0:
            raise ValueError("latency and jitter are non-negative")
        self._rng, self.latency, self.jitter = rng, latency, jitter
        self._drawn: dict[tuple[bytes, bytes], float] = {}

    def delay(self, a: bytes, b: bytes) -> float:
        """Seconds a message takes from ``a`` to ``b`` (or back)."""
        link = (min(a, b), max(a, b))
        if link not in self._drawn:
            self._drawn[link] = self.latency * math.exp(self.jitter * self._rng.gauss(0.0, 1.0))
        return self._drawn[link]


def _hear_all(views: dict[bytes, GroupView], now: float, info: dict[bytes, dict] | None = None
              ) -> dict[bytes, list[bytes]]:
    """Every member's heartbeat (saying ``info[member]``, or nothing) reaches every
    other at ``now``; each view then forgets the members it no longer counts
    live.  Returns each member's live members (sorted, itself not among them)."""
    live = {}
    for key, view in views.items():
        for other in views:
            if other != key:
                view.heard(other, info[other] if info else {}, now)
        live[key] = view.live(now)
        for stale in sorted(view.members.keys() - set(live[key])):
            view.drop(stale)
    return live


def _leaving(rng: random.Random, keys, fraction: float) -> list[bytes]:
    """``fraction`` of ``keys`` (rounded down), drawn at random."""
    return rng.sample(sorted(keys), int(fraction * len(keys)))


@functools.lru_cache(maxsize=8192)
def _signed_bytes(kind: str, codec: str, dtype: str, shape: tuple[int, ...], block: int, payload: int) -> int:
    """What one signed tensor set of one tensor carries on the wire: the
    contribution head and signature, then the tensor's frames, msgpack-encoded."""
    contribution = Contribution("sim", 0, bytes(32), kind, 0, bytes(32))
    head = {"contribution": contribution.to_wire(), "signature": bytes(64)}
    named = [("x", Encoded(codec, dtype, shape, block, bytes(payload)))]
    return len(msgpack.packb(head)) + sum(len(msgpack.packb(frame)) for frame in frames(named))


def _message_bytes(kind: str, enc: Encoded) -> int:
    """:func:`_signed_bytes` of ``enc`` sent as ``kind``."""
    return _signed_bytes(kind, enc.codec, enc.dtype, tuple(enc.shape), enc.block, len(enc.payload))


def wire_bytes(dim: int) -> int:
    """What one pull of a ``dim``-value float32 vector carries: the signed
    contribution that heads it and the tensor's frames, msgpack-encoded."""
    return _signed_bytes("params", "none", "float32", (dim,), 64, 4 * dim)


# --- gossip -------------------------------------------------------------------------------------------


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
    start_spread: float  # the spread of the members' vectors before the first round


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
    links = Links(rng, latency, jitter)
    pull = wire_bytes(dim)

    def new_member(vector: torch.Tensor) -> tuple[bytes, _Member]:
        key = rng.randbytes(32)
        view = GroupView(key, heartbeat_interval=period, min_timeout=2 * period)
        return key, _Member(vector, view, random.Random(rng.getrandbits(64)))

    alive = dict(new_member(torch.randn(dim, generator=gen)) for _ in range(members))
    start_spread = _spread(torch.stack([alive[key].vector for key in sorted(alive)]))
    history: list[RoundStats] = []
    moved = 0  # bytes pulled, all members, all rounds
    for round_ in range(rounds_max):
        now = round_ * period
        left = _leaving(rng, alive, churn) if round_ else []
        for key in left:
            del alive[key]
        stayed = sorted(alive)
        for _ in left:
            key, member = new_member(alive[rng.choice(stayed)].vector.clone())
            alive[key] = member
        keys = sorted(alive)
        live = _hear_all({key: alive[key].view for key in keys}, now)
        start = {key: member.vector for key, member in alive.items()}
        pulls = late = gone = 0
        for key in keys:
            member = alive[key]
            gossip = GossipRound(key, live[key], d, member.rng, now, timeout)
            for partner in gossip.partners:
                if partner in start:
                    moved += pull
                    late += not gossip.received(partner, start[partner], now + 2 * links.delay(key, partner))
            gone += len(gossip.expired(now + period))
            pulls += len(gossip.partners)
            member.vector = torch.stack([start[key], *gossip.result()]).mean(dim=0)
        spread = _spread(torch.stack([alive[key].vector for key in keys]))
        history.append(RoundStats(round_, len(alive), len(left), len(left), pulls, late, gone, spread))
        if spread <= tolerance:
            break
    per_member = moved / sum(h.live for h in history)
    return SimResult(len(history), per_member, history[-1].spread <= tolerance, history, start_spread)


def _spread(vectors: torch.Tensor) -> float:
    """The largest L2 distance of a row from the rows' mean, relative to the mean's norm."""
    mean = vectors.mean(dim=0)
    return float((vectors - mean).norm(dim=1).max() / mean.norm())


def predicted_rounds(spread: float, d: int, tolerance: float = 0.01) -> float:
    """Rounds for gossip with ``d`` fresh random partners a round to take the
    spread from ``spread`` to ``tolerance``, if each round divided every
    member's squared distance from the mean by d + 1 (as averaging d + 1
    independent vectors would; correlations between members make it slower)."""
    if d < 1 or spread <= tolerance:
        return 0 if spread <= tolerance else math.inf
    return math.ceil(2 * math.log(spread / tolerance) / math.log(d + 1))


# --- the all-reduce -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduceStats:
    round: int
    contributors: int  # the members the round's all-reduce was among
    joined: int  # members that joined at the round's start: they sit it out
    died: int  # contributors that died during the round
    left_out: int  # (part, contributor) pairs its reducer reduced without: the part came late, or never
    late: int  # messages that came past their deadline: parts after the reduction, reduced parts after the round
    missing_everywhere: int  # parts no surviving contributor holds at the deadline
    missing_somewhere: int  # parts some surviving contributor lacks at the deadline
    survivors: int  # contributors alive at the deadline
    finished: int  # ... holding the whole reduced vector
    identical: bool  # every finisher holds the same bytes (true when fewer than two finish)
    agreeing: int  # the most survivors holding the same parts with the same bytes (missing ones as holes)
    payload_per_member: float  # tensor bytes sent, averaged over the survivors
    wire_per_member: float  # ... with heads, signatures and the member lists as the wire carries them
    ideal_per_member: float  # 2 (N-1)/N of the vector's bytes: a butterfly all-reduce's


@dataclass(frozen=True)
class AllReduceResult:
    dim: int
    history: list[AllReduceStats]


class _Reducer:
    """The group's rule as one member's AllReduce calls it.  What it returns
    is the decoding of :attr:`encoded`, the encoding this member then sends,
    so the reducer holds the bits everyone else receives."""

    def __init__(self, rule: str, codec: str):
        self.rule, self.codec = parse_rule(rule), codec
        self.encoded: Encoded | None = None

    def __call__(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        self.encoded = encode(aggregate(parts, weights, self.rule).value, self.codec)
        return decode(self.encoded)


class Exchange:
    """One all-reduce round among ``vectors``' members (keys, sorted, are the
    contributors) over :class:`Links`, each member driving its own
    :class:`~learn.allreduce.AllReduce`; :meth:`run` plays it to the end.

    ``deaths`` maps a member to the time it dies.  :attr:`wire` counts, beside
    each message's signed head and frames, the contributors a part names and
    the contributors used that a reduced part names: with ``compact_lists``
    (the default, as meshd's shell sends them) as a 32-byte digest of the
    list and a bitmap over it, else as lists of keys (34 bytes a member, as
    the shell sent them before)."""

    def __init__(self, vectors: dict[bytes, torch.Tensor], links: Links, *, start: float = 0.0,
                 timeout: float = 1.0, bandwidth: float = 12.5e6, deaths: dict[bytes, float] | None = None,
                 codec: str = "none", rule: str = "mean", compact_lists: bool = True):
        if not 0 < bandwidth < math.inf:
            raise ValueError("an uplink's bandwidth is positive and finite")
        self.members = sorted(vectors)
        self.dim = vectors[self.members[0]].numel()
        self.links, self.bandwidth, self.codec = links, bandwidth, codec
        self.deaths = dict(deaths or {})
        self.reducers = {m: _Reducer(rule, codec) for m in self.members}
        self.ars = {m: AllReduce(m, self.members, vectors[m], reduce=self.reducers[m], now=start, timeout=timeout)
                    for m in self.members}
        self.start = start
        self.payload = dict.fromkeys(self.members, 0)  # tensor bytes each member finished sending
        self.wire = dict.fromkeys(self.members, 0)  # ... and everything around them
        self.late = 0
        self.compact_lists = compact_lists
        self._list_bytes = len(msgpack.packb(bytes(32) if compact_lists else self.members))
        self._uplink_free = dict.fromkeys(self.members, start)
        self._queue: list[tuple] = []
        self._order = itertools.count()
        self._broadcast: set[bytes] = set()

    def alive(self, member: bytes, at: float) -> bool:
        """``member`` has not died by ``at``."""
        return at < self.deaths.get(member, math.inf)

    def survivors(self) -> list[bytes]:
        """The contributors alive at the round's deadline (sorted)."""
        return [m for m in self.members if self.alive(m, self.ars[m].deadline)]

    def run(self) -> "Exchange":
        """Send every part, deliver every message in time order, expire every
        member at both deadlines; returns this exchange, played out."""
        for member in self.members:
            self._send_parts(member)
            self._maybe_broadcast(member, self.start)  # a member alone reduces at once
        any_ar = self.ars[self.members[0]]
        for at in (any_ar.parts_deadline, any_ar.deadline):
            self._push(at, "expire", None, None, None, None, None)
        while self._queue:
            at, _, kind, src, dst, index, enc, used = heapq.heappop(self._queue)
            if kind == "expire":
                self._expire_all(at)
            elif self.alive(dst, at):
                self._deliver(at, kind, src, dst, index, decode(enc), used)
        return self

    def _push(self, at: float, *event) -> None:
        heapq.heappush(self._queue, (at, next(self._order), *event))

    def _send(self, at: float, src: bytes, dst: bytes, kind: str, index: int, enc: Encoded,
              used: list[bytes] | None, extra: int) -> None:
        """Queue one message (its signed tensor set and ``extra`` bytes of head)
        on ``src``'s uplink from ``at``; it leaves when the uplink is free and
        arrives a link's delay after its last byte, unless ``src`` dies before
        that last byte (then it and all after it are lost)."""
        payload = len(enc.payload)
        size = _message_bytes(f"{kind}:0:{index}", enc) + extra
        done = max(at, self._uplink_free[src]) + size / self.bandwidth
        if not self.alive(src, done):
            return
        self._uplink_free[src] = done
        self.payload[src] += payload
        self.wire[src] += size
        self._push(done + self.links.delay(src, dst), kind, src, dst, index, enc, used)

    def _send_parts(self, member: bytes) -> None:
        """``member`` sends every part ``outgoing`` names, starting with the reducer after itself."""
        ar = self.ars[member]
        outgoing = ar.outgoing()
        for reducer, index, part in outgoing[ar.index:] + outgoing[:ar.index]:
            self._send(self.start, member, reducer, "part", index, encode(part, self.codec), None,
                       self._list_bytes)

    def _maybe_broadcast(self, member: bytes, at: float) -> None:
        """Once ``member`` has reduced its part, send it (as encoded) to every other member, once."""
        ar = self.ars[member]
        if member in self._broadcast or ar.reduced(ar.index) is None:
            return
        self._broadcast.add(member)
        used = ar.reduced(ar.index)[1]
        extra = len(msgpack.packb(bytes(-(-len(self.members) // 8)) if self.compact_lists else used))
        others = self.members[ar.index + 1:] + self.members[:ar.index]
        for peer in others:
            self._send(at, member, peer, "reduced", ar.index, self.reducers[member].encoded, used, extra)

    def _deliver(self, at: float, kind: str, src: bytes, dst: bytes, index: int, tensor: torch.Tensor,
                 used: list[bytes] | None) -> None:
        """Hand one arrived message to its (live) receiver's AllReduce."""
        ar = self.ars[dst]
        if kind == "part":
            taken = ar.received_part(src, index, tensor)
            self._maybe_broadcast(dst, at)
        else:
            taken = ar.received_reduced(src, index, tensor, used)
        self.late += not taken

    def _expire_all(self, at: float) -> None:
        """Every member alive at ``at`` moves its round on; those that reduce now send."""
        for member in self.members:
            if self.alive(member, at) and self.ars[member].expire(at):
                self._maybe_broadcast(member, at)

    def holdings(self, member: bytes) -> bytes:
        """A digest of the parts ``member`` holds, with their bits, and of where it has holes."""
        ar, digest = self.ars[member], hashlib.sha256()
        for index in range(len(self.members)):
            part = ar.reduced(index)
            digest.update(b"\1" + hashlib.sha256(tensor_bytes(part[0])).digest() if part else b"\0")
        return digest.digest()

    def stats(self, round_: int = 0, joined: int = 0) -> AllReduceStats:
        """What this played-out exchange did, as :class:`AllReduceStats` says
        (``round_`` and ``joined`` are the caller's, to report)."""
        ars, survivors, n = self.ars, self.survivors(), len(self.members)
        missing = [set(ars[m].missing_parts()) for m in survivors]
        reducers = [ar for ar in ars.values() if ar.reduced(ar.index) is not None]
        finished = [m for m in survivors if ars[m].result() is not None]
        digests = {m: self.holdings(m) for m in survivors}
        return AllReduceStats(
            round_, n, joined, n - len(survivors),
            left_out=sum(len(ar.contributors_missing()) for ar in reducers), late=self.late,
            missing_everywhere=len(set.intersection(*missing)) if missing else 0,
            missing_somewhere=len(set.union(*missing)) if missing else 0,
            survivors=len(survivors), finished=len(finished),
            identical=len({digests[m] for m in finished}) <= 1,
            agreeing=max(Counter(digests.values()).values(), default=0),
            payload_per_member=_mean(self.payload[m] for m in survivors),
            wire_per_member=_mean(self.wire[m] for m in survivors),
            ideal_per_member=2 * (n - 1) / n * 4 * self.dim)


def allreduce_round(vectors: dict[bytes, torch.Tensor], links: Links, **kw) -> Exchange:
    """One all-reduce round among ``vectors``' members, played out (see :class:`Exchange`)."""
    return Exchange(vectors, links, **kw).run()


def _mean(values) -> float:
    """The mean of ``values``, 0 for none."""
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def simulate_allreduce(members: int = 128, rounds: int = 3, deaths: float = 0.0, seed: int = 0, *,
                       dim: int = 1 << 14, latency: float = 0.05, jitter: float = 1.0, timeout: float = 1.0,
                       bandwidth: float = 12.5e6, codec: str = "none", rule: str = "mean",
                       compact_lists: bool = True) -> AllReduceResult:
    """Run ``rounds`` all-reduce rounds of ``dim``-value vectors among
    ``members`` members, ``deaths`` of each round's contributors dying during
    it and as many joining at the next round's start; the same arguments give
    the same result."""
    if members < 1 or rounds < 1 or dim < 1 or not 0 <= deaths < 1:
        raise ValueError("an all-reduce simulation needs 1+ members, rounds and values, and 0 <= deaths < 1")
    if not 0 < timeout < math.inf:
        raise ValueError("the timeout is positive and finite")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    links = Links(rng, latency, jitter)
    period = 3 * timeout  # every message of a round is in or given up by 2 × timeout
    joined_at: dict[bytes, int] = {}
    views: dict[bytes, GroupView] = {}

    def join(round_: int) -> None:
        key = rng.randbytes(32)
        joined_at[key] = round_
        # live for half a round after a heartbeat: the dead are gone by the next round's start
        views[key] = GroupView(key, heartbeat_interval=period / 6, min_timeout=period / 2)

    for _ in range(members):
        join(0)
    history = []
    for round_ in range(rounds):
        now = round_ * period
        info = {key: {"round": round_, "joined": joined_at[key]} for key in views}
        _hear_all(views, now, info)
        contributors = _contributors(views, round_, now, joined_at)
        vectors = {key: torch.randn(dim, generator=gen) for key in contributors}
        dying = {key: now + rng.uniform(0, 2 * timeout) for key in _leaving(rng, contributors, deaths)}
        exchange = allreduce_round(vectors, links, start=now, timeout=timeout, bandwidth=bandwidth,
                                   deaths=dying, codec=codec, rule=rule, compact_lists=compact_lists)
        history.append(exchange.stats(round_, len(views) - len(contributors)))
        for key in dying:
            del views[key], joined_at[key]
        for _ in dying:
            join(round_ + 2)  # joins at the next round's start, contributes from the one after
    return AllReduceResult(dim, history)


def _contributors(views: dict[bytes, GroupView], round_: int, now: float, joined_at: dict[bytes, int]
                  ) -> list[bytes]:
    """The contributors to ``round_`` (sorted) as every member that joined by
    then works them out from its view: the live trainers that joined by then,
    and itself.  RuntimeError if two views disagree (the simulation's
    heartbeats reach everyone, so they must not)."""
    lists = {tuple(sorted(views[key].eligible(round_, now) + [key])) for key in views if joined_at[key] <= round_}
    if len(lists) != 1:
        raise RuntimeError(f"the members' views name {len(lists)} different lists of contributors")
    return list(lists.pop())
